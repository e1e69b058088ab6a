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
# ... where the kernel is measured at least as fast as XLA's attention at
# the step's length (`KERNEL_SPEEDUPS`), or where XLA's attention would
# keep more than `XLA_SCORES_MAX_BYTES` of one layer's scores on a device
# (`xla_scores_bytes`), whatever its speed. Else the layer keeps its own
# attention.
#
# Each kernel's speed against XLA's attention (XLA's seconds over the
# kernel's), forward and backward in bfloat16, by sequence length: the
# lowest over one attention layer of Llama 3.2 1B, Qwen 2.5 0.5B, Phi-3
# mini, Gemma 2 2B (with its soft cap) and Gemma 3 1B, at 8,192 tokens a
# step (128 tokens: Llama 3.2 1B's alone). Measured on a v5e chip by
# `python -m bench.accelerator_kernels` (docs/benchmarks.md, "The attention
# kernel against XLA's"; docs/data/accelerator-v5e-9-kernels.jsonl). A
# length between two measured ones reads the lower one's; a length under
# the first, none. Splash is faster from 512 tokens, by more as the
# sequence grows (XLA's attention moves every `[sequence, sequence]` score
# through memory, splash none); at 128 XLA's is faster.
KERNEL_SPEEDUPS = {
    "splash": {
        128: 0.39,
        512: 1.10,
        1024: 1.53,
        2048: 1.92,
        4096: 2.78,
        8192: 21.99,
    },
}
# XLA's attention keeps one layer's probabilities of every head for the
# backward pass, `rows · heads · sequence²` in float32 per device: beyond
# this much a layer, the kernel is taken where it isn't measured faster (a
# CPU's blockwise kernel; splash under its first measured length). 26
# layers at the limit keep 1.6 GiB, a tenth of a 16 GiB chip.
XLA_SCORES_MAX_BYTES = 64 * 2**20
# The devices a kernel doesn't compile for, by words of their kind (JAX's
# `device_kind`, or a `--device` name), where the blockwise kernel takes
# its place: on a TPU v3 Mosaic refuses splash's bfloat16 products
# ("Unsupported matmul RHS type on target: vector<128x128xbf16>",
# target-compiled for a v3-8 with jax 0.10.2's libtpu; float32 compiles),
# and a v2 has no Mosaic kernels.
KERNEL_REFUSED_ON = {"splash": ("v2", "v3")}
# ... and these kernels take every sequence: on a GPU keras-hub's own path
# hands cuDNN its mask as a `[batch, heads, sequence, sequence]` bias, or
# takes XLA's attention where cuDNN refuses it.
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

# The kernel's head dimension is laid out in lanes of 128 values. A head
# dimension of part lanes (64: Llama 3.2 1B, Qwen 2.5 0.5B and 1.5B; 96:
# Phi-3) is zero-padded to whole lanes around the kernel: zero lanes add
# nothing to a score, and the output's are sliced off.
HEAD_DIM_MULTIPLE = 128
# Splash keeps each query's log-sum-exp for the backward pass, in float32,
# broadcast over this many lanes (`[heads, queries, 128]` a layer).
SPLASH_RESIDUAL_LANES = 128

# The query and key blocks tried, largest first: the first that divides a
# device's queries and the whole sequence is taken.
BLOCK_SIZES = (512, 256, 128)


def splash_head_dim(head_dim: int) -> int:
    """The head dimension splash computes a head of `head_dim` in: the next
    whole number of lanes.

    Example:
    >>> splash_head_dim(64), splash_head_dim(96), splash_head_dim(256)
    (128, 128, 256)
    """
    return -(-head_dim // HEAD_DIM_MULTIPLE) * HEAD_DIM_MULTIPLE


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


def applies(queries: int, sequence: int, contexts: int) -> bool:
    """Whether splash can attend `queries` per device of a `sequence` cut
    in `contexts` blocks: a block that divides both lengths, and a sequence
    that the mask's shards split evenly (splash asks `contexts²` to divide
    it). Any head dimension applies (`splash_head_dim`).

    Example:
    >>> applies(4096, 32768, 8), applies(96, 768, 8)
    (True, False)
    """
    return (
        block_size(queries, sequence) is not None
        and sequence % (contexts * contexts) == 0
    )


def compiled_kernel(kernel: str | None, device_kind: str) -> str | None:
    """`kernel`, or the blockwise kernel where devices of `device_kind`
    can't compile it (`KERNEL_REFUSED_ON`).

    Example:
    >>> compiled_kernel("splash", "TPU v3"), compiled_kernel("splash", "v5e")
    ('blockwise', 'splash')
    """
    kind = device_kind.lower()
    if any(word in kind for word in KERNEL_REFUSED_ON.get(kernel, ())):
        return "blockwise"
    return kernel


def context_kernel(
    platform: str,
    sequence: int,
    contexts: int,
    strategy: str = "all_gather",
    kernel: str | None = None,
    device_kind: str = "",
) -> str:
    """The kernel each device of a mesh of `platform` attends its block of
    queries with, on a `sequence` cut in `contexts` blocks: `kernel`
    (default: the platform's, `FUSED_KERNELS`) where it applies, else
    `"blockwise"`. Splash needs the whole sequence's keys at once (no
    ring), and blocks that fit the devices' shares (`applies`); a whole
    sequence on each device is padded to its blocks (`padded_sequence`).
    cuDNN's attends whole sequences. Devices of `device_kind` that can't
    compile the kernel take the blockwise one (`compiled_kernel`).

    Example:
    >>> context_kernel("tpu", 32768, 8), context_kernel("tpu", 1000, 8)
    ('splash', 'blockwise')
    >>> context_kernel("tpu", 1000, 1), context_kernel("tpu", 32768, 8, "ring")
    ('splash', 'blockwise')
    >>> context_kernel("gpu", 4096, 4, kernel="cudnn")
    'blockwise'
    >>> context_kernel("gpu", 4096, 1, kernel="cudnn")
    'cudnn'
    >>> context_kernel("tpu", 32768, 8, device_kind="TPU v3")
    'blockwise'
    """
    kernel = compiled_kernel(kernel or FUSED_KERNELS.get(platform), device_kind)
    kernel = kernel or "blockwise"
    if kernel == "splash" and (
        strategy == "ring"
        or (contexts > 1 and not applies(sequence // contexts, sequence, contexts))
    ):
        return "blockwise"
    if kernel == "cudnn" and contexts > 1:
        return "blockwise"
    return kernel


def xla_scores_bytes(rows: int, heads: int, sequence: int) -> int:
    """The bytes of one layer's float32 probabilities that XLA's attention
    keeps for the backward pass on a device of `rows` sequences of
    `sequence` tokens and `heads` query heads.

    Example:
    >>> xla_scores_bytes(4, 14, 4096) / 2**30
    3.5
    """
    return rows * heads * sequence * sequence * 4


def measured_faster(kernel: str, sequence: int) -> bool:
    """Whether `kernel` was measured at least as fast as XLA's attention at
    `sequence` tokens (`KERNEL_SPEEDUPS`: the nearest measured length at or
    under it).

    Example:
    >>> measured_faster("splash", 1000), measured_faster("splash", 256)
    (True, False)
    >>> measured_faster("blockwise", 32768)
    False
    """
    speedups = KERNEL_SPEEDUPS.get(kernel, {})
    measured = [length for length in speedups if length <= sequence]
    return bool(measured) and speedups[max(measured)] >= 1.0


def every_mesh_kernel(
    platform: str,
    sequence: int,
    rows: int = 1,
    heads: int = 1,
    device_kind: str = "",
) -> str | None:
    """The kernel of `PLATFORM_KERNELS` each device of `platform` attends
    its `rows` whole sequences of `sequence` tokens with off a context
    mesh, `heads` query heads of each, or None (the layer's own
    attention): where the kernel is measured at least as fast as XLA's
    attention (`measured_faster`), where XLA's attention would keep more
    than `XLA_SCORES_MAX_BYTES` of one layer's scores, and at every length
    for `EVERY_LENGTH_KERNELS`. Splash takes any length (the sequence is
    padded to its blocks) and any head dimension (`splash_head_dim`);
    whether cuDNN's takes a layer depends also on the GPU and on its
    library, which the layers ask (`cudnn_attention`). Devices of
    `device_kind` that can't compile the platform's kernel take the
    blockwise one (`compiled_kernel`), where XLA's scores would pass the
    limit.

    Example:
    >>> every_mesh_kernel("tpu", 512), every_mesh_kernel("tpu", 256)
    ('splash', None)
    >>> every_mesh_kernel("tpu", 256, rows=64, heads=32)
    'splash'
    >>> every_mesh_kernel("cpu", 4096), every_mesh_kernel("cpu", 8192, heads=4)
    (None, 'blockwise')
    >>> every_mesh_kernel("tpu", 1024, device_kind="TPU v3")
    >>> every_mesh_kernel("tpu", 8192, heads=4, device_kind="TPU v3")
    'blockwise'
    """
    kernel = compiled_kernel(PLATFORM_KERNELS.get(platform), device_kind)
    if kernel is None:
        return None
    wanted = (
        kernel in EVERY_LENGTH_KERNELS
        or measured_faster(kernel, sequence)
        or xla_scores_bytes(rows, heads, sequence) > XLA_SCORES_MAX_BYTES
    )
    return kernel if wanted else None


def padded_sequence(sequence: int) -> int:
    """The length a whole sequence is padded to for splash off a context
    mesh: the next multiple of its smallest block.

    Example:
    >>> padded_sequence(8192), padded_sequence(8200), padded_sequence(64)
    (8192, 8320, 128)
    """
    step = min(BLOCK_SIZES)
    return -(-sequence // step) * step
