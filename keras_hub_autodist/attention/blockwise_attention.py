"""Attention over blocks of keys, with an online softmax: memory linear in
the sequence.

One device's queries attend to a sequence of keys and values one block of
keys at a time, keeping a running maximum, denominator and weighted sum per
query (the online softmax of flash attention). Nothing holds more than one
`[queries, key block]` block of scores. The backward pass is written out too
(`jax.custom_vjp`): it recomputes each block's probabilities from the saved
softmax maximum and sum, so that XLA can't keep every block's scores for the
gradient (left to autodiff, XLA on CPU merges the recomputation back into
the whole score matrix).

The masking is keras': a masked score is replaced by `-1e9`
(`MASKED_SCORE`), so every query with a key to attend puts exactly zero
weight on its masked keys. A query with none gets zeros (keras' `Softmax`
zeroes masked weights after the softmax) or the mean of every value
(`jax.nn.dot_product_attention`'s equal weights), as the layer would. A
key is masked when it is padding, after the query (causal), or `window` or
more positions before it (sliding windows).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from keras_hub_autodist.attention.attention_blocks import KEY_BLOCK

# keras' `Softmax` puts this in place of each masked score (float32).
MASKED_SCORE = -1e9


@dataclasses.dataclass(frozen=True)
class AttentionRule:
    """What a query may attend to, and how its scores are formed.

    Args:
        scale: the factor on each query before the dot product.
        soft_cap: `cap · tanh(score / cap)` on each score, or `None`.
        window: a key `window` or more positions before its query is
            masked (sliding-window attention), or `None`.
        causal: a key after its query is masked.
        keyless_mean: a query with no key to attend gets the mean of every
            value (`jax.nn.dot_product_attention`'s equal weights), else
            zeros (keras' `Softmax(mask=...)`, which zeroes masked weights).
        key_block: keys per block.
    """

    scale: float
    soft_cap: float | None = None
    window: int | None = None
    causal: bool = True
    keyless_mean: bool = False
    key_block: int = KEY_BLOCK


def key_block_size(length: int, most: int) -> int:
    """The largest divisor of `length` that is at most `most`.

    Example:
    >>> key_block_size(4096, 512), key_block_size(24, 16)
    (512, 12)
    """
    for size in range(min(length, most), 0, -1):
        if length % size == 0:
            return size
    return length


def _allowed(rule, query_positions, key_positions, key_valid):
    """`[batch, 1, 1, queries, keys]`: which scores count."""
    allowed = key_valid[:, None, None, None, :]
    distance = query_positions[:, None] - key_positions[None, :]
    if rule.causal:
        allowed = allowed & (distance >= 0)
    if rule.window is not None:
        allowed = allowed & (distance < rule.window)
    return allowed


def _scores(rule, scaled_queries, keys):
    """Raw scores `[batch, kv_heads, groups, queries, keys]` and the capped
    ones (the same without a soft cap)."""
    raw = jnp.einsum("btkgd,bskd->bkgts", scaled_queries, keys)
    if rule.soft_cap is None:
        return raw, raw
    return raw, rule.soft_cap * jnp.tanh(raw / rule.soft_cap)


def _blocks(array, size):
    """`[batch, sequence, ...]` -> `[blocks, batch, size, ...]`."""
    batch, length = array.shape[:2]
    blocked = array.reshape(batch, length // size, size, *array.shape[2:])
    return jnp.moveaxis(blocked, 1, 0)


def _unblocks(blocked):
    """The inverse of `_blocks`."""
    array = jnp.moveaxis(blocked, 0, 1)
    return array.reshape(array.shape[0], -1, *array.shape[3:])


def _skipped(rule, query_positions, key_positions):
    """Whether every score of these queries and keys is masked by position
    (after every query, or out of every query's window): such a key block
    is skipped. Padding never skips a block."""
    skipped = jnp.asarray(False)
    if rule.causal:
        skipped = skipped | (key_positions.min() > query_positions.max())
    if rule.window is not None:
        distance = query_positions.min() - key_positions.max()
        skipped = skipped | (distance >= rule.window)
    return skipped


def rows_with_a_key(rule, query_positions, key_valid):
    """`[batch, queries]` bool: whether a query has any key to attend, the
    keys being the whole sequence in order (`key_valid[:, j]` is position
    `j`'s). Such a query is answered apart (`AttentionRule.keyless_mean`):
    the blocks it would spread equal weights over are skipped."""
    length = key_valid.shape[1]
    counts = jnp.cumsum(key_valid.astype(jnp.int32), axis=1)
    # Valid keys before position j: counts_before[:, j].
    counts_before = jnp.pad(counts, ((0, 0), (1, 0)))
    end = query_positions + 1 if rule.causal else jnp.full_like(query_positions, length)
    begin = jnp.zeros_like(query_positions)
    if rule.window is not None:
        begin = jnp.maximum(query_positions - rule.window + 1, 0)
    end = jnp.clip(end, 0, length)
    return (counts_before[:, end] - counts_before[:, begin]) > 0


def start_carry(queries):
    """The online softmax's state before any key, per query: the highest
    score so far, the sum of `exp(score - highest)`, and the weighted sum
    of values (`[batch, kv_heads, groups, queries(, head_dim)]`, float32)."""
    batch, length, kv_heads, groups, head_dim = queries.shape
    shape = (batch, kv_heads, groups, length)
    return (
        jnp.full(shape, MASKED_SCORE, jnp.float32),
        jnp.zeros(shape, jnp.float32),
        jnp.zeros((*shape, head_dim), jnp.float32),
    )


def accumulate(
    rule, carry, scaled, keys, values, query_positions, key_positions, key_valid
):
    """The online softmax's state after `keys` and `values` too, one key
    block at a time; key blocks masked by position are skipped.

    Args:
        rule: the `AttentionRule`.
        carry: `start_carry`'s, or a previous `accumulate`'s.
        scaled: the queries times `rule.scale`, float32.
        keys: `[batch, keys, kv_heads, head_dim]`.
        values: as `keys`.
        query_positions: `[queries]` int32.
        key_positions: `[keys]` int32.
        key_valid: `[batch, keys]` bool, `False` on padding.
    """
    size = key_block_size(keys.shape[1], rule.key_block)

    def attend(carry, block):
        high, total, weighted = carry
        key, value, positions, valid = block
        _, scores = _scores(rule, scaled, key.astype(jnp.float32))
        allowed = _allowed(rule, query_positions, positions, valid)
        scores = jnp.where(allowed, scores, MASKED_SCORE)
        new_high = jnp.maximum(high, scores.max(axis=-1))
        weights = jnp.exp(scores - new_high[..., None])
        decay = jnp.exp(high - new_high)
        total = total * decay + weights.sum(axis=-1)
        weighted = weighted * decay[..., None] + jnp.einsum(
            "bkgts,bskd->bkgtd", weights, value.astype(jnp.float32)
        )
        return new_high, total, weighted

    def step(carry, block):
        skipped = _skipped(rule, query_positions, block[2])
        return jax.lax.cond(skipped, lambda c, b: c, attend, carry, block), None

    blocks = (
        _blocks(keys, size),
        _blocks(values, size),
        key_positions.reshape(-1, size),
        _blocks(key_valid, size),
    )
    carry, _ = jax.lax.scan(step, carry, blocks)
    return carry


def finish(rule, carry, has_key, value_mean):
    """The output `[batch, queries, kv_heads, groups, head_dim]` (float32)
    of an online softmax's final state. A query without a key (`has_key`,
    `[batch, queries]`) gets `value_mean` (`[batch, kv_heads, head_dim]`,
    the mean of every value) under `rule.keyless_mean`, else zeros."""
    _, total, weighted = carry
    has_key = has_key[:, None, None, :]
    keyless = 0.0
    if rule.keyless_mean:
        keyless = value_mean[:, :, None, None, :]
    output = jnp.where(
        has_key[..., None], weighted / jnp.where(has_key, total, 1)[..., None], keyless
    )
    return jnp.einsum("bkgtd->btkgd", output)


def _forward(rule, queries, keys, values, query_positions, key_positions, key_valid):
    """The output `[batch, queries, kv_heads, groups, head_dim]` (float32),
    and each query's highest score and sum of `exp(score - highest)`: kept
    apart, as a log-sum-exp near `MASKED_SCORE` would lose the sum's log
    to rounding."""
    scaled = queries.astype(jnp.float32) * rule.scale
    carry = accumulate(
        rule,
        start_carry(queries),
        scaled,
        keys,
        values,
        query_positions,
        key_positions,
        key_valid,
    )
    has_key = rows_with_a_key(rule, query_positions, key_valid)
    value_mean = values.astype(jnp.float32).mean(axis=1)
    return finish(rule, carry, has_key, value_mean), carry[:2]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def blockwise_attention(
    rule, queries, keys, values, query_positions, key_positions, key_valid
):
    """Attention of `queries` to `keys` and `values`, one key block at a time.

    Args:
        rule: the `AttentionRule`.
        queries: `[batch, queries, kv_heads, groups, head_dim]`; query head
            `k · groups + g` attends with key/value head `k`.
        keys: `[batch, keys, kv_heads, head_dim]`.
        values: as `keys`.
        query_positions: `[queries]` int32, each query's place in the
            sequence.
        key_positions: `[keys]` int32, each key's.
        key_valid: `[batch, keys]` bool, `False` on padding.

    Returns:
        `[batch, queries, kv_heads, groups, head_dim]` in the queries' dtype.
    """
    output, _ = _forward(
        rule, queries, keys, values, query_positions, key_positions, key_valid
    )
    return output.astype(queries.dtype)


def _attention_forward(
    rule, queries, keys, values, query_positions, key_positions, key_valid
):
    output, softmax_sums = _forward(
        rule, queries, keys, values, query_positions, key_positions, key_valid
    )
    saved = (queries, keys, values, query_positions, key_positions, key_valid)
    return output.astype(queries.dtype), (saved, output, softmax_sums)


def gradients(
    rule, query_grad, softmax, keys, values, key_positions, key_valid, **queries
):
    """The queries' gradient so far plus that through `keys` and `values`,
    and the gradients of `keys` and `values` (float32), one key block at a
    time: each block's probabilities come back from the saved softmax.

    Args:
        rule: the `AttentionRule`.
        query_grad: the queries' gradient so far (float32, unscaled).
        softmax: `(high, total, has_key, correction)`: each query's highest
            score, its sum of `exp(score - high)` (1 where it has no key),
            whether it has a key, and its sum of output x output gradient.
        keys, values, key_positions, key_valid: as `accumulate`'s.
        **queries: `scaled` (as `accumulate`'s), `positions` (its
            `query_positions`) and `output_grad` (float32).
    """
    high, total, has_key, correction = softmax
    scaled, positions = queries["scaled"], queries["positions"]
    output_grad = queries["output_grad"]
    size = key_block_size(keys.shape[1], rule.key_block)

    def attend(query_grad, block):
        key, value, key_positions, valid = block
        key, value = key.astype(jnp.float32), value.astype(jnp.float32)
        raw, scores = _scores(rule, scaled, key)
        allowed = _allowed(rule, positions, key_positions, valid)
        scores = jnp.where(allowed, scores, MASKED_SCORE)
        weights = jnp.exp(scores - high[..., None]) / total[..., None]
        # A query without a key has no weights here (see `keyless_mean`).
        weights = jnp.where(has_key[..., None], weights, 0.0)
        value_grad = jnp.einsum("bkgts,btkgd->bskd", weights, output_grad)
        weight_grad = jnp.einsum("btkgd,bskd->bkgts", output_grad, value)
        score_grad = weights * (weight_grad - correction[..., None])
        # A masked score is a constant: no gradient flows through it.
        score_grad = jnp.where(allowed, score_grad, 0.0)
        if rule.soft_cap is not None:
            score_grad = score_grad * (1 - jnp.tanh(raw / rule.soft_cap) ** 2)
        query_grad = query_grad + jnp.einsum("bkgts,bskd->btkgd", score_grad, key)
        key_grad = jnp.einsum("bkgts,btkgd->bskd", score_grad, scaled)
        return query_grad, (key_grad, value_grad)

    def skip(query_grad, block):
        zeros = jnp.zeros(block[0].shape, jnp.float32)
        return query_grad, (zeros, zeros)

    def step(query_grad, block):
        skipped = _skipped(rule, positions, block[2])
        return jax.lax.cond(skipped, skip, attend, query_grad, block)

    blocks = (
        _blocks(keys, size),
        _blocks(values, size),
        key_positions.reshape(-1, size),
        _blocks(key_valid, size),
    )
    query_grad, (key_grads, value_grads) = jax.lax.scan(step, query_grad, blocks)
    return query_grad, _unblocks(key_grads), _unblocks(value_grads)


def softmax_of(rule, carry_sums, output, output_grad, query_positions, key_valid):
    """`gradients`' `softmax` from the forward pass' saved sums, output
    (float32) and the output's gradient (float32)."""
    high, total = carry_sums
    # Each query's sum of output x its gradient: softmax's correction term.
    correction = jnp.einsum("btkgd,btkgd->bkgt", output_grad, output)
    has_key = rows_with_a_key(rule, query_positions, key_valid)[:, None, None, :]
    return high, jnp.where(has_key, total, 1), has_key, correction


def keyless_value_grad(rule, output_grad, query_positions, key_valid):
    """`[batch, kv_heads, head_dim]`: what each value's gradient gains from
    the queries without a key, which took the mean of every value (times
    the number of values), under `rule.keyless_mean`."""
    rows = rows_with_a_key(rule, query_positions, key_valid)
    keyless = 1.0 - rows.astype(jnp.float32)
    return jnp.einsum("btkgd,bt->bkd", output_grad, keyless)


def _attention_backward(rule, residuals, output_grad):
    """Flash attention's backward pass, one key block at a time."""
    saved, output, carry_sums = residuals
    queries, keys, values, query_positions, key_positions, key_valid = saved
    output_grad = output_grad.astype(jnp.float32)
    softmax = softmax_of(
        rule, carry_sums, output, output_grad, query_positions, key_valid
    )
    query_grad, key_grad, value_grad = gradients(
        rule,
        jnp.zeros(queries.shape, jnp.float32),
        softmax,
        keys,
        values,
        key_positions,
        key_valid,
        scaled=queries.astype(jnp.float32) * rule.scale,
        positions=query_positions,
        output_grad=output_grad,
    )
    if rule.keyless_mean:
        keyless = keyless_value_grad(rule, output_grad, query_positions, key_valid)
        value_grad = value_grad + keyless[:, None] / keys.shape[1]
    return (
        (query_grad * rule.scale).astype(queries.dtype),
        key_grad.astype(keys.dtype),
        value_grad.astype(values.dtype),
        None,
        None,
        None,
    )


blockwise_attention.defvjp(_attention_forward, _attention_backward)
