"""Gemma 1 and 2 (`GemmaBackbone`): kernels laid out `(heads, hidden, head_dim)`."""

from __future__ import annotations

from collections.abc import Mapping

from keras_hub_autodist.architectures.base import DECODER_CONFIG_FIELDS
from keras_hub_autodist.architectures.base import Architecture
from keras_hub_autodist.architectures.base import WeightSpec
from keras_hub_autodist.architectures.base import attention_rules
from keras_hub_autodist.architectures.base import gated_mlp_rules
from keras_hub_autodist.architectures.base import global_weight
from keras_hub_autodist.architectures.base import layer_weights
from keras_hub_autodist.architectures.base import rule_table

# The residual stream of a Gemma decoder block (Gemma 1, 2 and 3): its
# norms' outputs, the row-parallel attention output and down projection, and
# the final norm's. Not the block's own output: with a cache (generate) it is
# an `(x, cache)` tuple, and Keras would lay the cache out like `x`; the
# residual adds follow their sequence-sharded operands.
GEMMA_SEQUENCE_PARALLEL_OUTPUTS = (
    r"decoder_block_\d+/(pre|post)_(attention|ffw)_norm/output",
    r"decoder_block_\d+/attention/attention_output/output",
    r"decoder_block_\d+/ffw_linear/output",
    "final_normalization/output",
)


# Gemma 1, 2 and 3: kernels laid out (heads, hidden, head_dim); Gemma 3's
# query/key norms are over head_dim.
_BLOCK = r"decoder_block_\d+/"
GEMMA_RULES = rule_table(
    ("token_embedding/embeddings", ("vocab", "embed")),
    *attention_rules(_BLOCK + "attention", "heads_first"),
    *gated_mlp_rules(_BLOCK + "ffw_gating(_2)?/kernel", _BLOCK + "ffw_linear/kernel"),
    (_BLOCK + "(pre|post)_(attention|ffw)_norm/scale", ("norm",)),
    (_BLOCK + "attention/(query|key)_norm/scale", ("norm",)),
    ("final_normalization/scale", ("norm",)),
)


def gemma_attention_entries(config: Mapping) -> list:
    """Query/key/value/output kernels of a Gemma-style attention block."""
    d = config["hidden_dim"]
    h = config["num_query_heads"]
    kv = config["num_key_value_heads"]
    hd = config["head_dim"]
    return [
        ("attention/query/kernel", (h, d, hd), ("heads", "embed", "head_dim")),
        ("attention/key/kernel", (kv, d, hd), ("kv_heads", "embed", "head_dim")),
        ("attention/value/kernel", (kv, d, hd), ("kv_heads", "embed", "head_dim")),
        (
            "attention/attention_output/kernel",
            (h, hd, d),
            ("heads", "head_dim", "embed"),
        ),
    ]


def gemma_block_entries(config: Mapping, ffw_dim: int) -> list:
    """Norms, attention and gated MLP of one Gemma decoder block."""
    d = config["hidden_dim"]
    norms = [("pre_attention_norm/scale", (d,), ("norm",))]
    if config.get("use_post_attention_norm", False):
        norms.append(("post_attention_norm/scale", (d,), ("norm",)))
    norms.append(("pre_ffw_norm/scale", (d,), ("norm",)))
    if config.get("use_post_ffw_norm", False):
        norms.append(("post_ffw_norm/scale", (d,), ("norm",)))
    mlp = [
        ("ffw_gating/kernel", (d, ffw_dim), ("embed", "mlp")),
        ("ffw_gating_2/kernel", (d, ffw_dim), ("embed", "mlp")),
        ("ffw_linear/kernel", (ffw_dim, d), ("mlp", "embed")),
    ]
    return norms + gemma_attention_entries(config) + mlp


def gemma_global_weights(config: Mapping) -> list[WeightSpec]:
    """The tied token embedding and the final norm."""
    v, d = config["vocabulary_size"], config["hidden_dim"]
    return [
        global_weight("token_embedding/embeddings", (v, d), ("vocab", "embed")),
        global_weight("final_normalization/scale", (d,), ("norm",)),
    ]


class GemmaArchitecture(Architecture):
    """Weights of `GemmaBackbone` (Gemma 1 and Gemma 2).

    Gemma's gated MLP halves `intermediate_dim`: each of `ffw_gating`,
    `ffw_gating_2` has `intermediate_dim // 2` columns.

    Example:
    >>> config = dict(vocabulary_size=64, num_layers=1, num_query_heads=4,
    ...     num_key_value_heads=1, hidden_dim=16, intermediate_dim=32, head_dim=8)
    >>> weights = GEMMA.shape_hints(config)
    >>> next(w.shape for w in weights if w.path.endswith("key/kernel"))
    (1, 16, 8)
    """

    name = "gemma"
    rules = GEMMA_RULES
    config_fields = DECODER_CONFIG_FIELDS
    sequence_parallel_outputs = GEMMA_SEQUENCE_PARALLEL_OUTPUTS

    def shape_hints(self, config: Mapping) -> list[WeightSpec]:
        entries = gemma_block_entries(config, config["intermediate_dim"] // 2)
        return gemma_global_weights(config) + layer_weights(
            "decoder_block_", config["num_layers"], entries
        )


GEMMA = GemmaArchitecture()
