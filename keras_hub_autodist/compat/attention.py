"""The compat layer for keras-hub's attention layers: what each family's
`_compute_attention` computes, read from its private attributes.

Part of the compat package (which holds every private touchpoint): the
attention run per device on a context mesh (`attention.context_attention`)
replaces a layer's `_compute_attention` through `compat.patch_instance`, and
must compute what the layer would. `attention_reading(layer)` says how, for
the layers whose rule is known; `None` for any other layer, which keeps
keras-hub's own computation.

What each known layer's `_compute_attention(q, k, v, attention_mask, ...)`
does with its mask, which the decoder block built as causal and key padding:

- Gemma and Gemma 3 take the keys and values per key/value head, scale the
  queries (`1/sqrt(head_dim)`, or `1/sqrt(hidden_dim / heads)`), soft-cap
  the scores, and on sliding-window layers also mask keys `window` or more
  positions before their query.
- Gemma 4 takes them per key/value head too, with a scale of 1 (its
  queries and keys are RMS-normalized instead), an optional soft cap, and
  its local layers' window masked by its decoder blocks into the mask
  itself. Its global layers may have their own head size and fewer
  key/value heads (keys and values from one projection), and its last
  layers may attend the keys and values of an earlier layer: each arrives
  at `_compute_attention` as whole-sequence keys and values, with RoPE
  (partial on global layers) applied, so none changes the reading. `call`
  zeroes the output of a query with no key to attend, on either path.
- Llama, Mistral, Mixtral, Phi-3, SmolLM3, Qwen 2, Qwen 3, Qwen-MoE and
  Qwen3-MoE take them repeated to the query heads (`ops.repeat` in `call`,
  before `_compute_attention`), and drop out the attention's output in
  `call`, not its weights. Mistral's and Mixtral's decoder blocks mask their
  sliding window into the mask itself, from the same `sliding_window`.
- Qwen 2, Qwen 3, Qwen-MoE and Qwen3-MoE mask their sliding window inside
  `_compute_attention`, and only on keras' `Softmax` path:
  `ops.dot_product_attention` gets the decoder block's causal and padding
  mask alone, so no window there. (Qwen3-MoE's backbone always has one:
  32768 by default.)
- Each of these but Gemma's calls `ops.dot_product_attention` where its
  module's `fused_attention_op_available()` says so (Mixtral, Qwen-MoE and
  Gemma 4: where their `_use_fused_attention_op()` does, which a context
  mesh turns off), else keras' `Softmax`.

Layers computed otherwise keep keras-hub's own path (`None`): attention
both ways (Gemma's and Gemma 4's embedding models), and a model with a
vision encoder (`attention.context_attention` leaves it whole).

Each known decoder block builds that mask (`DECODER_BLOCKS` says how):
`[batch, queries, keys]`, quadratic in the sequence, where all the
attention per device needs of it is the key padding.
"""

from __future__ import annotations

import dataclasses
import importlib
import math

# keras-hub's name for the method the attention per device replaces.
COMPUTE_ATTENTION_METHOD = "_compute_attention"


@dataclasses.dataclass(frozen=True)
class AttentionReading:
    """What one attention layer computes in `_compute_attention`.

    Args:
        scale: the factor on the scores (on the queries before the dot
            product, equivalently).
        soft_cap: `cap · tanh(score / cap)`, or `None`.
        window: keys `window` or more positions before their query are
            masked, or `None`.
        repeats: how many times each key/value head arrives repeated (1:
            once per key/value head).
        dropout: the dropout rate on the attention weights, while training.
        keyless_mean: a query with no key to attend gets the mean of every
            value (the layer calls `ops.dot_product_attention`), not zeros
            (it calls keras' `Softmax`, which zeroes masked weights).
    """

    scale: float
    soft_cap: float | None
    window: int | None
    repeats: int
    dropout: float
    keyless_mean: bool = False


def _gemma(layer) -> AttentionReading | None:
    if getattr(layer, "use_bidirectional_attention", False):
        return None  # embedding models: a two-sided window
    if layer.query_head_dim_normalize:
        scale = 1 / math.sqrt(layer.head_dim)
    else:
        scale = 1 / math.sqrt(layer.hidden_dim // layer.num_query_heads)
    window = layer.sliding_window_size if layer.use_sliding_window_attention else None
    return AttentionReading(scale, layer.logit_soft_cap, window, 1, layer.dropout)


def _takes_dot_product_attention(layer) -> bool:
    """Whether a layer calls `ops.dot_product_attention` where its module's
    `fused_attention_op_available()` says so, else keras' `Softmax`."""
    return importlib.import_module(
        type(layer).__module__
    ).fused_attention_op_available()


def _repeated_heads(layer) -> AttentionReading:
    """Llama, Phi-3 and SmolLM3: no window, no cap, no dropout inside."""
    groups = layer.num_key_value_groups
    mean = _takes_dot_product_attention(layer)
    return AttentionReading(layer._inv_norm_factor, None, None, groups, 0.0, mean)


def _mistral(layer) -> AttentionReading:
    groups, window = layer._num_key_value_groups, layer._sliding_window
    mean = _takes_dot_product_attention(layer)
    return AttentionReading(layer._inv_norm_factor, None, window, groups, 0.0, mean)


def _mixtral(layer) -> AttentionReading:
    groups, window = layer.num_key_value_groups, layer.sliding_window
    mean = layer._use_fused_attention_op()
    return AttentionReading(layer._inv_norm_factor, None, window, groups, 0.0, mean)


def _gemma4(layer) -> AttentionReading | None:
    if layer.use_bidirectional_attention:
        return None  # embedding models: a two-sided window
    # The decoder block masks the window on local layers (`is_global_attention`
    # false), and `call` zeroes a query with no key, whichever path it took.
    local = layer.use_sliding_window_attention and not layer.is_global_attention
    window = layer.sliding_window_size if local else None
    return AttentionReading(1.0, layer.logit_soft_cap, window, 1, layer.dropout)


def _qwen_reading(layer, window: int | None, mean: bool) -> AttentionReading:
    """A Qwen with `window` masked on keras' `Softmax` path, which it takes
    unless `mean` (it calls `ops.dot_product_attention`)."""
    window = None if mean else window
    groups = layer.num_key_value_groups
    return AttentionReading(layer._inv_norm_factor, None, window, groups, 0.0, mean)


def _qwen2(layer) -> AttentionReading:
    windowed = layer.use_sliding_window_attention
    window = layer.sliding_window_size if windowed else None
    return _qwen_reading(layer, window, _takes_dot_product_attention(layer))


def _qwen3(layer) -> AttentionReading:
    window = layer.sliding_window_size or None
    return _qwen_reading(layer, window, _takes_dot_product_attention(layer))


def _qwen_moe(layer) -> AttentionReading:
    windowed = layer.use_sliding_window_attention
    window = layer.sliding_window_size if windowed else None
    return _qwen_reading(layer, window, layer._use_fused_attention_op())


# keras-hub attention class (module, name) -> its reading.
_READINGS = {
    ("keras_hub.src.models.gemma.gemma_attention", "CachedGemmaAttention"): _gemma,
    ("keras_hub.src.models.gemma3.gemma3_attention", "CachedGemma3Attention"): _gemma,
    ("keras_hub.src.models.gemma4.gemma4_attention", "Gemma4TextAttention"): _gemma4,
    ("keras_hub.src.models.llama.llama_attention", "LlamaAttention"): _repeated_heads,
    ("keras_hub.src.models.mistral.mistral_attention", "CachedMistralAttention"): (
        _mistral
    ),
    ("keras_hub.src.models.mixtral.mixtral_attention", "CachedMixtralAttention"): (
        _mixtral
    ),
    ("keras_hub.src.models.phi3.phi3_attention", "Phi3Attention"): _repeated_heads,
    ("keras_hub.src.models.qwen.qwen_attention", "QwenAttention"): _qwen2,
    ("keras_hub.src.models.qwen3.qwen3_attention", "Qwen3Attention"): _qwen3,
    ("keras_hub.src.models.qwen_moe.qwen_moe_attention", "QwenMoeAttention"): (
        _qwen_moe
    ),
    ("keras_hub.src.models.qwen3_moe.qwen3_moe_attention", "Qwen3MoeAttention"): (
        _qwen3
    ),
    ("keras_hub.src.models.smollm3.smollm3_layers", "SmolLM3Attention"): (
        _repeated_heads
    ),
}


def attention_reading(layer) -> AttentionReading | None:
    """The rule of `layer`'s `_compute_attention`, or `None` when `layer` is
    not one of the attention layers known here (exact class: a subclass may
    compute otherwise)."""
    kind = type(layer)
    reading = _READINGS.get((kind.__module__, kind.__name__))
    return None if reading is None else reading(layer)


# The attributes keras-hub's attention layers keep their number of query
# heads and their head dimension in, by family.
_QUERY_HEADS = ("num_query_heads", "_num_query_heads", "num_attention_heads")
_HEAD_DIM = ("head_dim", "_head_dim")


def _first_attribute(layer, names):
    for name in names:
        value = getattr(layer, name, None)
        if isinstance(value, int):
            return value
    # Imported here: the startup hook loads this package alone, without the
    # rest of keras_hub_autodist.
    from keras_hub_autodist.errors import UnsupportedArchitectureError

    raise UnsupportedArchitectureError(
        f"{type(layer).__name__} keeps none of the attributes {names}: this "
        "keras-hub version changed the layer. Load the model without "
        "device_mesh=, or install the keras-hub this package was tested "
        f"with. Received: {type(layer).__module__}.{type(layer).__name__}"
    )


def query_heads(layer) -> int:
    """The number of query heads of a known attention layer."""
    return _first_attribute(layer, _QUERY_HEADS)


def head_dim(layer) -> int:
    """The head dimension of a known attention layer."""
    return _first_attribute(layer, _HEAD_DIM)


def known_attention_classes() -> list[tuple[str, str]]:
    """The (module, class) of each attention layer with a known reading."""
    return list(_READINGS)


@dataclasses.dataclass(frozen=True)
class DecoderBlock:
    """How a keras-hub decoder block builds its attention layer's mask.

    Its `mask_method(sequence, padding_mask, *other_masks, cache,
    cache_update_index)` returns the `[batch, queries, keys]` mask: causal,
    key padding, and the other masks where given (a caller's own attention
    mask; Gemma 3's and Gemma 4's image tokens, which attend both ways).

    Args:
        mask_method: the name of that method.
        other_masks: how many other masks it takes.
        attention: the attribute that holds the block's attention layer.
        reduced_by_attention: whether the attention layer reduces the mask
            over its keys besides (Gemma's zero the output of a query with
            no key to attend).
        window_in_mask: whether the mask holds the attention layer's
            sliding window (Gemma 4's local layers); else the layer masks
            it itself.
    """

    mask_method: str
    other_masks: int
    attention: str
    reduced_by_attention: bool = False
    window_in_mask: bool = False


_GEMMA = DecoderBlock("_compute_attention_mask", 0, "attention", True)
_GEMMA3 = DecoderBlock("_compute_attention_mask", 1, "attention", True)
_GEMMA4 = DecoderBlock("_compute_attention_mask", 1, "attention", True, True)
_TRANSFORMER = DecoderBlock("_compute_self_attention_mask", 1, "_self_attention_layer")
# keras-hub decoder block class (module, name) -> how it builds its mask.
DECODER_BLOCKS = {
    ("keras_hub.src.models.gemma.gemma_decoder_block", "GemmaDecoderBlock"): _GEMMA,
    ("keras_hub.src.models.gemma3.gemma3_decoder_block", "Gemma3DecoderBlock"): (
        _GEMMA3
    ),
    ("keras_hub.src.models.gemma4.gemma4_decoder_block", "Gemma4TextDecoderBlock"): (
        _GEMMA4
    ),
    ("keras_hub.src.models.llama.llama_decoder", "LlamaTransformerDecoder"): (
        _TRANSFORMER
    ),
    (
        "keras_hub.src.models.mistral.mistral_transformer_decoder",
        "MistralTransformerDecoder",
    ): _TRANSFORMER,
    ("keras_hub.src.models.mixtral.mixtral_decoder", "MixtralTransformerDecoder"): (
        _TRANSFORMER
    ),
    ("keras_hub.src.models.phi3.phi3_decoder", "Phi3Decoder"): dataclasses.replace(
        _TRANSFORMER, attention="attention"
    ),
    ("keras_hub.src.models.qwen.qwen_decoder", "QwenTransformerDecoder"): (
        _TRANSFORMER
    ),
    ("keras_hub.src.models.qwen3.qwen3_decoder", "Qwen3TransformerDecoder"): (
        _TRANSFORMER
    ),
    ("keras_hub.src.models.qwen_moe.qwen_moe_decoder", "QwenMoeTransformerDecoder"): (
        _TRANSFORMER
    ),
    (
        "keras_hub.src.models.qwen3_moe.qwen3_moe_decoder",
        "Qwen3MoeTransformerDecoder",
    ): _TRANSFORMER,
    ("keras_hub.src.models.smollm3.smollm3_layers", "SmolLM3DecoderLayer"): (
        dataclasses.replace(_TRANSFORMER, attention="self_attn")
    ),
}


def decoder_block(layer) -> DecoderBlock | None:
    """How `layer` builds its attention mask, or `None` when it is not one
    of `DECODER_BLOCKS` (exact class: a subclass may build it otherwise)."""
    kind = type(layer)
    return DECODER_BLOCKS.get((kind.__module__, kind.__name__))


def block_attention_layer(block_layer, block: DecoderBlock):
    """The attention layer a decoder block's mask is built for."""
    return getattr(block_layer, block.attention, None)


def known_decoder_blocks() -> list[tuple[str, str]]:
    """The (module, class) of each decoder block in `DECODER_BLOCKS`."""
    return list(DECODER_BLOCKS)
