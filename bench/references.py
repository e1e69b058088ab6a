"""Hand-written reference layouts the benchmark compiles next to autodist.

- `megatron_layout_map`: Megatron tensor parallelism written by hand for each
  bench model: query/key/value column-parallel over heads on the model axis
  (key/value replicated when their heads don't divide it), attention output
  row-parallel over heads, gate/up column-parallel, down row-parallel,
  embeddings vocab-parallel, norms replicated; everything replicated over the
  batch axis.
- `zero3_layout_map`: fully sharded (ZeRO-3 style): every weight of two or
  more dimensions is sharded over all devices. Keras' `TensorLayout` accepts
  one mesh axis name per dimension (a tuple such as `("batch", "model")` is
  rejected by its axis validation), so the largest dimension goes on the
  batch axis and the next largest on the model axis (each only if it
  divides); norms are replicated.

Both are plain `keras.distribution.LayoutMap`s built without the planner.
keras-hub names mixture-of-experts blocks from a process-wide counter
(`mixtral_sparse_moe_block_3` in the fourth model built), so their keys
accept any counter.
"""

from __future__ import annotations

import re

import keras

MOE_COUNTER = re.compile(r"(_sparse_moe_block)(?:_\d+)?")


def _sizes(mesh):
    return dict(zip(mesh.axis_names, mesh.shape))


def megatron_layout_map(backbone_name, config, mesh):
    """Megatron's layout for `GemmaBackbone`, `Llama3Backbone` or
    `MixtralBackbone`, by hand.

    Args:
        backbone_name: the backbone class name.
        config: the backbone's config (heads are read from it).
        mesh: a `keras.distribution.DeviceMesh` with "batch" and "model" axes.
    """
    model = "model"
    kv_on_model = config["num_key_value_heads"] % _sizes(mesh)[model] == 0
    kv = model if kv_on_model else None
    layout_map = keras.distribution.LayoutMap(mesh)
    if backbone_name == "GemmaBackbone":
        block = r"decoder_block_\d+/"
        # Gemma kernels: query/key/value (heads, hidden, head_dim), output
        # (heads, head_dim, hidden); the embedding is tied (vocab, hidden).
        layout_map["token_embedding/embeddings"] = (model, None)
        layout_map[block + "attention/query/kernel"] = (model, None, None)
        layout_map[block + "attention/key/kernel"] = (kv, None, None)
        layout_map[block + "attention/value/kernel"] = (kv, None, None)
        layout_map[block + "attention/attention_output/kernel"] = (model, None, None)
        layout_map[block + "ffw_gating/kernel"] = (None, model)
        layout_map[block + "ffw_gating_2/kernel"] = (None, model)
        layout_map[block + "ffw_linear/kernel"] = (model, None)
    elif backbone_name in ("Llama3Backbone", "MixtralBackbone"):
        block = r"transformer_layer_\d+/"
        # Llama kernels (Mixtral's attention is Llama's): query/key/value
        # (hidden, heads, head_dim), output (heads, head_dim, hidden); untied
        # input (vocab, hidden) and output (hidden, vocab) embeddings.
        layout_map["token_embedding/embeddings"] = (model, None)
        layout_map["token_embedding/reverse_embeddings"] = (None, model)
        layout_map[block + "self_attention/query/kernel"] = (None, model, None)
        layout_map[block + "self_attention/key/kernel"] = (None, kv, None)
        layout_map[block + "self_attention/value/kernel"] = (None, kv, None)
        layout_map[block + "self_attention/attention_output/kernel"] = (
            model,
            None,
            None,
        )
    if backbone_name == "Llama3Backbone":
        layout_map[block + "feedforward_intermediate_dense/kernel"] = (None, model)
        layout_map[block + "feedforward_gate_dense/kernel"] = (None, model)
        layout_map[block + "feedforward_output_dense/kernel"] = (model, None)
    elif backbone_name == "MixtralBackbone":
        # The router (hidden, experts) replicated; the experts (experts,
        # hidden, mlp) / (experts, mlp, hidden) over the model axis (expert
        # parallelism, Megatron's EP) when their count divides it, else
        # gate/intermediate column- and output row-parallel inside each
        # expert.
        experts = block + r"mixtral_sparse_moe_block(_\d+)?/experts/"
        on_experts = config["num_experts"] % _sizes(mesh)[model] == 0
        column = (model, None, None) if on_experts else (None, None, model)
        row = (model, None, None) if on_experts else (None, model, None)
        layout_map[experts + "expert_feedforward_(gate|intermediate)_dense"] = column
        layout_map[experts + "expert_feedforward_output_dense"] = row
    elif backbone_name != "GemmaBackbone":
        raise ValueError(f"No hand-written Megatron map for {backbone_name}")
    return layout_map


def zero3_spec(shape, sizes):
    """Largest dimension on "batch", the next largest on "model" (if each
    divides); 1-D weights replicated."""
    spec = [None] * len(shape)
    if len(shape) < 2:
        return tuple(spec)
    order = sorted(range(len(shape)), key=lambda d: -shape[d])
    for axis in ("batch", "model"):
        if sizes[axis] == 1:
            continue
        for dim in order:
            if spec[dim] is None and shape[dim] % sizes[axis] == 0:
                spec[dim] = axis
                break
    return tuple(spec)


def zero3_layout_map(weights, mesh):
    """A fully sharded layout for the given `(path, shape)` pairs.

    Args:
        weights: `(path, shape)` of every weight of the backbone.
        mesh: a `keras.distribution.DeviceMesh` with "batch" and "model" axes.
    """
    sizes = _sizes(mesh)
    layout_map = keras.distribution.LayoutMap(mesh)
    for path, shape in weights:
        key = MOE_COUNTER.sub(r"\1(_\\d+)?", path)
        layout_map[key] = zero3_spec(tuple(shape), sizes)
    return layout_map
