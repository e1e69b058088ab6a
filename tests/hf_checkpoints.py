"""Tiny Hugging Face transformers checkpoints written by hand (no network).

Each writer makes a folder with `config.json` (with `model_type`) and a
`model.safetensors` of random weights under the transformers names and
shapes (`nn.Linear` weights are `(out, in)`), which keras-hub's converters
load.
"""

from __future__ import annotations

import json
import os

import numpy as np
from safetensors.numpy import save_file

V, L, D, H, HD, F = 64, 2, 32, 4, 8, 48


def _write(path, config, tensors):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    rng = np.random.default_rng(0)
    arrays = {
        # A shape gets random weights; an array is written as is.
        name: shape.astype("float32")
        if isinstance(shape, np.ndarray)
        else (rng.standard_normal(shape) * 0.05).astype("float32")
        for name, shape in tensors.items()
    }
    save_file(arrays, os.path.join(path, "model.safetensors"))
    return str(path)


def _decoder(prefix, kv_heads, norms, extra=()):
    tensors = {}
    for i in range(L):
        p = f"{prefix}layers.{i}."
        tensors.update(
            {
                p + "self_attn.q_proj.weight": (H * HD, D),
                p + "self_attn.k_proj.weight": (kv_heads * HD, D),
                p + "self_attn.v_proj.weight": (kv_heads * HD, D),
                p + "self_attn.o_proj.weight": (D, H * HD),
                p + "mlp.gate_proj.weight": (F, D),
                p + "mlp.up_proj.weight": (F, D),
                p + "mlp.down_proj.weight": (D, F),
            }
        )
        for norm in norms:
            tensors[p + norm + ".weight"] = (D,)
        for name, shape in extra:
            tensors[p + name] = shape
    tensors[prefix + "embed_tokens.weight"] = (V, D)
    tensors[prefix + "norm.weight"] = (D,)
    return tensors


def _common(model_type, kv_heads):
    return {
        "model_type": model_type,
        "vocab_size": V,
        "num_hidden_layers": L,
        "num_attention_heads": H,
        "num_key_value_heads": kv_heads,
        "hidden_size": D,
        "intermediate_size": F,
        "head_dim": HD,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 128,
        "torch_dtype": "float32",
    }


def gemma(path):
    """Gemma 1 with multi-query attention (one key/value head)."""
    config = _common("gemma", 1) | {"architectures": ["GemmaForCausalLM"]}
    norms = ["input_layernorm", "post_attention_layernorm"]
    return _write(path, config, _decoder("model.", 1, norms))


def gemma2(path):
    """Gemma 2 with GQA, soft caps and a sliding window."""
    config = _common("gemma2", 2) | {
        "architectures": ["Gemma2ForCausalLM"],
        "query_pre_attn_scalar": HD,
        "final_logit_softcapping": 30.0,
        "attn_logit_softcapping": 50.0,
        "sliding_window": 4,
    }
    norms = [
        "input_layernorm",
        "post_attention_layernorm",
        "pre_feedforward_layernorm",
        "post_feedforward_layernorm",
    ]
    return _write(path, config, _decoder("model.", 2, norms))


def gemma3_text(path):
    """Gemma 3 text with one key/value head and query/key norms."""
    config = _common("gemma3_text", 1) | {
        "architectures": ["Gemma3ForCausalLM"],
        "query_pre_attn_scalar": HD,
        "sliding_window": 4,
        "layer_types": ["sliding_attention", "full_attention"],
    }
    norms = [
        "input_layernorm",
        "post_attention_layernorm",
        "pre_feedforward_layernorm",
        "post_feedforward_layernorm",
    ]
    extra = [("self_attn.q_norm.weight", (HD,)), ("self_attn.k_norm.weight", (HD,))]
    return _write(path, config, _decoder("model.", 1, norms, extra))


def llama3(path):
    """Llama 3 with GQA and an untied output embedding."""
    config = _common("llama", 2) | {
        "architectures": ["LlamaForCausalLM"],
        "tie_word_embeddings": False,
    }
    tensors = _decoder("model.", 2, ["input_layernorm", "post_attention_layernorm"])
    tensors["lm_head.weight"] = (V, D)
    return _write(path, config, tensors)


WRITERS = {
    "gemma": gemma,
    "gemma2": gemma2,
    "gemma3_text": gemma3_text,
    "llama3": llama3,
}


E = 6  # experts: does not divide a model axis of 4 or 8


def mixtral(path, num_experts=E):
    """Mixtral: GQA attention and a sparse MoE of `num_experts` experts."""
    config = _common("mixtral", 2) | {
        "architectures": ["MixtralForCausalLM"],
        "num_local_experts": num_experts,
        "num_experts_per_tok": 2,
        "sliding_window": None,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.02,
        "tie_word_embeddings": False,
    }
    tensors = {}
    for i in range(L):
        p = f"model.layers.{i}."
        tensors.update(
            {
                p + "self_attn.q_proj.weight": (H * HD, D),
                p + "self_attn.k_proj.weight": (2 * HD, D),
                p + "self_attn.v_proj.weight": (2 * HD, D),
                p + "self_attn.o_proj.weight": (D, H * HD),
                p + "block_sparse_moe.gate.weight": (num_experts, D),
                p + "input_layernorm.weight": (D,),
                p + "post_attention_layernorm.weight": (D,),
            }
        )
        for e in range(num_experts):
            expert = f"{p}block_sparse_moe.experts.{e}."
            tensors[expert + "w1.weight"] = (F, D)
            tensors[expert + "w3.weight"] = (F, D)
            tensors[expert + "w2.weight"] = (D, F)
    return _write(path, config, tensors | _untied_globals())


MOE_F, SHARED_F = 16, 24


def _untied_globals():
    """The embedding, final norm and separate output projection."""
    return {
        "model.embed_tokens.weight": (V, D),
        "model.norm.weight": (D,),
        "lm_head.weight": (V, D),
    }


def _qwen_experts(prefix, num_experts):
    """A Qwen MoE layer's experts (`mlp.experts.<e>.*_proj`)."""
    tensors = {}
    for e in range(num_experts):
        expert = f"{prefix}mlp.experts.{e}."
        tensors[expert + "gate_proj.weight"] = (MOE_F, D)
        tensors[expert + "up_proj.weight"] = (MOE_F, D)
        tensors[expert + "down_proj.weight"] = (D, MOE_F)
    return tensors


def qwen2_moe(path, num_experts=E):
    """Qwen 1.5/2 MoE: biased q/k/v, `num_experts` experts and a shared expert."""
    config = _common("qwen2_moe", 2) | {
        "architectures": ["Qwen2MoeForCausalLM"],
        "moe_intermediate_size": MOE_F,
        "shared_expert_intermediate_size": SHARED_F,
        "num_experts": num_experts,
        "num_experts_per_tok": 2,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "use_sliding_window": False,
        "sliding_window": 32,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "tie_word_embeddings": False,
    }
    tensors = {}
    for i in range(L):
        p = f"model.layers.{i}."
        tensors.update(
            {
                p + "self_attn.q_proj.weight": (H * HD, D),
                p + "self_attn.q_proj.bias": (H * HD,),
                p + "self_attn.k_proj.weight": (2 * HD, D),
                p + "self_attn.k_proj.bias": (2 * HD,),
                p + "self_attn.v_proj.weight": (2 * HD, D),
                p + "self_attn.v_proj.bias": (2 * HD,),
                p + "self_attn.o_proj.weight": (D, H * HD),
                p + "mlp.gate.weight": (num_experts, D),
                p + "mlp.shared_expert.gate_proj.weight": (SHARED_F, D),
                p + "mlp.shared_expert.up_proj.weight": (SHARED_F, D),
                p + "mlp.shared_expert.down_proj.weight": (D, SHARED_F),
                p + "mlp.shared_expert_gate.weight": (1, D),
                p + "input_layernorm.weight": (D,),
                p + "post_attention_layernorm.weight": (D,),
            }
        )
        tensors.update(_qwen_experts(p, num_experts))
    return _write(path, config, tensors | _untied_globals())


def qwen3_moe(path, num_experts=E):
    """Qwen3-MoE: per-head query/key norms, `num_experts` experts, no biases
    and no shared expert."""
    config = _common("qwen3_moe", 2) | {
        "architectures": ["Qwen3MoeForCausalLM"],
        "head_dim": HD,
        "moe_intermediate_size": MOE_F,
        "num_experts": num_experts,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "sliding_window": None,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "tie_word_embeddings": False,
    }
    tensors = {}
    for i in range(L):
        p = f"model.layers.{i}."
        tensors.update(
            {
                p + "self_attn.q_proj.weight": (H * HD, D),
                p + "self_attn.q_norm.weight": (HD,),
                p + "self_attn.k_proj.weight": (2 * HD, D),
                p + "self_attn.k_norm.weight": (HD,),
                p + "self_attn.v_proj.weight": (2 * HD, D),
                p + "self_attn.o_proj.weight": (D, H * HD),
                p + "mlp.gate.weight": (num_experts, D),
                p + "input_layernorm.weight": (D,),
                p + "post_attention_layernorm.weight": (D,),
            }
        )
        tensors.update(_qwen_experts(p, num_experts))
    return _write(path, config, tensors | _untied_globals())


# Mixtures of experts, kept apart from `WRITERS` (the dense families).
MOE_WRITERS = {"mixtral": mixtral, "qwen2_moe": qwen2_moe, "qwen3_moe": qwen3_moe}


def qwen2(path):
    """Qwen 2 with query/key/value biases and an untied output embedding."""
    config = _common("qwen2", 2) | {
        "architectures": ["Qwen2ForCausalLM"],
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "sliding_window": 32,
    }
    extra = [
        ("self_attn.q_proj.bias", (H * HD,)),
        ("self_attn.k_proj.bias", (2 * HD,)),
        ("self_attn.v_proj.bias", (2 * HD,)),
    ]
    norms = ["input_layernorm", "post_attention_layernorm"]
    tensors = _decoder("model.", 2, norms, extra)
    tensors["lm_head.weight"] = (V, D)
    return _write(path, config, tensors)


def qwen3(path):
    """Qwen 3 with query/key norms and a tied output embedding."""
    config = _common("qwen3", 2) | {
        "architectures": ["Qwen3ForCausalLM"],
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "sliding_window": None,
    }
    extra = [("self_attn.q_norm.weight", (HD,)), ("self_attn.k_norm.weight", (HD,))]
    norms = ["input_layernorm", "post_attention_layernorm"]
    return _write(path, config, _decoder("model.", 2, norms, extra))


def smollm3(path):
    """SmolLM3 with one key/value head and rotary embeddings on layer 0 only."""
    config = _common("smollm3", 1) | {
        "architectures": ["SmolLM3ForCausalLM"],
        "tie_word_embeddings": True,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "no_rope_layers": [1, 0],
        "layer_types": ["full_attention", "full_attention"],
    }
    norms = ["input_layernorm", "post_attention_layernorm"]
    return _write(path, config, _decoder("model.", 1, norms))


# Gemma 4: three layers (local, global, local) whose last shares the first's
# keys and values; the global layer has its own head size and one key head
# whose projection is also the value's (no `v_proj`).
G4_LAYERS, G4_GLOBAL_HD, G4_PER_LAYER = 3, 16, 4


def gemma4(path, per_layer_inputs=False, num_experts=0):
    """Gemma 4 text (`model_type="gemma4_text"`, no vision or audio tower).

    `per_layer_inputs=True` adds the small models' per-layer input embeddings
    (and their double-wide MLP on the key/value-sharing layer);
    `num_experts` adds a mixture of experts beside each layer's dense MLP.
    """
    layer_types = ["sliding_attention", "full_attention", "sliding_attention"]
    config = {
        "model_type": "gemma4_text",
        "architectures": ["Gemma4ForCausalLM"],
        "vocab_size": V,
        "num_hidden_layers": G4_LAYERS,
        "num_attention_heads": H,
        "num_key_value_heads": 2,
        "num_global_key_value_heads": 1,
        "hidden_size": D,
        "intermediate_size": F,
        "head_dim": HD,
        "global_head_dim": G4_GLOBAL_HD,
        "layer_types": layer_types,
        "sliding_window": 4,
        "num_kv_shared_layers": 1,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "full_attention": {"rope_theta": 1e6, "partial_rotary_factor": 0.25},
            "sliding_attention": {"rope_theta": 1e4},
        },
        "final_logit_softcapping": 30.0,
        "max_position_embeddings": 128,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "hidden_size_per_layer_input": G4_PER_LAYER if per_layer_inputs else 0,
        "vocab_size_per_layer_input": V,
        "use_double_wide_mlp": per_layer_inputs,
        "enable_moe_block": bool(num_experts),
    }
    if num_experts:
        config |= {
            "num_experts": num_experts,
            "moe_intermediate_size": MOE_F,
            "top_k_experts": 2,
        }
    tensors = {}
    for i, layer_type in enumerate(layer_types):
        p = f"model.layers.{i}."
        is_global = layer_type == "full_attention"
        head_dim = G4_GLOBAL_HD if is_global else HD
        kv_shared = i == G4_LAYERS - 1
        mlp = 2 * F if per_layer_inputs and kv_shared else F
        for norm in (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        ):
            tensors[p + norm + ".weight"] = (D,)
        tensors |= {
            p + "self_attn.q_proj.weight": (H * head_dim, D),
            p + "self_attn.q_norm.weight": (head_dim,),
            p + "self_attn.o_proj.weight": (D, H * head_dim),
            p + "mlp.gate_proj.weight": (mlp, D),
            p + "mlp.up_proj.weight": (mlp, D),
            p + "mlp.down_proj.weight": (D, mlp),
            # Random scalars would scale the residual stream down each layer.
            p + "layer_scalar": np.ones((1,)),
        }
        if not kv_shared:
            kv_heads = 1 if is_global else 2
            tensors[p + "self_attn.k_proj.weight"] = (kv_heads * head_dim, D)
            tensors[p + "self_attn.k_norm.weight"] = (head_dim,)
            if not is_global:
                tensors[p + "self_attn.v_proj.weight"] = (kv_heads * head_dim, D)
        if per_layer_inputs:
            tensors |= {
                p + "per_layer_input_gate.weight": (G4_PER_LAYER, D),
                p + "per_layer_projection.weight": (D, G4_PER_LAYER),
                p + "post_per_layer_input_norm.weight": (D,),
            }
        if num_experts:
            tensors |= {
                p + "pre_feedforward_layernorm_2.weight": (D,),
                p + "post_feedforward_layernorm_1.weight": (D,),
                p + "post_feedforward_layernorm_2.weight": (D,),
                p + "router.scale": (D,),
                p + "router.proj.weight": (num_experts, D),
                p + "router.per_expert_scale": (num_experts,),
                p + "experts.gate_up_proj": (num_experts, 2 * MOE_F, D),
                p + "experts.down_proj": (num_experts, D, MOE_F),
            }
    tensors["model.embed_tokens.weight"] = (V, D)
    tensors["model.norm.weight"] = (D,)
    if per_layer_inputs:
        tensors |= {
            "model.embed_tokens_per_layer.weight": (V, G4_LAYERS * G4_PER_LAYER),
            "model.per_layer_model_projection.weight": (G4_LAYERS * G4_PER_LAYER, D),
            "model.per_layer_projection_norm.weight": (G4_PER_LAYER,),
        }
    return _write(path, config, tensors)
