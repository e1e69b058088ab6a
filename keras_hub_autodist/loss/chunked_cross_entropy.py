"""Cross-entropy over a vocabulary, one chunk of tokens at a time, with its
gradient taken in the same pass.

A causal LM's head turns `[batch, sequence, hidden]` states into
`[batch, sequence, vocabulary]` logits, which the loss reads in float32: at
8,192 tokens of a 262,144-token vocabulary that is 8.6 GB, and its gradient
as much again. Here the head runs on a chunk of tokens at a time inside a
`jax.lax.scan`, and each chunk's logits live only while its cross-entropy,
its argmax and their gradient are taken: no step holds more than one
chunk's logits.

The gradient comes with the loss, as a fused linear cross-entropy's does:
the gradient of a token's cross-entropy with respect to its logits is
`softmax(logits) - one_hot(label)`, known as soon as the logits are, so
each chunk pulls it back through the head at once, to the states and to the
head's trained weights. The backward pass only scales what the forward pass
kept (one `[batch, sequence, hidden]` array, and the head's gradient where
it is trained): the head runs once forward and once backward per token, as
in the whole-logits step, and nothing is recomputed.

The backward pass receives a cotangent per token, `g`. The states' gradient
takes it token by token, exactly. The head's weights sum over all tokens,
so the forward pass sums each token's contribution weighed by the loss'
per-token `weights` and the backward pass scales that sum by `g`'s ratio to
them: exact where `g` is proportional to `weights`, as it is for every
reduction a Keras loss applies to per-token values (a sum or a mean, with
or without sample weights, times a loss weight or a loss scale).

The chunks are strided over the sequence (chunk `j` holds tokens `j`,
`j + chunks`, `j + 2 * chunks`, ...): a sequence split over a context axis
keeps its split in every chunk, so no device gathers another's tokens.
Where the head's kernel is split over its vocabulary (the model axis), each
chunk's logits stay split: the log-sum-exp, the label's logit (a masked sum,
never a gather by index) and the argmax reduce over the vocabulary with a
few `[batch, tokens]` all-reduces, as Megatron's vocabulary-parallel
cross-entropy does.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp


def chunked_cross_entropy(
    apply: Callable,
    params,
    hidden,
    labels,
    weights,
    chunks: int,
):
    """Each token's cross-entropy against its label, and whether the head's
    argmax is its label, with the head applied a chunk of tokens at a time.

    Args:
        apply: `apply(params, states)`: `[batch, tokens, hidden]` states to
            `[batch, tokens, vocabulary]` logits, token by token (the causal
            LM's output projection, with any soft cap).
        params: the head's trained weights, a pytree (empty where the head
            is frozen); the cross-entropy's gradient reaches them.
        hidden: `[batch, sequence, hidden]` states.
        labels: `[batch, sequence]` integer labels.
        weights: `[batch, sequence]` float weights the loss gives each
            token's cross-entropy (the sample weights; module docstring).
        chunks: how many chunks (dividing `sequence`): `chunk_count`.

    Returns:
        `(cross_entropy, matches)`, both `[batch, sequence]` float32.
    """
    sequence = labels.shape[1]
    if sequence % chunks:
        raise ValueError(
            f"chunks must divide the sequence. Received: chunks={chunks}, "
            f"sequence={sequence}"
        )
    return _fused(apply, chunks, params, hidden, labels, weights)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _fused(apply, chunks, params, hidden, labels, weights):
    del weights  # only the gradient reads them

    def step(carry, chunk):
        states, targets = chunk
        entropy, matches, _ = _entropy(apply(params, states), targets)
        return carry, (entropy, matches)

    _, (entropy, matches) = jax.lax.scan(
        step, None, (_to_chunks(hidden, chunks), _to_chunks(labels, chunks))
    )
    return _from_chunks(entropy), _from_chunks(matches)


def _fused_forward(apply, chunks, params, hidden, labels, weights):
    token_weights = weights.astype(jnp.float32)
    trained = bool(jax.tree.leaves(params))

    def step(head_gradient, chunk):
        states, targets, chunk_weights = chunk
        logits, pull_back = jax.vjp(apply, params, states)
        entropy, matches, logits_gradient = _entropy(logits, targets)
        if trained:  # the head's weights sum every token's share, weighed
            logits_gradient = logits_gradient * chunk_weights[..., None]
        params_gradient, states_gradient = pull_back(
            logits_gradient.astype(logits.dtype)
        )
        head_gradient = jax.tree.map(
            lambda total, part: total + part.astype(jnp.float32),
            head_gradient,
            params_gradient,
        )
        return head_gradient, (entropy, matches, states_gradient)

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    head_gradient, (entropy, matches, states_gradient) = jax.lax.scan(
        step,
        zeros,
        (
            _to_chunks(hidden, chunks),
            _to_chunks(labels, chunks),
            _to_chunks(token_weights, chunks),
        ),
    )
    head_gradient = jax.tree.map(
        lambda total, p: total.astype(p.dtype), head_gradient, params
    )
    kept = (_from_chunks(states_gradient), head_gradient, token_weights)
    return (_from_chunks(entropy), _from_chunks(matches)), kept


def _fused_backward(apply, chunks, kept, cotangents):
    del apply, chunks
    states_gradient, head_gradient, weights = kept
    per_token = cotangents[0].astype(jnp.float32)
    if jax.tree.leaves(head_gradient):
        # The states' gradient was weighed with the head's: undo the weight
        # token by token (a token of weight 0 has a cotangent of 0).
        weighed = weights != 0
        scale = jnp.where(weighed, per_token / jnp.where(weighed, weights, 1.0), 0.0)
        ratio = jnp.sum(per_token * weights) / jnp.maximum(
            jnp.sum(weights * weights), jnp.finfo(jnp.float32).tiny
        )
    else:
        scale, ratio = per_token, 0.0
    hidden_gradient = (scale[..., None] * states_gradient).astype(states_gradient.dtype)
    params_gradient = jax.tree.map(
        lambda total: (ratio * total).astype(total.dtype), head_gradient
    )
    return params_gradient, hidden_gradient, None, None


_fused.defvjp(_fused_forward, _fused_backward)


def _entropy(logits, targets):
    """`[batch, tokens]` cross-entropy and argmax matches of `logits`
    against `targets`, in float32 as Keras' loss reads them, and the
    cross-entropy's gradient with respect to the float32 logits.

    Each label means what it means to Keras' sparse cross-entropy, which
    reads it as its loss converts it (to float32, then to int32) and
    one-hot encodes it: a label outside the vocabulary, negative or too
    large (Hugging Face's -100), is a row of zeros, so its cross-entropy
    and gradient are 0 while it still counts as a token in a mean. The
    matches compare the argmax with the label in the logits' dtype, as
    Keras' accuracy does.
    """
    dtype = logits.dtype
    logits = logits.astype(jnp.float32)
    labels = targets.astype(jnp.float32).astype(jnp.int32)
    vocabulary = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 2)
    is_label = vocabulary == labels[..., None]
    in_vocabulary = (labels >= 0) & (labels < logits.shape[-1])
    label_logit = jnp.sum(jnp.where(is_label, logits, 0.0), axis=-1)
    log_sum = jax.nn.logsumexp(logits, axis=-1)
    predicted = jnp.argmax(logits, axis=-1).astype(dtype)
    matches = (predicted == targets.astype(dtype)).astype(jnp.float32)
    entropy = jnp.where(in_vocabulary, log_sum - label_logit, 0.0)
    gradient = jnp.exp(logits - log_sum[..., None]) - is_label
    gradient = jnp.where(in_vocabulary[..., None], gradient, 0.0)
    return entropy, matches, gradient


def _to_chunks(values, chunks: int):
    """`[batch, sequence, ...]` -> `[chunks, batch, sequence // chunks,
    ...]`: chunk `j` holds tokens `j, j + chunks, ...` of every row."""
    batch, sequence = values.shape[:2]
    split = values.reshape(batch, sequence // chunks, chunks, *values.shape[2:])
    return jnp.moveaxis(split, 2, 0)


def _from_chunks(values):
    """The inverse of `_to_chunks`."""
    chunks, batch, per_chunk = values.shape[:3]
    return jnp.moveaxis(values, 0, 2).reshape(
        batch, per_chunk * chunks, *values.shape[3:]
    )
