"""Qwen 2/2.5 (`QwenBackbone`, alias `Qwen2Backbone`) and Qwen 3
(`Qwen3Backbone`).

Both keep Llama's layer names and `(hidden, heads, head_dim)` kernels.
Qwen 2 adds biases to the query/key/value projections; Qwen 3 drops them and
normalizes each query/key head (`query_dense_layernorm`,
`key_dense_layernorm`, of shape `(head_dim,)`). Tied models have no
`reverse_embeddings`; the table covers both.
"""

from __future__ import annotations

from keras_hub_autodist.architectures.base import DECODER_CONFIG_FIELDS
from keras_hub_autodist.architectures.base import EMBEDDING_RULES
from keras_hub_autodist.architectures.base import Architecture
from keras_hub_autodist.architectures.base import attention_rules
from keras_hub_autodist.architectures.base import gated_mlp_rules
from keras_hub_autodist.architectures.base import rule_table

_LAYER = r"transformer_layer_\d+"

# The residual stream of a decoder layer (the names are Llama's): its norms'
# outputs, the row-parallel attention output (and its dropout) and down
# projection, and the final norm's. Not the layer's own output: with a cache
# (generate) it is an `(x, cache)` tuple.
QWEN_SEQUENCE_PARALLEL_OUTPUTS = (
    rf"{_LAYER}/(self_attention|feedforward)_layernorm/output",
    rf"{_LAYER}/self_attention/attention_output/output",
    rf"{_LAYER}/self_attention_dropout/output",
    rf"{_LAYER}/feedforward_output_dense/output",
    "sequence_output_layernorm/output",
)

_ATTENTION = rf"{_LAYER}/self_attention"
_QWEN_COMMON = (
    *EMBEDDING_RULES,
    *attention_rules(_ATTENTION),
    *gated_mlp_rules(
        rf"{_LAYER}/feedforward_(intermediate|gate)_dense/kernel",
        rf"{_LAYER}/feedforward_output_dense/kernel",
    ),
    (
        rf"({_LAYER}/(self_attention|feedforward)_layernorm"
        r"|sequence_output_layernorm)/scale",
        ("norm",),
    ),
)

QWEN = Architecture(
    name="qwen",
    rules=rule_table(
        *_QWEN_COMMON,
        (rf"{_ATTENTION}/query/bias", ("heads", "head_dim")),
        (rf"{_ATTENTION}/(key|value)/bias", ("kv_heads", "head_dim")),
    ),
    config_fields=DECODER_CONFIG_FIELDS,
    sequence_parallel_outputs=QWEN_SEQUENCE_PARALLEL_OUTPUTS,
)

QWEN3 = Architecture(
    name="qwen3",
    rules=rule_table(
        *_QWEN_COMMON,
        (rf"{_ATTENTION}/(query|key)_dense_layernorm/scale", ("norm",)),
    ),
    config_fields=DECODER_CONFIG_FIELDS,
    sequence_parallel_outputs=QWEN_SEQUENCE_PARALLEL_OUTPUTS,
)
