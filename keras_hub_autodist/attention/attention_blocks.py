"""What the context axis' per-device attention holds at once, as data: the
estimate reads it without importing JAX (`blockwise_attention` computes
with it)."""

# The context axis' strategies are an option of the plan, declared with the
# options; the kernels of each are this stage's.
from keras_hub_autodist.planning.options import CONTEXT_PARALLEL_STRATEGIES  # noqa: F401

# Keys per block: the scores held at once are `[batch, heads, queries,
# KEY_BLOCK]` in float32.
KEY_BLOCK = 512

# The planner's architectures whose attention layers run per device on a
# context mesh (`compat.attention` reads their layers).
PER_DEVICE_ARCHITECTURES = (
    "gemma",
    "gemma3",
    "gemma4",
    "llama",
    "mistral",
    "mixtral",
    "phi3",
    "qwen",
    "qwen3",
    "qwen_moe",
    "qwen3_moe",
    "smollm3",
)
