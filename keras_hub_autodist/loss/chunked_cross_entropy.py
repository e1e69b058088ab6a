"""Cross-entropy over a vocabulary, one chunk of tokens at a time.

A causal LM's head turns `[batch, sequence, hidden]` states into
`[batch, sequence, vocabulary]` logits, which the loss reads in float32: at
8,192 tokens of a 262,144-token vocabulary that is 8.6 GB, and its gradient
as much again. Here the head runs on a chunk of tokens at a time inside a
`jax.lax.scan`, each chunk's logits live only while its cross-entropy and
argmax are taken, and the backward pass recomputes them (`jax.checkpoint`):
no step holds more than one chunk's logits.

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

import jax
import jax.numpy as jnp


def chunked_cross_entropy(head, hidden, labels, chunks: int):
    """Each token's cross-entropy against its label, and whether the head's
    argmax is its label, with the head applied a chunk of tokens at a time.

    Args:
        head: `[batch, tokens, hidden] -> [batch, tokens, vocabulary]`
            logits, token by token (the causal LM's output projection).
        hidden: `[batch, sequence, hidden]` states.
        labels: `[batch, sequence]` integer labels.
        chunks: how many chunks (dividing `sequence`): `chunk_count`.

    Returns:
        `(cross_entropy, matches)`, both `[batch, sequence]` float32.
    """
    batch, sequence = labels.shape
    if sequence % chunks:
        raise ValueError(
            f"chunks must divide the sequence. Received: chunks={chunks}, "
            f"sequence={sequence}"
        )
    if chunks == 1:  # the whole sequence at once: nothing to recompute
        return _cross_entropy(head, hidden, labels)
    per_chunk = sequence // chunks
    # [batch, per_chunk, chunks, ...] -> chunk-major: chunk j is tokens
    # j, j + chunks, ... of every sequence.
    states = jnp.moveaxis(hidden.reshape(batch, per_chunk, chunks, -1), 2, 0)
    targets = jnp.moveaxis(labels.reshape(batch, per_chunk, chunks), 2, 0)

    one_chunk = jax.checkpoint(functools.partial(_cross_entropy, head))

    def step(carry, chunk):
        return carry, one_chunk(*chunk)

    _, (entropy, matches) = jax.lax.scan(step, None, (states, targets))

    def back(values):
        return jnp.moveaxis(values, 0, 2).reshape(batch, sequence)

    return back(entropy), back(matches)


def _cross_entropy(head, states, targets):
    """`[batch, tokens]` cross-entropy and argmax matches of `head(states)`
    against `targets`, the logits in float32 as Keras' loss reads them."""
    logits = head(states).astype(jnp.float32)
    vocabulary = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 2)
    is_label = vocabulary == targets[..., None].astype(jnp.int32)
    label_logit = jnp.sum(jnp.where(is_label, logits, 0.0), axis=-1)
    log_sum = jax.nn.logsumexp(logits, axis=-1)
    matches = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
    return log_sum - label_logit, matches
