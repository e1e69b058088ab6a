"""Gemma 3 with its vision tower: a sharded forward pass and training with
images equal one device's."""

import keras
import keras_hub
import numpy as np
import pytest
import tiny_presets

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def vision_preset(tiny_presets_dir):
    return tiny_presets_dir["gemma3_vision_backbone"]


def _inputs():
    # 16x16 images in 4x4 patches, pooled 2x2: 4 vision tokens per image.
    rng = np.random.default_rng(0)
    batch, length = 4, 12
    mask = np.zeros((batch, length), dtype="int32")
    mask[:, 2:6] = 1
    return {
        "images": rng.uniform(size=(batch, 1, 16, 16, 3)).astype("float32"),
        "token_ids": rng.integers(1, 100, size=(batch, length)).astype("int32"),
        "padding_mask": np.ones((batch, length), dtype="int32"),
        "vision_mask": mask,
        "vision_indices": np.tile(np.arange(2, 6), (batch, 1)).astype("int32"),
    }


@pytest.mark.parametrize("mesh", [{"batch": 2, "model": 4}, {"batch": 1, "model": 8}])
def test_sharded_forward_with_images_matches_one_device(vision_preset, mesh):
    single = keras_hub.models.Backbone.from_preset(vision_preset)
    sharded = keras_hub.models.Backbone.from_preset(vision_preset, device_mesh=mesh)
    query = next(
        w
        for w in sharded.weights
        if w.path.endswith("encoder_block_0/multi_head_attention/query_proj/kernel")
    )
    assert not query.value.sharding.is_fully_replicated
    inputs = _inputs()
    np.testing.assert_allclose(
        np.asarray(sharded(inputs)), np.asarray(single(inputs)), atol=1e-5, rtol=1e-5
    )


def _train(preset, **mesh_kwargs):
    backbone = keras_hub.models.Backbone.from_preset(preset, **mesh_kwargs)
    backbone.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    inputs = _inputs()
    hidden_dim = tiny_presets.GEMMA3_VISION_TEXT["hidden_dim"]
    target = np.zeros((4, 12, hidden_dim), dtype="float32")
    losses = [float(backbone.train_on_batch(inputs, target)) for _ in range(2)]
    return losses, {w.path: np.asarray(w.value) for w in backbone.weights}


@pytest.mark.parametrize(
    "mesh, strategy",
    [({"batch": 2, "model": 4}, "tp"), ({"model": 2, "batch": 4}, "fsdp")],
)
def test_training_with_images_matches_one_device(vision_preset, mesh, strategy):
    losses, weights = _train(vision_preset, device_mesh=mesh, strategy=strategy)
    ref_losses, ref_weights = _train(vision_preset)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert weights.keys() == ref_weights.keys()
    for path, value in weights.items():
        np.testing.assert_allclose(value, ref_weights[path], atol=1e-5, err_msg=path)
    initial = {
        w.path: np.asarray(w.value)
        for w in keras_hub.models.Backbone.from_preset(vision_preset).weights
    }
    vision = [p for p in weights if p.startswith("image_encoder/")]
    assert any(not np.allclose(weights[p], initial[p]) for p in vision)
