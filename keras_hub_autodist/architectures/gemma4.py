"""Gemma 4, dense text models (`Gemma4Backbone` without experts, vision or
audio towers): Gemma's `(heads, hidden, head_dim)` kernels.

Global-attention layers may have their own head size (`global_head_dim`)
and key/value head count (`num_global_key_value_heads`, with the value
projection shared with the key's); the same rules cover them, the shapes
come from the model. Key/value-sharing layers (`num_kv_shared_layers`) have
no key/value kernels. The small models add per-layer inputs: a second
embedding of width `num_layers * hidden_size_per_layer_input`, its projection
from the hidden state, and each block's gate/up projections; those narrow
dimensions are left to the batch axis under "fsdp".
"""

from __future__ import annotations

from keras_hub_autodist.architectures.base import DECODER_CONFIG_FIELDS
from keras_hub_autodist.architectures.base import Architecture
from keras_hub_autodist.architectures.base import attention_rules
from keras_hub_autodist.architectures.base import gated_mlp_rules
from keras_hub_autodist.architectures.base import rule_table

_BLOCK = r"decoder_block_\d+"

GEMMA4_CONFIG_FIELDS = {
    **DECODER_CONFIG_FIELDS,
    "expert": "num_experts",
    "expert_mlp": "expert_intermediate_dim",
}

_NORMS = (
    rf"{_BLOCK}/((pre|post)_(attention|ffw)_norm|post_per_layer_input_norm)",
    rf"{_BLOCK}/(pre_ffw_norm_moe|post_ffw_norm_dense|post_ffw_norm_moe_path)",
    rf"{_BLOCK}/attention/(query|key)_norm",
    "per_layer_projection_norm",
    "final_normalization",
)

GEMMA4 = Architecture(
    name="gemma4",
    rules=rule_table(
        ("(per_layer_)?token_embedding/embeddings", ("vocab", "embed")),
        ("per_layer_model_projection/kernel", ("embed", "unsharded")),
        *attention_rules(rf"{_BLOCK}/attention", "heads_first"),
        *gated_mlp_rules(
            rf"{_BLOCK}/ffw_gating(_2)?/kernel", rf"{_BLOCK}/ffw_linear/kernel"
        ),
        (rf"{_BLOCK}/per_layer_input_gate/kernel", ("embed", "unsharded")),
        (rf"{_BLOCK}/per_layer_up_proj/kernel", ("unsharded", "embed")),
        (rf"{_BLOCK}/layer_scalar", ()),
        # The optional mixture of experts beside the dense MLP.
        (rf"{_BLOCK}/moe_router/proj/kernel", ("embed", "unsharded")),
        (rf"{_BLOCK}/moe_expert_bank/(gate|up)_proj", ("expert", "embed", "mlp")),
        (rf"{_BLOCK}/moe_expert_bank/down_proj", ("expert", "mlp", "embed")),
        (
            f"({'|'.join(_NORMS)})/scale"
            rf"|{_BLOCK}/moe_router/per_dim_scale"
            rf"|{_BLOCK}/moe_expert_bank/per_expert_scale",
            ("norm",),
        ),
    ),
    config_fields=GEMMA4_CONFIG_FIELDS,
)
