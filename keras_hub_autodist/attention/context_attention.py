"""Attention run per device under `jax.shard_map`, on a context mesh and off one.

Each device holds a block of every sequence. Its attention layers project
queries, keys and values on that block; here each device then all-gathers
the keys and values over the context axis (MaxText's `all_gather`
strategy) and attends its block of queries to the whole sequence with
`blockwise_attention`, one block of keys at a time. The keys and values are
gathered per key/value head, before any repeat to the query heads, so the
gathers move `2 · sequence · kv_heads · head_dim` values per layer, and no
device holds more than one `[queries, key block]` block of scores: memory
linear in the sequence.

Positions are the sequence's own: a device's queries are its block's,
`block · index + arange(block)`, its keys the whole sequence's. RoPE was
applied by the layer before, on each device's block, at those positions.
The masks are rebuilt per block from the rule of the layer's family
(`compat_attention.attention_reading`): causal, sliding windows, and the key
padding, which is the padding mask the decoder block built the layer's mask
from (`block_masks`): no device builds the `[batch, sequence, sequence]`
mask. Only a block called without a padding mask has its mask's diagonal
read instead: a token always sees itself unless it is padding.

Off a context mesh (a batch, model or fsdp mesh, or one device) the same
runs with no context axis: each device attends its rows' whole sequences,
its query heads split over the model axis, with the kernel of its
platform (`attention_blocks.PLATFORM_KERNELS`: splash on a TPU, cuDNN's on a
GPU, blockwise on a CPU) and padding per row, never one row's mask for the
batch.

`install_per_device_attention` replaces `_compute_attention` on each known
attention layer of a planned model (`compat.patch_instance`, the
`attention_per_device` patch), and each known decoder block's mask method
with one that hands the layer its padding (`block_masks.mask_method`, the
`decoder_block_masks` patch). The replacement takes the layer's own path
while decoding, with a cache, for dropout on the attention weights, where
the block merges a mask other than causal and padding into the layer's,
outside the plan's distribution, or off a context mesh where the platform
has no kernel of `attention_blocks.PLATFORM_KERNELS` that applies.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import keras
import numpy as np
from jax.sharding import PartitionSpec

from keras_hub_autodist import compat
from keras_hub_autodist.attention import attention_blocks
from keras_hub_autodist.attention import block_masks
from keras_hub_autodist.attention import cudnn_attention
from keras_hub_autodist.attention import splash_attention
from keras_hub_autodist.attention.blockwise_attention import AttentionRule
from keras_hub_autodist.attention.blockwise_attention import blockwise_attention
from keras_hub_autodist.attention.causal_balance import owner
from keras_hub_autodist.attention.ring_attention import ring_attention
from keras_hub_autodist.compat import attention as compat_attention
from keras_hub_autodist.errors import KeptAttentionWarning
from keras_hub_autodist.errors import warn
from keras_hub_autodist.planning import distribution as distribution_lib
from keras_hub_autodist.planning.options import CONTEXT_PARALLEL_STRATEGIES

STRATEGIES = CONTEXT_PARALLEL_STRATEGIES

# On a causal sequence, each device attends the queries of two half blocks,
# one from each end of the sequence (`_balanced`), so that every device
# computes the same number of unmasked score blocks.
BALANCE_CAUSAL = True


def install_per_device_attention(model, plan) -> int:
    """Replace `_compute_attention` on every known keras-hub attention layer
    of `model` with the attention run per device; return how many layers
    changed. On a context mesh every such layer attends per device; on any
    other mesh a layer does where its devices' platform has a kernel
    (`attention_blocks.PLATFORM_KERNELS`) that applies to its shapes, else
    it keeps its own attention (decided as the step is traced).

    Args:
        model: a keras-hub Backbone or Task, built.
        plan: its `LayoutPlan`.
    """
    axes = plan.mesh_axes
    model_axis = axes.model_axis if axes.size(axes.model_axis) > 1 else None
    layers = compat.sublayers(model)
    if any("VisionEncoder" in type(layer).__name__ for layer in layers):
        # Image tokens attend both ways (Gemma 3): not the causal rule the
        # blocks are masked by, so keras-hub's own path stays.
        return 0
    handoffs = _hand_over_block_masks(layers, model_axis)
    changed = 0
    for layer in layers:
        reading = compat_attention.attention_reading(layer)
        if reading is None:
            continue
        method = compat_attention.COMPUTE_ATTENTION_METHOD
        replacement = functools.partial(
            _compute_attention,
            getattr(layer, method),
            reading,
            model_axis,
            plan.context_parallel_strategy,
            handoffs.get(id(layer)),
        )
        compat.patch_instance("attention_per_device", layer, method, replacement)
        changed += 1
    return changed


def _hand_over_block_masks(
    layers, model_axis: str | None
) -> dict[int, block_masks.Handoff]:
    """Wrap the mask method of each known decoder block among `layers`
    whose attention layer has a known reading; return each such attention
    layer's `Handoff`, by `id`."""
    handoffs = {}
    for layer in layers:
        block = compat_attention.decoder_block(layer)
        if block is None:
            continue
        attention_layer = compat_attention.block_attention_layer(layer, block)
        reading = compat_attention.attention_reading(attention_layer)
        if reading is None:
            continue
        handoff = handoffs[id(attention_layer)] = block_masks.Handoff()
        built = block_masks.mask_method(
            layer,
            block,
            handoff,
            functools.partial(
                _attends_whole_sequences, reading, attention_layer, model_axis
            ),
            reading.window if block.window_in_mask else None,
        )
        compat.patch_instance("decoder_block_masks", layer, block.mask_method, built)
    return handoffs


def _attends_whole_sequences(
    reading, layer, model_axis: str | None, batch: int, sequence: int
) -> bool:
    """Whether `layer` will attend per device `batch` whole sequences of
    `sequence` tokens, without a cache, in the current distribution, its
    heads split over `model_axis`."""
    if reading.dropout or distribution_lib.is_decoding():
        return False
    distribution = keras.distribution.distribution()
    heads = compat_attention.query_heads(layer)
    head_dim = compat_attention.head_dim(layer)
    shape = (batch, sequence, heads, head_dim)
    choice = _kernel_choice(
        distribution, reading, shape, layer.compute_dtype, model_axis
    )
    return any(choice)


def _argument(args, kwargs, index, name, default):
    if len(args) > index:
        return args[index]
    return kwargs.get(name, default)


def _compute_attention(
    original, reading, model_axis, strategy, handoff, *args, **kwargs
):
    """A layer's `_compute_attention(q, k, v, attention_mask, ...)`, per
    device when it can be, else the layer's own."""
    query, key, value = args[:3]
    mask = _argument(args, kwargs, 3, "attention_mask", None)
    training = _argument(args, kwargs, 4, "training", False)
    cache_index = _argument(args, kwargs, 5, "cache_update_index", 0)
    masks = handoff.take() if handoff is not None else None
    distribution = keras.distribution.distribution()
    context, kernel = _kernel_choice(
        distribution, reading, query.shape, query.dtype, model_axis
    )
    own_path = (
        not (context or kernel)
        or distribution_lib.is_decoding()
        or (masks is not None and masks.merges_other_masks)
        # No cache index (Qwen, SmolLM3) or 0: the whole sequence at once.
        or not (
            cache_index is None or (isinstance(cache_index, int) and cache_index == 0)
        )
        or query.shape[1] != key.shape[1]
        or (reading.dropout and training is not False)
    )
    if own_path:
        if masks is not None and masks.compact:
            # The block handed over the compact mask for a path not taken.
            whole = block_masks.whole_mask(masks, query.shape[1], key.shape[1])
            args, kwargs = _with_mask(args, kwargs, whole)
        with _products_in(query.dtype):
            return original(*args, **kwargs)
    if reading.repeats > 1:
        # The layer repeated each key/value head to its query heads: take
        # one of each (the repeat is local to each device's block).
        key, value = key[:, :, :: reading.repeats], value[:, :, :: reading.repeats]
    rule = AttentionRule(
        scale=reading.scale,
        soft_cap=reading.soft_cap,
        window=reading.window,
        causal=mask is not None,
        keyless_mean=reading.keyless_mean,
    )
    return attention_per_device(
        rule,
        query,
        key,
        value,
        key_padding(mask, masks, query.shape[0], key.shape[1]),
        mesh=distribution.device_mesh.backend_mesh,
        batch_axis=distribution.batch_dim_name,
        context_axis=distribution.context_dim_name if context else None,
        model_axis=model_axis,
        strategy=strategy,
        kernel=kernel,
    )


def _products_in(dtype):
    """The precision a layer's own attention takes its products in: a
    float32 layer's in float32 (`"highest"`), as the kernels compute them,
    so that which path the rule takes never moves a float32 model's
    numbers (a TPU's default takes bfloat16 passes, 1e-4 of a loss away
    from the CPU's); any other dtype's as the caller's. Read as the step is
    traced: each product keeps its precision in its gradient."""
    if jnp.dtype(dtype) == jnp.float32:
        return jax.default_matmul_precision("highest")
    return contextlib.nullcontext()


def _with_mask(args, kwargs, mask):
    """`_compute_attention`'s arguments with `mask` as its attention mask."""
    if len(args) > 3:
        return (*args[:3], mask, *args[4:]), kwargs
    return args, {**kwargs, "attention_mask": mask}


def _kernel_choice(
    distribution, reading, shape, dtype, model_axis: str | None
) -> tuple[bool, str | None]:
    """`(context, kernel)`: whether `distribution` is a context mesh, where
    a layer attends per device, and off one the kernel it attends whole
    sequences of queries of `shape` (`[batch, sequence, heads, head_dim]`,
    its heads split over `model_axis`) with (`_every_mesh_kernel`), or None
    (its own attention). The block's mask method and the layer decide with
    it alike."""
    if isinstance(distribution, distribution_lib.ContextParallel):
        return True, None
    kernel = _every_mesh_kernel(distribution, reading, shape, dtype, model_axis)
    return False, kernel


def _per_device(size: int, mesh, axis: str | None) -> int:
    """`size` split over `axis` of `mesh` where it divides, else whole."""
    count = _axis_sizes(mesh).get(axis, 1)
    return size // count if size % count == 0 else size


def _every_mesh_kernel(
    distribution, reading, shape, dtype, model_axis: str | None
) -> str | None:
    """Off a context mesh, the kernel this layer's devices attend whole
    sequences of queries of `shape` with (`attention_blocks.every_mesh_kernel`
    on each device's rows and heads, and for cuDNN's this GPU and its
    library), or None (the layer's own attention)."""
    if distribution is None or not hasattr(distribution, "batch_dim_name"):
        return None
    batch, sequence, heads, head_dim = shape
    mesh = distribution.device_mesh.backend_mesh
    rows = _per_device(batch, mesh, distribution.batch_dim_name)
    heads = _per_device(heads, mesh, model_axis)
    device = mesh.devices.flat[0]
    kernel = attention_blocks.every_mesh_kernel(
        device.platform, sequence, rows, heads, device.device_kind
    )
    refusal = None
    if kernel == "cudnn":
        refusal = cudnn_attention.why_not(device, head_dim, dtype, reading.soft_cap)
        if refusal is None and not cudnn_attention.available():
            refusal = (
                "JAX finds no cuDNN library to lower cuDNN's flash attention "
                "with (on a machine without a GPU, install nvidia-cudnn-cu12)"
            )
    if refusal is None:
        return kernel
    scores = attention_blocks.xla_scores_bytes(rows, heads, sequence)
    if scores > attention_blocks.XLA_SCORES_MAX_BYTES:
        _say_kept_attention(sequence, scores, refusal)
    return None


# The reasons a layer kept its own attention that were said, once each.
_SAID_KEPT = set()


def _say_kept_attention(sequence: int, scores: int, refusal: str) -> None:
    """Warn, once per reason, that a long sequence is attended by the layer's
    own (XLA's) attention, which holds every score."""
    if refusal in _SAID_KEPT:
        return
    _SAID_KEPT.add(refusal)
    warn(
        f"keras_hub_autodist: the attention layers attend {sequence} tokens "
        "with their own (XLA's) attention, which holds every "
        f"[sequence, sequence] score of each head ({scores / 2**20:.0f} MiB "
        f"a layer on each device), because {refusal}. A "
        "context axis (device_mesh={..., 'context': N}) splits each sequence "
        "and attends one block of keys at a time on any device.",
        KeptAttentionWarning,
    )


def key_padding(mask, masks, batch: int, length: int):
    """`[batch, keys]` bool: the keys that are not padding (all keys
    without a mask).

    Read off the padding mask the decoder block built `mask` from (`masks`,
    its `block_masks.BlockMasks`); else off the diagonal of the block's
    `[batch, queries, keys]` mask. A non-boolean entry counts as keras'
    `Softmax` counts it (above 0.5)."""
    if mask is None:
        return jnp.ones((batch, length), bool)
    padding = None if masks is None else masks.padding
    if padding is not None and tuple(padding.shape) == (batch, length):
        return block_masks.valid_keys(padding)
    diagonal = jnp.diagonal(jnp.asarray(mask), axis1=1, axis2=2)
    if diagonal.dtype == jnp.bool_:
        return diagonal
    return diagonal > 0.5


def _axis_sizes(mesh) -> dict[str, int]:
    return dict(zip(mesh.axis_names, mesh.devices.shape))


def attention_per_device(
    rule: AttentionRule,
    query,
    key,
    value,
    key_valid,
    *,
    mesh,
    batch_axis: str,
    context_axis: str | None,
    model_axis: str | None = None,
    strategy: str = "all_gather",
    kernel: str | None = None,
):
    """Attention of a whole batch on a context mesh, each device attending
    its block of queries to the keys and values gathered over the context
    axis.

    Args:
        rule: the `AttentionRule`.
        query: `[batch, sequence, heads, head_dim]`.
        key: `[batch, sequence, kv_heads, head_dim]`, one per key/value
            head; query head `h` attends with key/value head
            `h // (heads // kv_heads)`.
        value: as `key`.
        key_valid: `[batch, sequence]` bool, `False` on padding.
        mesh: the `jax.sharding.Mesh`.
        batch_axis: the mesh axis of the batch.
        context_axis: the mesh axis that splits each sequence, or `None`:
            each device attends its rows' whole sequences.
        model_axis: the mesh axis of the heads, or `None`.
        strategy: how keys and values reach each device (`STRATEGIES`):
            `"all_gather"` (the whole sequence's at once) or `"ring"`
            (block by block, `ring_attention`).
        kernel: `"splash"`, `"cudnn"` or `"blockwise"`; `None`: the fused
            kernel of the mesh's platform (`attention_blocks.context_kernel`) where it
            applies, else `"blockwise"`. Splash off a TPU runs in Pallas'
            interpreter, cuDNN's call off a GPU in XLA; cuDNN attends
            whole sequences (no context axis); the ring attends each block
            with `"blockwise"`.

    Returns:
        `[batch, sequence, heads, head_dim]`, split as `query`.
    """
    batch, _, heads, head_dim = query.shape
    kv_heads = key.shape[2]
    groups = heads // kv_heads
    sizes = _axis_sizes(mesh)
    batch_spec = batch_axis if batch % sizes.get(batch_axis, 1) == 0 else None
    models = sizes.get(model_axis, 1)
    heads_axis = model_axis if models > 1 and heads % models == 0 else None
    local_heads = heads // models if heads_axis else heads
    kv_axis = heads_axis if heads_axis and kv_heads % models == 0 else None
    if heads_axis and not kv_axis and groups % local_heads:
        # A device's query heads would straddle two key/value heads.
        heads_axis, local_heads = None, heads
    # Replicated over the model axis: each device slices its own head out.
    slice_kv = heads_axis is not None and kv_axis is None

    contexts = sizes[context_axis] if context_axis else 1
    if contexts == 1:
        strategy = "all_gather"  # nothing to pass around a ring of one
    balanced = (
        BALANCE_CAUSAL
        and contexts > 1
        and rule.causal
        and query.shape[1] % (2 * contexts) == 0
    )
    sequence, block = query.shape[1], query.shape[1] // contexts
    device = mesh.devices.flat[0]
    kernel = attention_blocks.context_kernel(
        device.platform, sequence, contexts, strategy, kernel, device.device_kind
    )
    # A whole sequence on each device is padded to splash's blocks.
    kernel_length = sequence
    if kernel == "splash" and contexts == 1:
        kernel_length = attention_blocks.padded_sequence(sequence)
    on_gpu = mesh.devices.flat[0].platform == "gpu"
    fused = ()
    if kernel == "splash":
        local_kv = 1 if slice_kv else (kv_heads // models if kv_axis else kv_heads)
        fused = (
            splash_attention.splash_kernel(
                rule,
                kernel_length,
                contexts,
                balanced,
                local_heads // local_kv,
                interpret=mesh.devices.flat[0].platform != "tpu",
            ),
        )

    def attend(queries, positions, key, value, key_valid, fused=()):
        """Each of `queries` (at its `positions`) attended to the whole
        sequence: `key` and `value` are the gathered sequence's, or (ring)
        the device's own block."""
        kv_local = key.shape[2]
        grouped = tuple(
            q.reshape(*q.shape[:2], kv_local, q.shape[2] // kv_local, head_dim)
            for q in queries
        )
        if strategy == "ring":
            outputs = ring_attention(
                rule,
                context_axis,
                contexts,
                grouped,
                tuple(positions),
                key,
                value,
                key_valid,
            )
        elif kernel == "cudnn":
            outputs = [
                cudnn_attention.attend(
                    rule, q, key, value, key_valid, "cudnn" if on_gpu else "xla"
                )
                for q in grouped
            ]
        elif fused:
            lengths = np.cumsum([q.shape[1] for q in grouped])[:-1].tolist()
            output = splash_attention.attend(
                fused[0],
                rule,
                jnp.concatenate(grouped, axis=1),
                key,
                value,
                jnp.concatenate(positions),
                key_valid,
                sequence=kernel_length if contexts == 1 else None,
            )
            outputs = jnp.split(output, lengths, axis=1)
        else:
            key_positions = jnp.arange(key.shape[1], dtype=jnp.int32)
            outputs = [
                blockwise_attention(rule, q, key, value, p, key_positions, key_valid)
                for q, p in zip(grouped, positions)
            ]
        return [o.reshape(q.shape) for o, q in zip(outputs, queries)]

    def local(query, key, value, key_valid, *fused):
        index = jax.lax.axis_index(context_axis) if context_axis else 0
        if slice_kv:
            first = jax.lax.axis_index(heads_axis) * local_heads // groups
            key = jax.lax.dynamic_slice_in_dim(key, first, 1, axis=2)
            value = jax.lax.dynamic_slice_in_dim(value, first, 1, axis=2)
        if strategy == "all_gather" and context_axis:
            key = jax.lax.all_gather(key, context_axis, axis=1, tiled=True)
            value = jax.lax.all_gather(value, context_axis, axis=1, tiled=True)
        attend_parts = functools.partial(
            attend, key=key, value=value, key_valid=key_valid, fused=fused
        )
        if not balanced:
            positions = index * block + jnp.arange(block, dtype=jnp.int32)
            return attend_parts([query], [positions])[0]
        return _balanced(attend_parts, query, index, contexts, context_axis)

    query_spec = PartitionSpec(batch_spec, context_axis, heads_axis, None)
    kv_spec = PartitionSpec(batch_spec, context_axis, kv_axis, None)
    fused_specs = tuple(
        splash_attention.kernel_spec(f, mesh, context_axis) for f in fused
    )
    mapped = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(
            query_spec,
            kv_spec,
            kv_spec,
            PartitionSpec(batch_spec, None),
            *fused_specs,
        ),
        out_specs=query_spec,
        check_vma=False,
    )
    return mapped(query, key, value, key_valid, *fused)


def _balanced(attend, query, index, contexts: int, context_axis: str):
    """`attend(parts, positions)` over the head-and-tail half blocks
    (`balanced_chunks`), from and back to the contiguous blocks the model
    holds: device `i` holds half blocks `2i` and `2i + 1`, sends each to
    the device that attends it (`ppermute`), attends the two it receives at
    their positions in the sequence, and sends the outputs back."""
    half = query.shape[1] // 2
    sends = [
        [(i, owner(2 * i + slot, contexts)) for i in range(contexts)] for slot in (0, 1)
    ]
    received = [
        jax.lax.ppermute(part, context_axis, perm)
        for part, perm in zip((query[:, :half], query[:, half:]), sends)
    ]
    # Whether the half block that arrived from the first halves is this
    # device's head (the lower one), for each device.
    source = {dest: src for src, dest in sends[0]}
    head_first = jnp.asarray([2 * source[d] == d for d in range(contexts)])[index]
    head = jnp.where(head_first, received[0], received[1])
    tail = jnp.where(head_first, received[1], received[0])
    steps = jnp.arange(half, dtype=jnp.int32)
    head_out, tail_out = attend(
        [head, tail],
        [index * half + steps, (2 * contexts - 1 - index) * half + steps],
    )
    back = (
        jnp.where(head_first, head_out, tail_out),
        jnp.where(head_first, tail_out, head_out),
    )
    returned = [
        jax.lax.ppermute(part, context_axis, [(d, s) for s, d in perm])
        for part, perm in zip(back, sends)
    ]
    return jnp.concatenate(returned, axis=1)
