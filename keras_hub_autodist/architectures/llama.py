"""Llama 2/3 (`LlamaBackbone`, `Llama3Backbone`) and Mistral (`MistralBackbone`).

Kernels are laid out `(hidden, heads, head_dim)`; untied models carry a
`reverse_embeddings` of shape `(hidden, vocab)`.
"""

from __future__ import annotations

from collections.abc import Mapping

from keras_hub_autodist.architectures.base import DECODER_CONFIG_FIELDS
from keras_hub_autodist.architectures.base import EMBEDDING_RULES
from keras_hub_autodist.architectures.base import Architecture
from keras_hub_autodist.architectures.base import WeightSpec
from keras_hub_autodist.architectures.base import attention_rules
from keras_hub_autodist.architectures.base import gated_mlp_rules
from keras_hub_autodist.architectures.base import global_weight
from keras_hub_autodist.architectures.base import layer_weights
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


class LlamaArchitecture(Architecture):
    """Weights of `LlamaBackbone` and its subclasses (`Llama3Backbone`).

    Args:
        always_untied: the backbone always has a separate output projection
            (Mistral), whatever `tie_word_embeddings` says.

    Example:
    >>> config = dict(vocabulary_size=64, num_layers=1, num_query_heads=4,
    ...     num_key_value_heads=2, hidden_dim=16, intermediate_dim=32)
    >>> LLAMA.shape_hints(config)[1].path
    'token_embedding/reverse_embeddings'
    """

    name = "llama"
    rules = LLAMA_RULES
    config_fields = DECODER_CONFIG_FIELDS
    sequence_parallel_outputs = LLAMA_SEQUENCE_PARALLEL_OUTPUTS

    def __init__(self, *, always_untied: bool = False, name: str | None = None):
        super().__init__(name=name)
        self.always_untied = always_untied

    def shape_hints(self, config: Mapping) -> list[WeightSpec]:
        v = config["vocabulary_size"]
        d = config["hidden_dim"]
        h = config["num_query_heads"]
        kv = config["num_key_value_heads"]
        hd = config.get("head_dim") or d // h
        f = config["intermediate_dim"]
        tied = config.get("tie_word_embeddings", False) and not self.always_untied
        globals_ = [
            global_weight("token_embedding/embeddings", (v, d), ("vocab", "embed"))
        ]
        if not tied:
            globals_.append(
                global_weight(
                    "token_embedding/reverse_embeddings", (d, v), ("embed", "vocab")
                )
            )
        globals_.append(
            global_weight("sequence_output_layernorm/scale", (d,), ("norm",))
        )
        entries = [
            ("self_attention/query/kernel", (d, h, hd), ("embed", "heads", "head_dim")),
            (
                "self_attention/key/kernel",
                (d, kv, hd),
                ("embed", "kv_heads", "head_dim"),
            ),
            (
                "self_attention/value/kernel",
                (d, kv, hd),
                ("embed", "kv_heads", "head_dim"),
            ),
            (
                "self_attention/attention_output/kernel",
                (h, hd, d),
                ("heads", "head_dim", "embed"),
            ),
            ("self_attention_layernorm/scale", (d,), ("norm",)),
            ("feedforward_intermediate_dense/kernel", (d, f), ("embed", "mlp")),
            ("feedforward_gate_dense/kernel", (d, f), ("embed", "mlp")),
            ("feedforward_output_dense/kernel", (f, d), ("mlp", "embed")),
            ("feedforward_layernorm/scale", (d,), ("norm",)),
        ]
        return globals_ + layer_weights(
            "transformer_layer_", config["num_layers"], entries
        )


LLAMA = LlamaArchitecture()
MISTRAL = LlamaArchitecture(always_untied=True, name="mistral")
