"""What a decoder block hands its attention layer when that layer attends
per device: the padding its mask is built from, not the mask.

keras-hub's decoder blocks build a `[batch, queries, keys]` mask (causal
and key padding) and pass it to their attention layer. The attention per
device needs only the key padding of it; built whole, the mask is
quadratic in the sequence, and a block of it sits on every device of a
context mesh. So each known block's mask method (`compat_attention.
DECODER_BLOCKS`) is wrapped to hand the padding it was called with to its
attention layer (`Handoff`), beside the mask:

- Where the layer reads the mask only in `_compute_attention`, which the
  attention per device replaces, the mask is still returned but nothing
  reads it, and XLA never computes it.
- Where the layer also reduces it over the keys (Gemma's zero the output of
  a query with no key to attend), and the layer will attend per device,
  the block returns the `[batch, queries, 1]` answer of that reduction
  (`query_has_key`) instead of the mask: the layer computes the same
  output from it, and no device builds a square.
"""

from __future__ import annotations

import dataclasses
import inspect
import threading
from collections.abc import Callable

import jax
import jax.numpy as jnp

from keras_hub_autodist.compat.attention import DecoderBlock


@dataclasses.dataclass(frozen=True)
class BlockMasks:
    """What a decoder block built its attention layer's mask from.

    Args:
        padding: its `[batch, sequence]` padding mask, or `None` (then the
            mask came from the inputs' Keras mask, or is causal alone).
        merges_other_masks: whether it merged another mask in (a caller's
            own attention mask, image tokens): then the mask is more than
            causal and key padding.
        compact: whether the block handed the layer `query_has_key`'s
            `[batch, queries, 1]` mask instead of the whole one.
        window: the sliding window the whole mask would have held, or
            `None`.
    """

    padding: object | None
    merges_other_masks: bool
    compact: bool = False
    window: int | None = None


class Handoff:
    """One decoder block's `BlockMasks`, from its mask method to its
    attention layer's `_compute_attention`, for the call being traced (per
    thread): `take` returns what the last `put` left, once."""

    def __init__(self):
        self._local = threading.local()

    def put(self, masks: BlockMasks) -> None:
        self._local.masks = masks

    def take(self) -> BlockMasks | None:
        masks = getattr(self._local, "masks", None)
        self._local.masks = None
        return masks


def valid_keys(padding) -> jax.Array:
    """`[batch, keys]` bool: the keys a padding mask leaves, counted as the
    decoder block counts them (merged as int32, kept above 0.5 by keras'
    `Softmax`)."""
    padding = jnp.asarray(padding)
    if padding.dtype == jnp.bool_:
        return padding
    return padding.astype(jnp.int32) > 0


def query_has_key(padding, window: int | None) -> jax.Array:
    """`[batch, queries, 1]` int32: whether each query has a key to attend
    under a causal mask with `padding`'s key padding (and `window`: keys
    `window` or more positions before the query masked) — what a layer's
    reduction of the whole mask over its keys answers."""
    seen = jnp.cumsum(valid_keys(padding).astype(jnp.int32), axis=1)
    if window is not None:
        # Keys more than `window - 1` positions back are out of the window.
        out_of_window = jnp.pad(seen, ((0, 0), (window, 0)))[:, : seen.shape[1]]
        seen = seen - out_of_window
    return (seen > 0).astype(jnp.int32)[:, :, None]


def whole_mask(masks: BlockMasks, queries: int, keys: int) -> jax.Array:
    """`[batch, queries, keys]` int32: the mask the block would have built
    (causal, key padding, and its window) for a layer that must take its own
    path after all."""
    query_positions = jnp.arange(queries)[:, None]
    key_positions = jnp.arange(keys)[None, :]
    allowed = query_positions >= key_positions
    if masks.window is not None:
        allowed = allowed & (query_positions - key_positions < masks.window)
    return (allowed[None] & valid_keys(masks.padding)[:, None, :]).astype(jnp.int32)


def mask_method(
    layer,
    block: DecoderBlock,
    handoff: Handoff,
    attends_per_device: Callable[[int, int], bool],
    window: int | None,
) -> Callable[..., object]:
    """`layer`'s mask method, wrapped to `put` its `BlockMasks` for its
    attention layer; where that layer reduces the mask and
    `attends_per_device(batch, sequence_length)`, it returns `query_has_key`'s
    mask instead of the whole one.

    Args:
        layer: a decoder block of `compat_attention.DECODER_BLOCKS`.
        block: its `DecoderBlock`.
        handoff: the `Handoff` its attention layer takes from.
        attends_per_device: whether its attention layer will attend per
            device that many whole sequences of that many tokens, without
            a cache.
        window: the attention layer's sliding window, where the block masks
            it into the mask itself (`DecoderBlock.window_in_mask`).
    """
    original = getattr(layer, block.mask_method)
    signature = inspect.signature(getattr(type(layer), block.mask_method))
    # (sequence, padding_mask, *other_masks, cache, cache_update_index)
    names = list(signature.parameters)[1:]

    def build(*args, **kwargs):
        given = {**dict(zip(names, args)), **kwargs}
        sequence, padding = given[names[0]], given[names[1]]
        others = [given.get(name) for name in names[2 : 2 + block.other_masks]]
        cache = given.get(names[2 + block.other_masks])
        masks = BlockMasks(
            padding=padding,
            merges_other_masks=any(other is not None for other in others),
            window=window,
        )
        compact = (
            block.reduced_by_attention
            and padding is not None
            and not masks.merges_other_masks
            and cache is None
            and attends_per_device(*sequence.shape[:2])
        )
        if compact:
            handoff.put(dataclasses.replace(masks, compact=True))
            return query_has_key(padding, window)
        handoff.put(masks)
        return original(*args, **kwargs)

    return build
