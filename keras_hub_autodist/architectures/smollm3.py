"""SmolLM3 (`SmolLM3Backbone`): Hugging Face-style layer names, flat
`Dense` query/key/value kernels, tied embeddings.

The query/key/value kernels are `(hidden, heads * head_dim)`: their one
output dimension carries the `heads` (or `kv_heads`) logical axis, and is
split over the model axis when `heads * head_dim` divides it. keras-hub 0.32
builds each layer's `o_proj` and rotary `inv_freq` in the attention layer's
constructor, outside the layer's name scope: their paths are `o_proj/kernel`
and `rotary_emb/inv_freq` in every layer (the rules also accept the scoped
paths, should keras-hub scope them). `inv_freq` is a non-trainable constant.
"""

from __future__ import annotations

from keras_hub_autodist.architectures.base import DECODER_CONFIG_FIELDS
from keras_hub_autodist.architectures.base import Architecture
from keras_hub_autodist.architectures.base import rule_table

_LAYER = r"transformer_layer_\d+"
_ATTENTION = rf"{_LAYER}/self_attn"

SMOLLM3_CONFIG_FIELDS = {**DECODER_CONFIG_FIELDS, "heads": "num_attention_heads"}

# The residual stream of a decoder layer: its norms' outputs, the
# row-parallel attention output and down projection, and the final norm's.
# Not the layer's own output: with a cache (generate) it is an
# `(x, cache)` tuple.
SMOLLM3_SEQUENCE_PARALLEL_OUTPUTS = (
    rf"{_LAYER}/(input|post_attention)_layernorm/output",
    rf"{_ATTENTION}/o_proj/output",
    rf"{_LAYER}/mlp/down_proj/output",
    "sequence_output_layernorm/output",
)

SMOLLM3 = Architecture(
    name="smollm3",
    rules=rule_table(
        ("token_embedding/embeddings", ("vocab", "embed")),
        (rf"{_ATTENTION}/q_proj/kernel", ("embed", "heads")),
        (rf"{_ATTENTION}/(k|v)_proj/kernel", ("embed", "kv_heads")),
        (rf"{_ATTENTION}/q_proj/bias", ("heads",)),
        (rf"{_ATTENTION}/(k|v)_proj/bias", ("kv_heads",)),
        (rf"({_ATTENTION}/)?o_proj/kernel", ("heads", "head_dim", "embed")),
        (rf"({_ATTENTION}/)?rotary_emb/inv_freq", ("unsharded",)),
        (rf"{_LAYER}/mlp/(gate|up)_proj/kernel", ("embed", "mlp")),
        (rf"{_LAYER}/mlp/(gate|up)_proj/bias", ("mlp",)),
        (rf"{_LAYER}/mlp/down_proj/kernel", ("mlp", "embed")),
        (rf"{_LAYER}/mlp/down_proj/bias", ("embed",)),
        (
            rf"({_LAYER}/(input|post_attention)_layernorm"
            r"|sequence_output_layernorm)/scale",
            ("norm",),
        ),
    ),
    config_fields=SMOLLM3_CONFIG_FIELDS,
    sequence_parallel_outputs=SMOLLM3_SEQUENCE_PARALLEL_OUTPUTS,
)
