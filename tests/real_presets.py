"""Real Hugging Face configs (no weights), copied into the repository so that
a fresh clone needs nothing beside it: the planner's tests plan against them.

Example:

```python
plan = keras_hub_autodist.plan(str(REAL_PRESETS / "gemma_2b"), {"batch": 8})
```
"""

import pathlib

REAL_PRESETS = pathlib.Path(__file__).resolve().parent / "data" / "presets"

# The real configs the planner's per-device targets hold on. Qwen 2.5 0.5B
# misses the fsdp target on a (256, 1) mesh: neither its vocabulary (151936)
# nor its hidden size (896) divide by 256 (tests/test_dense_families.py).
PLANNED_REAL_PRESETS = (
    "gemma2_2b",
    "gemma3_1b",
    "gemma_2b",
    "gemma_7b",
    "llama2_7b",
    "llama3.2_1b",
    "llama3_8b",
    "mixtral_8x7b",
    "qwen1.5_moe_a2.7b",
    "qwen2.5_0.5b",
    "qwen2.5_7b",
)
