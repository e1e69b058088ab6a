"""Tiny-but-realistic configs and the distributions compared.

Real proportions where they matter to communication: a 32k vocabulary (the
embedding and logits dominate a small model's traffic, as in real ones),
Gemma with multi-query attention, Llama 3 with grouped-query attention and
untied embeddings; few, narrow layers so compiles stay fast.
"""

from __future__ import annotations

import keras
import keras_hub
import numpy as np

from bench import references
from bench.static_maps import STATIC_MAPS

SEQ = 32
BATCH = 8
# Tokens per sequence of the compiled training step (section 2): 8 x 512 =
# 4096 tokens, the scale of a fine-tuning step. With a few hundred tokens,
# resharding activations is cheaper than moving any weight, which no real
# step has (docs/benchmarks.md section 2). Only compiled, never run.
TRAIN_SEQ = 512
# The same vocabulary, depth, query heads and width in every model, so that
# their rows compare.
_COMMON = dict(vocabulary_size=32768, num_layers=2, num_query_heads=8, hidden_dim=256)
CONFIGS = {
    # Gemma with multi-query attention, like gemma_2b.
    "gemma_mqa": (
        keras_hub.models.GemmaBackbone,
        dict(_COMMON, num_key_value_heads=1, intermediate_dim=2048, head_dim=32),
    ),
    # Llama 3 with grouped-query attention and an untied output embedding.
    "llama_gqa_untied": (
        keras_hub.models.Llama3Backbone,
        dict(
            _COMMON,
            num_key_value_heads=2,
            intermediate_dim=704,
            tie_word_embeddings=False,
        ),
    ),
    # A mixture of experts like Mixtral 8x7B: 8 experts, 2 per token, Llama
    # attention with grouped-query heads, untied embeddings.
    "mixtral_moe": (
        keras_hub.models.MixtralBackbone,
        dict(
            _COMMON, num_key_value_heads=2, intermediate_dim=512, num_experts=8, top_k=2
        ),
    ),
}
CAUSAL_LM = {
    keras_hub.models.GemmaBackbone: keras_hub.models.GemmaCausalLM,
    keras_hub.models.Llama3Backbone: keras_hub.models.Llama3CausalLM,
    keras_hub.models.MixtralBackbone: keras_hub.models.MixtralCausalLM,
}


def save_presets(root):
    """Save each config as a backbone preset; return {name: path}."""
    paths = {}
    for name, (cls, config) in CONFIGS.items():
        keras.utils.set_random_seed(0)
        path = f"{root}/{name}"
        cls(**config).save_to_preset(path)
        paths[name] = path
    return paths


def batch(vocabulary_size, seed=0, sequence_length=SEQ, batch_size=BATCH):
    ids = (
        np.random.default_rng(seed)
        .integers(1, vocabulary_size, (batch_size, sequence_length))
        .astype("int32")
    )
    return {"token_ids": ids, "padding_mask": np.ones_like(ids)}, np.roll(
        ids, -1, axis=1
    )


def mesh_of(shape, axis_names=("batch", "model")):
    """A DeviceMesh over the 8 devices; `shape` follows `axis_names`."""
    return keras.distribution.DeviceMesh(
        shape, axis_names, keras.distribution.list_devices()
    )


_WEIGHTS = {}


def weight_shapes(name):
    """`(path, shape)` of every backbone weight, from a model built once."""
    if name not in _WEIGHTS:
        cls, config = CONFIGS[name]
        backbone = cls(**config)
        _WEIGHTS[name] = [(w.path, tuple(w.shape)) for w in backbone.weights]
    return _WEIGHTS[name]


def load(variant, name, path, shape, axis_names=("batch", "model")):
    """Load a CausalLM for one variant; returns (model, distribution or None).

    Variants: `autodist_tp`, `autodist_fsdp`; `megatron` and `zero3` (the
    hand-written layouts of `bench.references`); `static` (keras-hub's map
    in a hand-made scope; None when it can't load); `replicated` (weights
    on every device, batch split over the batch axis).
    """
    cls = CAUSAL_LM[CONFIGS[name][0]]
    mesh = mesh_of(shape, axis_names)
    if variant.startswith("autodist"):
        strategy = variant.split("_")[1]
        lm = cls.from_preset(
            path, preprocessor=None, device_mesh=mesh, strategy=strategy
        )
        import keras_hub_autodist

        return lm, keras_hub_autodist.distribution_of(lm).distribution
    backbone_name = CONFIGS[name][0].__name__
    if variant == "static":
        if backbone_name not in STATIC_MAPS:
            return None, f"keras-hub has no layout map for {backbone_name}"
        layout_map = STATIC_MAPS[backbone_name](mesh)
    elif variant == "megatron":
        layout_map = references.megatron_layout_map(
            backbone_name, CONFIGS[name][1], mesh
        )
    elif variant == "zero3":
        layout_map = references.zero3_layout_map(weight_shapes(name), mesh)
    elif variant == "replicated":
        layout_map = keras.distribution.LayoutMap(mesh)
    else:
        raise ValueError(f"Unknown variant {variant!r}")
    distribution = keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch"
    )
    try:
        with distribution.scope():
            lm = cls.from_preset(path, preprocessor=None)
    except Exception as error:  # keras-hub's static map can't load this shape
        if variant != "static":
            raise
        return None, f"{type(error).__name__}"
    return lm, distribution


def compile_for_training(lm, distribution):
    with distribution.scope():
        lm.compile(
            optimizer=keras.optimizers.SGD(0.01),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
