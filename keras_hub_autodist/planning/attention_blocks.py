"""What the context axis' per-device attention holds at once, as data: the
estimate reads it without importing JAX (`blockwise_attention` computes
with it)."""

# Keys per block: the scores held at once are `[batch, heads, queries,
# KEY_BLOCK]` in float32.
KEY_BLOCK = 512

# How keys and values reach each device's queries on a context mesh:
# gathered whole over the context axis before attending (the default: one
# collective per layer, and on a TPU the fused splash kernel per device), or
# passed around it block by block (`ring_attention`: a device holds its own
# block and the one arriving, not the whole sequence's).
CONTEXT_PARALLEL_STRATEGIES = ("all_gather", "ring")

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
