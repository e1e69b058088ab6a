"""TPU's fused attention kernel (Pallas' splash attention) per device on a
context mesh.

The splash kernel computes flash attention with its mask as a function of
the query's and key's positions: it never holds a score matrix, and skips
the blocks of keys that no query of a block may see. Here one kernel is
built for the whole `[sequence, sequence]` mask, its rows in the order the
devices hold the queries (`q_sequence`: contiguous blocks, or the
head-and-tail halves of the balanced layout), and its block tables are
split over the context axis (`q_seq_shards`): each device gets the rows of
its own queries and attends them to the keys and values gathered over the
context axis.

What the kernel does not compute as the layer would is done around it: the
queries are scaled before it, and padding is a segment id (every query 1,
a key 1 for a token and 0 for padding), so that no query sees a padding
key. A query without a key to attend (a left-padding token) gets the
layer's answer for it, as in `blockwise_attention`.

On a TPU the kernel is compiled; anywhere else (a test on the CPU) it runs
in Pallas' interpreter, which computes the same.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu.splash_attention import (
    splash_attention_kernel as splash_kernel_lib,
)
from jax.experimental.pallas.ops.tpu.splash_attention import (
    splash_attention_mask as splash_mask_lib,
)
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec

from keras_hub_autodist.attention.attention_blocks import block_size
from keras_hub_autodist.attention.attention_blocks import splash_head_dim
from keras_hub_autodist.attention.blockwise_attention import AttentionRule
from keras_hub_autodist.attention.blockwise_attention import rows_with_a_key
from keras_hub_autodist.attention.causal_balance import query_order


def _mask(rule: AttentionRule, order: tuple[int, ...]):
    """The `[sequence, sequence]` mask of `rule` with its rows in `order`
    (each row's query position)."""
    shape = (len(order), len(order))
    window = rule.window
    if rule.causal and window is None:
        mask = splash_mask_lib.CausalMask(shape)
    elif window is not None:
        # A key `window` or more positions before its query is masked; one
        # after it too, when causal.
        mask = splash_mask_lib.LocalMask(
            shape, window_size=(window - 1, 0 if rule.causal else None), offset=0
        )
    else:
        return splash_mask_lib.FullMask(shape)
    mask.q_sequence = np.asarray(order, np.int32)
    return mask


@functools.lru_cache(maxsize=16)
def splash_kernel(
    rule: AttentionRule,
    sequence: int,
    contexts: int,
    balanced: bool,
    heads_per_kv_head: int,
    interpret: bool,
):
    """The splash kernel of one key/value head and its `heads_per_kv_head`
    query heads, for a sequence of `sequence` queries split over `contexts`
    devices, in the head-and-tail order where `balanced`
    (`causal_balance.query_order`).

    Cached: every layer with the same rule shares one kernel (building its
    block tables is numpy work that grows with the square of the sequence).
    """
    order = tuple(query_order(sequence, contexts, balanced))
    queries = sequence // contexts
    size = block_size(queries, len(order))
    sizes = splash_kernel_lib.BlockSizes(
        block_q=size,
        block_kv=size,
        block_kv_compute=size,
        block_q_dkv=size,
        block_kv_dkv=size,
        block_kv_dkv_compute=size,
        block_q_dq=size,
        block_kv_dq=size,
    )
    mask = splash_mask_lib.MultiHeadMask([_mask(rule, order)] * heads_per_kv_head)
    # Built outside any trace, and kept as numpy: the cached kernel's tables
    # are constants of every program that uses them.
    with jax.ensure_compile_time_eval():
        kernel = splash_kernel_lib.make_splash_mqa(
            mask,
            block_sizes=sizes,
            attn_logits_soft_cap=rule.soft_cap,
            head_shards=1,
            q_seq_shards=contexts,
            interpret=interpret,
        )
    return jax.tree.map(np.asarray, kernel)


def kernel_spec(kernel, mesh, context_axis: str | None):
    """`kernel`'s `shard_map` spec: its block tables split over
    `context_axis` (whole with `None`), replicated over every other axis."""
    return kernel.manual_sharding_spec(
        NamedSharding(mesh, PartitionSpec(None, context_axis))
    )


def _padded(array, axis: int, size: int, value=0):
    """`array` padded with `value` at the end of `axis` to `size`."""
    extra = size - array.shape[axis]
    if not extra:
        return array
    widths = [(0, 0)] * array.ndim
    widths[axis] = (0, extra)
    return jnp.pad(array, widths, constant_values=value)


def at_default_precision(function):
    """`function`, forward and backward, traced at the default precision of
    products whatever the caller's (`jax.default_matmul_precision`).

    The kernel of a 16-bit dtype compiles only so: Mosaic refuses a
    `"highest"` or `"float32"` product of bfloat16 operands ("Bad lhs
    type"), which a user's global setting would ask of every kernel traced
    under it, keras-hub's own attention taking it. A product of two 16-bit
    numbers is exact in the kernel's float32 accumulation at any precision,
    so no number changes. The backward pass is traced when the step's
    gradient is, outside the forward's context, hence the custom VJP that
    enters it again there.

    `function` must close over no traced value: pass those (the kernel,
    whose block tables are traced inside `shard_map`) as arguments. A
    custom VJP's closure is traced again where a rematerialized block
    recomputes it, after the trace that made its values has ended (JAX:
    `UnexpectedTracerError`)."""

    def at_default(traced):
        def call(*args):
            with jax.default_matmul_precision("default"):
                return traced(*args)

        return call

    @jax.custom_vjp
    def call(*args):
        return at_default(function)(*args)

    def forward(*args):
        return at_default(functools.partial(jax.vjp, function))(*args)

    def backward(pullback, cotangent):
        return at_default(pullback)(cotangent)

    call.defvjp(forward, backward)
    return call


def attend(
    kernel,
    rule: AttentionRule,
    query,
    key,
    value,
    positions,
    key_valid,
    *,
    sequence: int | None = None,
    head_dim: int | None = None,
):
    """One device's queries attended by `kernel` to every key.

    Shapes the kernel doesn't take as they are are padded around it:

    - a head dimension of part lanes, with zero lanes
      (`attention_blocks.splash_head_dim`): they add nothing to a score,
      and the output's are sliced off;
    - a whole sequence of part blocks, to the kernel's `sequence`
      (`attention_blocks.padded_sequence`), with padding keys that no query
      sees and queries whose outputs are sliced off.

    Args:
        kernel: `splash_kernel`'s, as `shard_map` split it.
        rule: the `AttentionRule` the kernel was built for.
        query: `[batch, queries, kv_heads, groups, head_dim]`, in the
            kernel's row order.
        key: `[batch, keys, kv_heads, head_dim]`.
        value: as `key`.
        positions: `[queries]` int32, each query's position.
        key_valid: `[batch, keys]` bool, `False` on padding.
        sequence: the length the kernel was built for, where it is longer
            than the keys (the queries are then the whole sequence).
        head_dim: the head dimension the kernel computes in; default:
            `splash_head_dim` of the query's.

    Returns:
        As `query`.
    """
    dtype = query.dtype
    queries_count, keys_count, width = query.shape[1], key.shape[1], query.shape[-1]
    lanes = head_dim or splash_head_dim(width)
    length = sequence or keys_count
    scaled = (query.astype(jnp.float32) * rule.scale).astype(dtype)
    scaled = _padded(scaled, -1, lanes)
    if sequence is not None:
        scaled = _padded(scaled, 1, sequence)
    keys, values = (
        _padded(_padded(array.astype(dtype), -1, lanes), 1, length)
        for array in (key, value)
    )
    # Every query is in segment 1, and only the keys that are tokens: a
    # padding key is masked for every query, as the decoder's mask does
    # (those padded on here too).
    valid = _padded(key_valid, 1, length, False)
    segments = splash_kernel_lib.SegmentIds(
        q=jnp.ones((valid.shape[0], scaled.shape[1]), jnp.int32),
        kv=valid.astype(jnp.int32),
    )

    def one_head(kernel, queries, keys, values, segments):
        return kernel(queries, keys, values, segment_ids=segments)

    if jnp.dtype(dtype).itemsize == 2:
        one_head = at_default_precision(one_head)

    # The kernel's layout: heads first, then the sequence.
    per_head = jax.vmap(one_head, in_axes=(None, 0, 0, 0, None))
    output = jax.vmap(per_head, in_axes=(None, 0, 0, 0, 0))(
        kernel,
        jnp.einsum("btkgd->bkgtd", scaled),
        jnp.einsum("bskd->bksd", keys),
        jnp.einsum("bskd->bksd", values),
        segments,
    )
    output = jnp.einsum("bkgtd->btkgd", output)[:, :queries_count, ..., :width]
    has_key = rows_with_a_key(rule, positions, key_valid)[:, :, None, None, None]
    keyless = jnp.zeros((), dtype)
    if rule.keyless_mean:
        keyless = value.astype(jnp.float32).mean(axis=1)[:, None, :, None, :]
    return jnp.where(has_key, output, keyless.astype(dtype))
