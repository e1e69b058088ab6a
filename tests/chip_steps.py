"""Training steps measured on one TPU v5e chip, and their real configs.

Random bfloat16 weights of real shapes on a one-device mesh, Adam: whether
the step ran, and the chip's own program memory (its `memory_analysis()`,
or for a step that didn't run what `RESOURCE_EXHAUSTED` said it needed), in
GiB. The steps of 8,192 tokens are the ones a bound model runs now (splash
attention, the loss a chunk of tokens at a time): Gemma 3's measured on
the chip, Gemma 2B's compiled for a v5e on a CPU-only machine (which
matched the chip within 1% on every step both ran). The others are
measured with whole logits and XLA's attention: the steps of more than
4 GiB of logits among them now hold less (a "runs" stays true).

Example:

```python
for preset, untied, lora_rank, batch, sequence, runs, gib in CHIP_STEPS:
    source = chip_source(preset, untied)
```
"""

import json

from real_presets import REAL_PRESETS

# (preset, untied, LoRA rank, batch, sequence, runs, chip GiB)
CHIP_STEPS = [
    ("gemma_2b", False, 8, 4, 1024, True, 14.57),
    ("gemma_2b", False, 8, 8, 1024, True, 14.69),
    ("gemma_2b", False, 8, 12, 1024, False, 32.95),
    ("gemma_2b", False, 8, 1, 8192, True, 14.84),
    ("gemma3_1b", False, 8, 1, 4096, True, 14.72),
    ("gemma3_1b", False, 8, 1, 8192, True, 12.91),
    ("llama3.2_1b", True, None, 2, 1024, True, 14.62),
    ("llama3.2_1b", True, None, 4, 1024, False, 27.63),
]


def chip_step_id(case) -> str:
    """A step's name in test ids: `gemma_2b-4x1024`."""
    return f"{case[0]}-{case[3]}x{case[4]}"


def chip_source(preset: str, untied: bool) -> str | dict:
    """The real config of `preset` (a folder), or with `untied` its config
    with an output embedding of its own (a dict), as the chip ran it."""
    if not untied:
        return str(REAL_PRESETS / preset)
    config = json.loads((REAL_PRESETS / preset / "config.json").read_text())
    return {**config, "tie_word_embeddings": False}


def chip_preset_folder(preset: str, untied: bool, root) -> str:
    """A folder holding the config the chip ran (`chip_source`), for the
    command line, which plans a folder; `root` holds the untied copy."""
    source = chip_source(preset, untied)
    if isinstance(source, str):
        return source
    folder = root / f"{preset}-untied"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(source))
    return str(folder)
