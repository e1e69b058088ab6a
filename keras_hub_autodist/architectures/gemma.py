"""Gemma 1 and 2 (`GemmaBackbone`): kernels laid out `(heads, hidden, head_dim)`."""

from __future__ import annotations

from keras_hub_autodist.architectures.base import DECODER_CONFIG_FIELDS
from keras_hub_autodist.architectures.base import Architecture
from keras_hub_autodist.architectures.base import attention_rules
from keras_hub_autodist.architectures.base import gated_mlp_rules
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


class GemmaArchitecture(Architecture):
    """Weights of `GemmaBackbone` (Gemma 1 and Gemma 2).

    Gemma's gated MLP halves `intermediate_dim`: each of `ffw_gating`,
    `ffw_gating_2` has `intermediate_dim // 2` columns.

    Example:
    >>> [rule.axes for rule in GEMMA.matching_rules(
    ...     "decoder_block_0/attention/key/kernel")]
    [('kv_heads', 'embed', 'head_dim')]
    """

    name = "gemma"
    rules = GEMMA_RULES
    config_fields = DECODER_CONFIG_FIELDS
    sequence_parallel_outputs = GEMMA_SEQUENCE_PARALLEL_OUTPUTS


GEMMA = GemmaArchitecture()
