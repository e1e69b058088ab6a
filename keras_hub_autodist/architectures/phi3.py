"""Phi-3 (`Phi3Backbone`): Llama-style `(hidden, heads, head_dim)` kernels
under `attention/`, pre/post-attention norms, always untied embeddings.

Phi-3's rotary scaling ("su"/"longrope") has no variables.
"""

from __future__ import annotations

from keras_hub_autodist.architectures.base import DECODER_CONFIG_FIELDS
from keras_hub_autodist.architectures.base import EMBEDDING_RULES
from keras_hub_autodist.architectures.base import Architecture
from keras_hub_autodist.architectures.base import attention_rules
from keras_hub_autodist.architectures.base import gated_mlp_rules
from keras_hub_autodist.architectures.base import rule_table

_LAYER = r"transformer_layer_\d+"

# The residual stream of a decoder layer: its norms' outputs, the
# row-parallel attention output and down projection with their dropouts, and
# the final norm's. Not the layer's own output: with a cache (generate) it is
# an `(x, cache)` tuple.
PHI3_SEQUENCE_PARALLEL_OUTPUTS = (
    rf"{_LAYER}/(pre|post)_attention_layernorm/output",
    rf"{_LAYER}/attention/attention_output/output",
    rf"{_LAYER}/(attention|feedforward)_dropout/output",
    rf"{_LAYER}/feedforward_output_dense/output",
    "sequence_output_layernorm/output",
)

PHI3 = Architecture(
    name="phi3",
    rules=rule_table(
        *EMBEDDING_RULES,
        *attention_rules(rf"{_LAYER}/attention"),
        *gated_mlp_rules(
            rf"{_LAYER}/feedforward_(intermediate|gate)_dense/kernel",
            rf"{_LAYER}/feedforward_output_dense/kernel",
        ),
        (
            rf"({_LAYER}/(pre|post)_attention_layernorm"
            r"|sequence_output_layernorm)/scale",
            ("norm",),
        ),
    ),
    config_fields=DECODER_CONFIG_FIELDS,
    sequence_parallel_outputs=PHI3_SEQUENCE_PARALLEL_OUTPUTS,
)
