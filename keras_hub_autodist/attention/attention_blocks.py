"""What the per-device attention holds at once, and the shapes the splash
kernel takes, as data: the estimate reads them without importing JAX
(`blockwise_attention` and `splash_attention` compute with them)."""

# The context axis' strategies are an option of the plan, declared with the
# options; the kernels of each are this stage's.
from keras_hub_autodist.planning.options import CONTEXT_PARALLEL_STRATEGIES  # noqa: F401

# The kernel each device attends with is chosen here, by `context_kernel` on
# a context mesh and by `every_mesh_kernel` off one, for the layers
# (`context_attention`) and the memory estimate (`fitting.step_memory`)
# alike.

# On a context mesh, the kernel each device attends its block of queries
# with, by the platform of the mesh's devices: the fused one where it
# applies, else the blockwise kernel.
FUSED_KERNELS = {"tpu": "splash"}
# Off a context mesh (a batch, model or fsdp mesh, or one device), the kernel
# each device attends its rows' whole sequences with, by platform, where its
# shapes apply: splash on a TPU, cuDNN's on a GPU, and the blockwise kernel
# on a CPU, which has no fused one; a platform not named here keeps the
# layer's own attention. keras-hub's own path never reaches splash on a TPU
# inside a step: its mask is a traced tensor there, and Keras falls back to
# XLA's attention, which holds every `[sequence, sequence]` score. On a GPU
# it hands cuDNN that mask as a `[batch, heads, sequence, sequence]` bias,
# or takes XLA's attention where cuDNN refuses it; `cudnn_attention` passes
# each row's padding as a number of keys instead.
PLATFORM_KERNELS = {"tpu": "splash", "gpu": "cudnn", "cpu": "blockwise"}
# ... for sequences of at least this many tokens. Shorter ones keep the
# layer's own attention, which ran on a v5e chip at keras-hub's speed and
# memory to the byte (Gemma 2B at 1024 tokens, Gemma 3 1B at 4096); from
# 8192 tokens XLA's scores outgrow a 16 GiB chip, where splash ran.
EVERY_MESH_MIN_TOKENS = 8192
# ... except these kernels, which take every sequence: on a GPU keras-hub's
# own path hands cuDNN its mask as a `[batch, heads, sequence, sequence]`
# bias, or takes XLA's attention where cuDNN refuses it.
EVERY_LENGTH_KERNELS = ("cudnn",)

# Keys per block: the scores held at once are `[batch, heads, queries,
# KEY_BLOCK]` in float32.
KEY_BLOCK = 512
# The kernels whose buffers the memory estimate counts as one block of keys
# a device at a time. cuDNN's is left out: whether it takes a layer depends
# on the GPU's compute capability and on JAX finding the cuDNN library,
# which the estimate can't see, so it counts XLA's scores there, the most
# the step can hold.
BLOCK_KERNELS = ("splash", "blockwise")

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

# The kernel's head dimension is laid out in lanes of 128 values.
HEAD_DIM_MULTIPLE = 128
# Splash keeps each query's log-sum-exp for the backward pass, in float32,
# broadcast over this many lanes (`[heads, queries, 128]` a layer).
SPLASH_RESIDUAL_LANES = 128

# The query and key blocks tried, largest first: the first that divides a
# device's queries and the whole sequence is taken.
BLOCK_SIZES = (512, 256, 128)


def block_size(queries: int, sequence: int) -> int | None:
    """The splash block for `queries` per device and `sequence` keys, or
    `None` when no block of `BLOCK_SIZES` divides both.

    Example:
    >>> block_size(4096, 32768), block_size(96, 768)
    (512, None)
    """
    for size in BLOCK_SIZES:
        if queries % size == 0 and sequence % size == 0:
            return size
    return None


def applies(head_dim: int, queries: int, sequence: int, contexts: int) -> bool:
    """Whether splash can attend `queries` per device of a `sequence` cut
    in `contexts` blocks: a head dimension of whole lanes, a block that
    divides both lengths, and a sequence that the mask's shards split
    evenly (splash asks `contexts²` to divide it).

    Example:
    >>> applies(256, 4096, 32768, 8), applies(64, 4096, 32768, 8)
    (True, False)
    """
    return (
        head_dim % HEAD_DIM_MULTIPLE == 0
        and block_size(queries, sequence) is not None
        and sequence % (contexts * contexts) == 0
    )


def context_kernel(
    platform: str,
    head_dim: int,
    sequence: int,
    contexts: int,
    strategy: str = "all_gather",
    kernel: str | None = None,
) -> str:
    """The kernel each device of a mesh of `platform` attends its block of
    queries with, on a `sequence` cut in `contexts` blocks: `kernel`
    (default: the platform's, `FUSED_KERNELS`) where it applies, else
    `"blockwise"`. Splash needs its shapes (`applies`) and the whole
    sequence's keys at once (no ring); cuDNN's attends whole sequences.

    Example:
    >>> context_kernel("tpu", 256, 32768, 8), context_kernel("tpu", 64, 32768, 8)
    ('splash', 'blockwise')
    >>> context_kernel("tpu", 256, 32768, 8, "ring")
    'blockwise'
    >>> context_kernel("gpu", 128, 4096, 4, kernel="cudnn")
    'blockwise'
    >>> context_kernel("gpu", 128, 4096, 1, kernel="cudnn")
    'cudnn'
    """
    kernel = kernel or FUSED_KERNELS.get(platform, "blockwise")
    if kernel == "splash" and (
        strategy == "ring"
        or not applies(head_dim, sequence // contexts, sequence, contexts)
    ):
        return "blockwise"
    if kernel == "cudnn" and contexts > 1:
        return "blockwise"
    return kernel


def every_mesh_kernel(
    platform: str, head_dim: int, sequence: int
) -> tuple[str | None, str | None]:
    """`(kernel, refusal)` off a context mesh: the kernel of
    `PLATFORM_KERNELS` each device of `platform` attends a whole sequence
    of `sequence` tokens with, or None (the layer's own attention), and
    why the platform's kernel was refused where its shapes don't apply.
    Whether cuDNN's takes a layer depends also on the GPU and on its
    library, which the layers ask (`cudnn_attention`).

    Example:
    >>> every_mesh_kernel("tpu", 256, 8192), every_mesh_kernel("tpu", 256, 4096)
    (('splash', None), (None, None))
    >>> every_mesh_kernel("tpu", 64, 8192)[1][:41]
    "the splash kernel doesn't take a head dim"
    """
    kernel = PLATFORM_KERNELS.get(platform)
    if kernel is None or (
        kernel not in EVERY_LENGTH_KERNELS and sequence < EVERY_MESH_MIN_TOKENS
    ):
        return None, None
    if kernel == "splash" and not applies(head_dim, sequence, sequence, 1):
        return None, (
            f"the splash kernel doesn't take a head dimension of {head_dim} "
            f"at {sequence} tokens (it lays heads in lanes of "
            f"{HEAD_DIM_MULTIPLE}, sequences in blocks of {min(BLOCK_SIZES)})"
        )
    return kernel, None
