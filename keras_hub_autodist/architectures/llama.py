"""Llama 2/3 (`LlamaBackbone`, `Llama3Backbone`) and Mistral (`MistralBackbone`).

Kernels are laid out `(hidden, heads, head_dim)`; untied models carry a
`reverse_embeddings` of shape `(hidden, vocab)`.
"""

from __future__ import annotations

from keras_hub_autodist.architectures.base import DECODER_CONFIG_FIELDS
from keras_hub_autodist.architectures.base import EMBEDDING_RULES
from keras_hub_autodist.architectures.base import Architecture
from keras_hub_autodist.architectures.base import attention_rules
from keras_hub_autodist.architectures.base import gated_mlp_rules
from keras_hub_autodist.architectures.base import rule_table

# The residual stream of a Llama/Mistral decoder layer: its norms' outputs,
# the row-parallel attention output (and its dropout) and down projection,
# and the final norm's. Not the layer's own output: with a cache (generate)
# it is an `(x, cache)` tuple, and Keras would lay the cache out like `x`.
LLAMA_SEQUENCE_PARALLEL_OUTPUTS = (
    r"transformer_layer_\d+/(self_attention|feedforward)_layernorm/output",
    r"transformer_layer_\d+/self_attention/attention_output/output",
    r"transformer_layer_\d+/self_attention_dropout/output",
    r"transformer_layer_\d+/feedforward_output_dense/output",
    "sequence_output_layernorm/output",
)


# Llama 2/3 and Mistral: kernels laid out (hidden, heads, head_dim); untied
# models add `reverse_embeddings` (hidden, vocab).
_LAYER = r"transformer_layer_\d+/"
LLAMA_RULES = rule_table(
    *EMBEDDING_RULES,
    *attention_rules(_LAYER + "self_attention"),
    *gated_mlp_rules(
        _LAYER + "feedforward_(intermediate|gate)_dense/kernel",
        _LAYER + "feedforward_output_dense/kernel",
    ),
    (_LAYER + "(self_attention|feedforward)_layernorm/scale", ("norm",)),
    ("sequence_output_layernorm/scale", ("norm",)),
)


# Llama (`LlamaBackbone` and subclasses such as `Llama3Backbone`) and Mistral
# share one table; Mistral always has its own output projection, Llama when
# `tie_word_embeddings` is off.
LLAMA = Architecture(
    name="llama",
    rules=LLAMA_RULES,
    config_fields=DECODER_CONFIG_FIELDS,
    sequence_parallel_outputs=LLAMA_SEQUENCE_PARALLEL_OUTPUTS,
)
MISTRAL = Architecture(
    name="mistral",
    rules=LLAMA_RULES,
    config_fields=DECODER_CONFIG_FIELDS,
    sequence_parallel_outputs=LLAMA_SEQUENCE_PARALLEL_OUTPUTS,
)
