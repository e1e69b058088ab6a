"""Each family's weight table (derived from the config) against a real model.

If keras-hub renames or reshapes a weight, these fail loudly instead of the
weight silently falling back to full replication.
"""

import re

import keras
import keras_hub
import pytest

from keras_hub_autodist.architectures.registry import architecture_for
from keras_hub_autodist.fitting.planner import plan_model
from keras_hub_autodist.fitting.planner import resolve_mesh
from keras_hub_autodist.planning.options import PlanOptions
from keras_hub_autodist.planning.shapes import architecture_weights
from keras_hub_autodist.reading.configs import PresetConfig


def plan_config(info, mesh, **options):
    """The plan of a config already read, as `from_preset` makes it."""
    from keras_hub_autodist.planning.shapes import model_weights

    options = PlanOptions(**options)
    weights = model_weights(info, options)
    return plan_model(weights, resolve_mesh(mesh, weights, options), options)


SMALL = dict(vocabulary_size=48, num_layers=2, hidden_dim=16, intermediate_dim=32)

VARIANTS = {
    "gemma_mqa": (
        keras_hub.models.GemmaBackbone,
        dict(SMALL, num_query_heads=4, num_key_value_heads=1, head_dim=8),
    ),
    "gemma2_post_norms": (
        keras_hub.models.GemmaBackbone,
        dict(
            SMALL,
            num_query_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            use_post_ffw_norm=True,
            use_post_attention_norm=True,
            final_logit_soft_cap=30.0,
            attention_logit_soft_cap=50.0,
            use_sliding_window_attention=True,
        ),
    ),
    "gemma3_text": (
        keras_hub.models.Gemma3Backbone,
        dict(
            SMALL,
            num_query_heads=4,
            num_key_value_heads=1,
            head_dim=8,
            image_size=16,
            vision_encoder=None,
        ),
    ),
    "gemma3_no_qk_norm": (
        keras_hub.models.Gemma3Backbone,
        dict(
            SMALL,
            num_query_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            image_size=16,
            vision_encoder=None,
            use_query_key_norm=False,
            use_post_ffw_norm=True,
            use_post_attention_norm=True,
        ),
    ),
    "llama2_untied": (
        keras_hub.models.LlamaBackbone,
        dict(SMALL, num_query_heads=4, num_key_value_heads=4),
    ),
    "llama_tied": (
        keras_hub.models.LlamaBackbone,
        dict(SMALL, num_query_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    ),
    "llama3_untied": (
        keras_hub.models.Llama3Backbone,
        dict(SMALL, num_query_heads=4, num_key_value_heads=2),
    ),
    "llama3_tied": (
        keras_hub.models.Llama3Backbone,
        dict(SMALL, num_query_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    ),
    "mistral": (
        keras_hub.models.MistralBackbone,
        dict(SMALL, num_query_heads=4, num_key_value_heads=2),
    ),
    "mistral_head_dim": (
        keras_hub.models.MistralBackbone,
        dict(SMALL, num_query_heads=4, num_key_value_heads=2, head_dim=8),
    ),
}


def _build(name):
    cls, config = VARIANTS[name]
    return cls(**config), PresetConfig(name, cls, config, "keras")


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_weight_table_matches_real_model(name):
    model, info = _build(name)
    architecture = architecture_for(info.backbone_cls)
    table = {
        w.path: w.shape
        for w in architecture_weights(architecture, info.config, info.backbone_cls)
    }
    real = {w.path: tuple(w.shape) for w in model.weights}
    assert table == real


@pytest.mark.parametrize("name", sorted(VARIANTS))
@pytest.mark.parametrize(
    "mesh", [{"batch": 2, "model": 4}, {"batch": 2, "model": 2, "x": 2}]
)
def test_every_weight_and_lora_kernel_matches_exactly_one_key(name, mesh):
    model, info = _build(name)
    layout_plan = plan_config(info, mesh, strategy="fsdp")
    layouts = layout_plan.weight_layouts()
    model.enable_lora(2)
    lora_seen = 0
    for weight in model.weights:
        keys = [k for k in layouts if re.fullmatch(k, weight.path)]
        assert len(keys) == 1, (weight.path, keys)
        spec = layouts[keys[0]]
        assert len(spec) == len(weight.shape)
        for axis, size in zip(spec, weight.shape):
            if axis is not None:
                assert size % layout_plan.mesh_axes.size(axis) == 0
        if "lora_kernel" in weight.path:
            lora_seen += 1
            base = weight.path.rsplit("/", 1)[0] + "/kernel"
            base_spec = layouts[next(k for k in layouts if re.fullmatch(k, base))]
            if weight.path.endswith("lora_kernel_a"):
                assert spec == base_spec[:-1] + (None,)
            else:
                assert spec == (None, base_spec[-1])
    assert lora_seen >= 4


def test_kernel_keys_do_not_match_lora_kernels():
    _, info = _build("llama3_untied")
    layouts = plan_config(
        info, {"batch": 2, "model": 4}, strategy="tp"
    ).weight_layouts()
    kernel_key = next(k for k in layouts if k.endswith("query/kernel"))
    assert not re.fullmatch(
        kernel_key, "transformer_layer_0/self_attention/query/lora_kernel_a"
    )
    assert re.fullmatch(kernel_key, "transformer_layer_11/self_attention/query/kernel")


def test_layouts_follow_each_family_axis_order():
    # Gemma kernels are (heads, hidden, head_dim), Llama's (hidden, heads, head_dim):
    # the same logical rule lands on a different dimension.
    _, gemma = _build("gemma2_post_norms")
    _, llama = _build("llama3_untied")
    g = plan_config(gemma, {"batch": 1, "model": 2}, strategy="tp").weight_layouts()
    m = plan_config(llama, {"batch": 1, "model": 2}, strategy="tp").weight_layouts()
    assert g[r"decoder_block_\d+/attention/query/kernel"] == ("model", None, None)
    assert m[r"transformer_layer_\d+/self_attention/query/kernel"] == (
        None,
        "model",
        None,
    )
    assert g[r"decoder_block_\d+/attention/attention_output/kernel"] == (
        "model",
        None,
        None,
    )
    assert m[r"transformer_layer_\d+/feedforward_output_dense/kernel"] == (
        "model",
        None,
    )
    assert m["token_embedding/reverse_embeddings"] == (None, "model")


def test_layout_map_is_a_keras_layout_map():
    _, info = _build("gemma_mqa")
    mesh = keras.distribution.DeviceMesh(
        (2, 4), ("batch", "model"), keras.distribution.list_devices()
    )
    layout_plan = plan_config(info, mesh, strategy="tp")
    layout_map = layout_plan.layout_map(mesh)
    assert isinstance(layout_map, keras.distribution.LayoutMap)
    # One kv head never goes on the model axis; in this tiny model K/V are a
    # large share of the weights: replicating them would break the tp target
    # of per-device bytes, so their head_dim is sharded instead.
    layout = layout_map["decoder_block_1/attention/key/kernel"]
    assert layout.axes == (None, None, "model")
    key_row = next(
        r for r in layout_plan.rows if r.path.endswith("1/attention/key/kernel")
    )
    assert "num_key_value_heads=1 does not divide by model=4" in key_row.note
    assert "sharded head_dim=8 over 'model' instead" in key_row.note
    assert "x the ideal per-device parameter bytes, over the 1.10x tp" in (key_row.note)
    assert layout_map["decoder_block_1/attention/query/kernel"].axes == (
        "model",
        None,
        None,
    )
