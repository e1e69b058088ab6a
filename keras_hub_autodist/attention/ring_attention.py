"""Ring attention: keys and values travel around the context axis.

Inside `jax.shard_map`, each device starts with its own block of keys and
values and passes it on to the next device of the context axis
(`jax.lax.ppermute`), `contexts` times, so that every device sees every
block once while holding at most two (the one it attends, the one
arriving). Each device keeps the online softmax's state of its queries
(`blockwise_attention.start_carry` / `accumulate` / `finish`) across the
blocks. XLA may overlap each transfer with the attention of the block
before it: nothing the transfer sends depends on that attention.

The backward pass (`jax.custom_vjp`) goes around the ring again: each
block carries the gradients of its keys and values, each device adds its
queries' share (`blockwise_attention.gradients`) and passes both on; after
`contexts` passes each block's gradients are back on the device that owns
it. Only the device's own block is kept for the backward pass, not the
whole sequence's keys and values, as `all_gather` must.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from keras_hub_autodist.attention import blockwise_attention as online


def _pass_on(arrays, axis: str, contexts: int):
    """Each of `arrays` sent to the next device of `axis` (the last one's
    to the first)."""
    ring = [(i, (i + 1) % contexts) for i in range(contexts)]
    return [jax.lax.ppermute(array, axis, ring) for array in arrays]


def _block_at(step, key_valid, axis: str, contexts: int, block: int):
    """The positions `[block]` and padding `[batch, block]` of the block a
    device holds after `step` passes: the one its `step`-th predecessor
    owns."""
    source = (jax.lax.axis_index(axis) - step) % contexts
    positions = source * block + jnp.arange(block, dtype=jnp.int32)
    valid = jax.lax.dynamic_slice_in_dim(key_valid, source * block, block, axis=1)
    return positions, valid


def _value_mean(rule, value, axis: str, contexts: int):
    """The mean of every value of the sequence (`[batch, kv_heads,
    head_dim]`), where `rule.keyless_mean` needs it."""
    if not rule.keyless_mean:
        return None
    total = jax.lax.psum(value.astype(jnp.float32).sum(axis=1), axis)
    return total / (value.shape[1] * contexts)


def _forward(rule, axis, contexts, queries, positions, key, value, key_valid):
    block = key.shape[1]
    scaled = [q.astype(jnp.float32) * rule.scale for q in queries]
    carries = [online.start_carry(q) for q in queries]
    held = [key, value]
    for step in range(contexts):
        arriving = _pass_on(held, axis, contexts) if step < contexts - 1 else held
        key_positions, valid = _block_at(step, key_valid, axis, contexts, block)
        carries = [
            online.accumulate(rule, carry, s, *held, p, key_positions, valid)
            for carry, s, p in zip(carries, scaled, positions)
        ]
        held = arriving
    value_mean = _value_mean(rule, value, axis, contexts)
    outputs = [
        online.finish(
            rule, carry, online.rows_with_a_key(rule, p, key_valid), value_mean
        )
        for carry, p in zip(carries, positions)
    ]
    return outputs, [carry[:2] for carry in carries]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def ring_attention(rule, axis, contexts, queries, positions, key, value, key_valid):
    """Attention of a device's queries to the whole sequence's keys and
    values, which arrive block by block around the context axis. Called
    inside `jax.shard_map`.

    Args:
        rule: the `AttentionRule`.
        axis: the mesh axis that splits the sequence.
        contexts: its size.
        queries: a tuple of `[batch, queries, kv_heads, groups, head_dim]`
            arrays: parts of the device's queries, each attended apart (so
            that causal masking skips each part's own key blocks).
        positions: a tuple of `[queries]` int32, each part's places in the
            sequence.
        key: `[batch, block, kv_heads, head_dim]`, the device's block of
            keys (device `i` holds positions `i · block` onward).
        value: as `key`.
        key_valid: `[batch, sequence]` bool, the whole sequence's padding.

    Returns:
        A tuple of outputs, one per part, each as its queries.
    """
    outputs, _ = _forward(
        rule, axis, contexts, queries, positions, key, value, key_valid
    )
    return tuple(o.astype(q.dtype) for o, q in zip(outputs, queries))


def _ring_forward(rule, axis, contexts, queries, positions, key, value, key_valid):
    outputs, sums = _forward(
        rule, axis, contexts, queries, positions, key, value, key_valid
    )
    saved = (queries, positions, key, value, key_valid, outputs, sums)
    return tuple(o.astype(q.dtype) for o, q in zip(outputs, queries)), saved


def _ring_backward(rule, axis, contexts, saved, output_grads):
    queries, positions, key, value, key_valid, outputs, sums = saved
    block = key.shape[1]
    output_grads = [g.astype(jnp.float32) for g in output_grads]
    softmaxes = [
        online.softmax_of(rule, s, o, g, p, key_valid)
        for s, o, g, p in zip(sums, outputs, output_grads, positions)
    ]
    scaled = [q.astype(jnp.float32) * rule.scale for q in queries]
    query_grads = [jnp.zeros(q.shape, jnp.float32) for q in queries]
    held = [key, value]
    held_grads = [jnp.zeros(key.shape, jnp.float32)] * 2
    for step in range(contexts):
        arriving = _pass_on(held, axis, contexts) if step < contexts - 1 else held
        key_positions, valid = _block_at(step, key_valid, axis, contexts, block)
        for part, (softmax, s, p, g) in enumerate(
            zip(softmaxes, scaled, positions, output_grads)
        ):
            query_grads[part], key_grad, value_grad = online.gradients(
                rule,
                query_grads[part],
                softmax,
                *held,
                key_positions,
                valid,
                scaled=s,
                positions=p,
                output_grad=g,
            )
            held_grads = [held_grads[0] + key_grad, held_grads[1] + value_grad]
        # After the last pass each block's gradients are back on its owner.
        held_grads = _pass_on(held_grads, axis, contexts)
        held = arriving
    key_grad, value_grad = held_grads
    if rule.keyless_mean:
        keyless = sum(
            online.keyless_value_grad(rule, g, p, key_valid)
            for g, p in zip(output_grads, positions)
        )
        keyless = jax.lax.psum(keyless, axis) / (block * contexts)
        value_grad = value_grad + keyless[:, None]
    return (
        tuple((g * rule.scale).astype(q.dtype) for g, q in zip(query_grads, queries)),
        tuple(None for _ in positions),
        key_grad.astype(key.dtype),
        value_grad.astype(value.dtype),
        None,
    )


ring_attention.defvjp(_ring_forward, _ring_backward)
