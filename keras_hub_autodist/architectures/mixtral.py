"""Mixtral (`MixtralBackbone`): Mistral's attention with a sparse mixture of
experts in place of each MLP.

keras-hub stores each layer's experts as three 3D kernels
`(num_experts, hidden_dim, intermediate_dim)` (gate, intermediate) and
`(num_experts, intermediate_dim, hidden_dim)` (output), inside a block it
names from a process-wide counter (`mixtral_sparse_moe_block`,
`mixtral_sparse_moe_block_1`, ...; the second model built in a process starts
where the first stopped), so the patterns accept any suffix. The router
(`sparse_feedforward_gate_dense`, `(hidden_dim, num_experts)`) is replicated
over the model axis.
"""

from __future__ import annotations

from keras_hub_autodist.architectures.base import DECODER_CONFIG_FIELDS
from keras_hub_autodist.architectures.base import EMBEDDING_RULES
from keras_hub_autodist.architectures.base import Architecture
from keras_hub_autodist.architectures.base import attention_rules
from keras_hub_autodist.architectures.base import rule_table
from keras_hub_autodist.architectures.llama import LLAMA_SEQUENCE_PARALLEL_OUTPUTS

# keras-hub names the MoE block of each layer from a process-wide counter.
MOE_BLOCK = r"transformer_layer_\d+/mixtral_sparse_moe_block(_\d+)?"

MIXTRAL_CONFIG_FIELDS = {**DECODER_CONFIG_FIELDS, "expert": "num_experts"}

MIXTRAL = Architecture(
    name="mixtral",
    rules=rule_table(
        *EMBEDDING_RULES,
        *attention_rules(r"transformer_layer_\d+/self_attention"),
        (MOE_BLOCK + "/sparse_feedforward_gate_dense/kernel", ("embed", "unsharded")),
        (
            MOE_BLOCK + "/experts/expert_feedforward_(gate|intermediate)_dense",
            ("expert", "embed", "mlp"),
        ),
        (
            MOE_BLOCK + "/experts/expert_feedforward_output_dense",
            ("expert", "mlp", "embed"),
        ),
        (
            r"transformer_layer_\d+/(self_attention|feedforward)_layernorm/scale"
            r"|sequence_output_layernorm/scale",
            ("norm",),
        ),
    ),
    config_fields=MIXTRAL_CONFIG_FIELDS,
    # The MoE block returns (output, router logits): not pinned.
    sequence_parallel_outputs=LLAMA_SEQUENCE_PARALLEL_OUTPUTS,
)
