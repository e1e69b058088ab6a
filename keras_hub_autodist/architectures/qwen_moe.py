"""Qwen 1.5/2 MoE (`QwenMoeBackbone`) and Qwen 3 MoE (`Qwen3MoeBackbone`).

Each sparse layer has a router (`sparse_feedforward_gate_dense`,
`(hidden_dim, num_experts)`, replicated over the model axis) and a bank of
experts stored as two 3D kernels: a fused gate/up projection
`(num_experts, hidden_dim, 2 * moe_intermediate_dim)` and the output
projection `(num_experts, moe_intermediate_dim, hidden_dim)`. Qwen-MoE adds
an always-on shared expert (a gated MLP) and its scalar gate; Qwen 3 MoE
has query/key norms and no biases. Layers listed in `mlp_only_layers` hold
a dense gated MLP instead.

keras-hub names the sparse block and the dense MLP of each layer from
process-wide counters (`qwen_sparse_moe_block_3`, `qwen3_moe_mlp_1`, ...),
so the patterns accept any suffix.
"""

from __future__ import annotations

from keras_hub_autodist.architectures.base import DECODER_CONFIG_FIELDS
from keras_hub_autodist.architectures.base import EMBEDDING_RULES
from keras_hub_autodist.architectures.base import Architecture
from keras_hub_autodist.architectures.base import attention_rules
from keras_hub_autodist.architectures.base import gated_mlp_rules
from keras_hub_autodist.architectures.base import rule_table
from keras_hub_autodist.architectures.llama import LLAMA_SEQUENCE_PARALLEL_OUTPUTS

_LAYER = r"transformer_layer_\d+"
_ATTENTION = _LAYER + "/self_attention"
_NORMS = (
    _LAYER + r"/(self_attention|feedforward)_layernorm/scale"
    r"|sequence_output_layernorm/scale"
)

# Qwen-MoE and Qwen3-MoE alike.
QWEN_MOE_CONFIG_FIELDS = {
    **DECODER_CONFIG_FIELDS,
    "expert": "num_experts",
    "expert_mlp": "moe_intermediate_dim",
}


def _mlp_rules(mlp: str) -> tuple:
    """The rules of a gated MLP (a dense layer's, or Qwen-MoE's shared expert)."""
    return gated_mlp_rules(
        mlp + "/feedforward_(intermediate|gate)_dense/kernel",
        mlp + "/feedforward_output_dense/kernel",
    )


def _expert_rules(sparse_block: str) -> tuple:
    """The rules of a Qwen MoE sparse block's router and experts."""
    return (
        (
            sparse_block + "/sparse_feedforward_gate_dense/kernel",
            ("embed", "unsharded"),
        ),
        (
            sparse_block + "/experts/expert_feedforward_gate_dense",
            ("expert", "embed", "mlp"),
        ),
        (
            sparse_block + "/experts/expert_feedforward_output_dense",
            ("expert", "mlp", "embed"),
        ),
    )


_QWEN_SPARSE = _LAYER + r"/qwen_sparse_moe_block(_\d+)?"
QWEN_MOE = Architecture(
    name="qwen_moe",
    rules=rule_table(
        *EMBEDDING_RULES,
        *attention_rules(_ATTENTION),
        (_ATTENTION + "/query/bias", ("heads", "head_dim")),
        (_ATTENTION + "/(key|value)/bias", ("kv_heads", "head_dim")),
        *_expert_rules(_QWEN_SPARSE),
        # The shared expert and dense layers have their own rules: their MLP
        # widths differ, and so may their layouts.
        *_mlp_rules(_QWEN_SPARSE + "/shared_expert_dense"),
        *_mlp_rules(_LAYER + r"/qwen_moe_mlp(_\d+)?"),
        (_QWEN_SPARSE + "/shared_expert_gate_dense/kernel", ("embed", "unsharded")),
        (_NORMS, ("norm",)),
    ),
    config_fields=QWEN_MOE_CONFIG_FIELDS,
    # The MoE block returns (output, router logits): not pinned.
    sequence_parallel_outputs=LLAMA_SEQUENCE_PARALLEL_OUTPUTS,
)

QWEN3_MOE = Architecture(
    name="qwen3_moe",
    rules=rule_table(
        *EMBEDDING_RULES,
        *attention_rules(_ATTENTION),
        (_ATTENTION + "/(query|key)_dense_layernorm/scale", ("norm",)),
        *_expert_rules(_LAYER + r"/qwen3_sparse_moe_block(_\d+)?"),
        *_mlp_rules(_LAYER + r"/qwen3_moe_mlp(_\d+)?"),
        (_NORMS, ("norm",)),
    ),
    config_fields=QWEN_MOE_CONFIG_FIELDS,
    # The MoE block returns (output, router logits): not pinned.
    sequence_parallel_outputs=LLAMA_SEQUENCE_PARALLEL_OUTPUTS,
)
