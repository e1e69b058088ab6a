"""`from_preset(..., device_mesh=...)` against a single-device run of a preset."""

import jax
import keras
import keras_hub
import numpy as np
import pytest
import tiny_presets
from equivalence import BATCH_SIZE
from equivalence import MESHES
from equivalence import assert_same_generate
from equivalence import assert_same_training
from equivalence import batch_for
from equivalence import mesh_id
from equivalence import train

import keras_hub_autodist
from keras_hub_autodist import BackendError
from keras_hub_autodist import BatchSizeError
from keras_hub_autodist import MeshError
from keras_hub_autodist import PresetError
from keras_hub_autodist import StrategyError
from keras_hub_autodist import UnsupportedArchitectureError

PRESETS = sorted(tiny_presets.CAUSAL_LMS)

# Every mesh (each axis order and the 3D one) once, with a rotating preset
# and strategy, so that each preset, mesh and strategy is covered here; the
# integration session covers every pair of values (a pairwise design).
ROTATION = [
    pytest.param(
        PRESETS[i % len(PRESETS)],
        mesh,
        ("tp", "fsdp")[i % 2],
        id=f"{PRESETS[i % len(PRESETS)]}-{mesh_id(mesh)}-{('tp', 'fsdp')[i % 2]}",
    )
    for i, mesh in enumerate(MESHES)
]


@pytest.mark.parametrize("name, mesh, strategy", ROTATION)
def test_sgd_training_matches_single_device(tiny_presets_dir, name, mesh, strategy):
    assert_same_training(
        tiny_presets_dir[name], "sgd", device_mesh=mesh, strategy=strategy
    )


def test_adam_losses_match_single_device(tiny_presets_dir):
    mesh = MESHES[PRESETS.index("gemma_mqa") % len(MESHES)]
    assert_same_training(
        tiny_presets_dir["gemma_mqa"], "adam", device_mesh=mesh, strategy="fsdp"
    )


def test_greedy_generate_matches_single_device(tiny_presets_dir):
    assert_same_generate(tiny_presets_dir["llama3_untied"], {"model": 2, "batch": 4})


def test_generate_a_single_prompt_on_a_batch_axis(tiny_presets_dir):
    lm = keras_hub.models.GemmaCausalLM.from_preset(
        tiny_presets_dir["gemma_mqa"], device_mesh={"batch": 4, "model": 2}
    )
    lm.compile(sampler="greedy")
    single = lm.generate("the quick brown", max_length=6)
    several = lm.generate(["the quick brown", "a mesh has"], max_length=6)
    assert isinstance(single, str) and len(several) == 2 and several[0] == single


def assert_batch_is_sharded_inside_train_step(preset, mesh):
    """The labels reach the loss split over the mesh's batch axis."""
    seen = []

    def loss(y_true, y_pred):
        jax.debug.inspect_array_sharding(y_true, callback=seen.append)
        return keras.losses.sparse_categorical_crossentropy(
            y_true, y_pred, from_logits=True
        )

    lm = keras_hub.models.CausalLM.from_preset(
        preset, preprocessor=None, device_mesh=mesh
    )
    lm.compile(optimizer="sgd", loss=loss)
    x, y = batch_for(preset)
    lm.fit(x, y, batch_size=BATCH_SIZE, epochs=1, verbose=0)
    assert seen, "the loss was never traced"
    assert seen[0].spec[0] == "batch"
    assert seen[0].shard_shape(y.shape)[0] == BATCH_SIZE // mesh["batch"]


def test_batch_is_sharded_on_batch_axis_inside_train_step(tiny_presets_dir):
    assert_batch_is_sharded_inside_train_step(
        tiny_presets_dir["llama3_untied"], {"model": 2, "x": 2, "batch": 2}
    )


def test_training_on_a_two_device_mesh_matches_single_device(tiny_presets_dir):
    devices = keras.distribution.list_devices()[:2]
    mesh = keras.distribution.DeviceMesh((1, 2), ("batch", "model"), devices)
    assert_same_training(tiny_presets_dir["gemma_mqa"], "sgd", device_mesh=mesh)


def test_model_first_mesh_trains_like_one_device_and_keeps_the_users_mesh(
    tiny_presets_dir,
):
    mesh = keras.distribution.DeviceMesh(
        (4, 2), ("model", "batch"), keras.distribution.list_devices()
    )
    lm = assert_same_training(tiny_presets_dir["gemma2_gqa"], "sgd", device_mesh=mesh)
    distribution, plan = keras_hub_autodist.distribution_of(lm)
    assert distribution.batch_dim_name == plan.batch_axis == "batch"
    assert distribution.device_mesh is mesh


def test_weights_are_created_sharded(tiny_presets_dir):
    lm = keras_hub.models.CausalLM.from_preset(
        tiny_presets_dir["llama3_untied"],
        device_mesh={"batch": 2, "model": 4},
        strategy="tp",
    )
    _, plan = keras_hub_autodist.distribution_of(lm)
    rows = {r.path: r for r in plan.rows}
    for weight in lm.backbone.weights:
        spec = tuple(weight.value.sharding.spec) + (None,) * 3
        assert spec[: len(weight.shape)] == rows[weight.path].spec, weight.path
        shard = weight.value.addressable_shards[0].data
        assert shard.nbytes == rows[weight.path].device_bytes


def test_lora_kernels_follow_the_plan(tiny_presets_dir):
    lm = keras_hub.models.CausalLM.from_preset(
        tiny_presets_dir["gemma_mqa"],
        preprocessor=None,
        device_mesh={"batch": 2, "model": 4},
    )
    lm.backbone.enable_lora(4)
    query_a = next(
        w for w in lm.backbone.weights if w.path.endswith("query/lora_kernel_a")
    )
    query_b = next(
        w for w in lm.backbone.weights if w.path.endswith("query/lora_kernel_b")
    )
    assert tuple(query_a.value.sharding.spec)[:1] == ("model",)
    assert all(axis is None for axis in query_b.value.sharding.spec)
    assert keras.distribution.distribution() is None


def test_nothing_leaks_into_the_global_distribution(tiny_presets_dir):
    preset = tiny_presets_dir["llama3_tied"]
    users = keras.distribution.DataParallel(
        devices=keras.distribution.list_devices()[:1]
    )
    keras.distribution.set_distribution(users)
    try:
        lm = keras_hub.models.CausalLM.from_preset(
            preset, preprocessor=None, device_mesh={"batch": 2, "model": 4}
        )
        assert keras.distribution.distribution() is users
        lm.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
        x, y = batch_for(preset)
        lm.train_on_batch(x, y)
        assert keras.distribution.distribution() is users
        with pytest.raises(ValueError, match="not_a_dtype"):
            keras_hub.models.CausalLM.from_preset(
                preset, device_mesh={"batch": 2, "model": 4}, dtype="not_a_dtype"
            )
        assert keras.distribution.distribution() is users
    finally:
        keras.distribution.set_distribution(None)


def test_backbone_from_preset_and_subclass_calls(tiny_presets_dir):
    preset = tiny_presets_dir["llama3_untied"]
    backbone = keras_hub.models.Backbone.from_preset(
        preset, device_mesh={"batch": 4, "model": 2}
    )
    assert isinstance(backbone, keras_hub.models.Llama3Backbone)
    assert (
        keras_hub_autodist.distribution_of(backbone).plan.backbone_class
        == "Llama3Backbone"
    )
    lm = keras_hub.models.Llama3CausalLM.from_preset(
        preset, device_mesh={"batch": 4, "model": 2}
    )
    assert keras_hub_autodist.distribution_of(lm.backbone).plan is (
        keras_hub_autodist.distribution_of(lm).plan
    )
    tokenizer = keras_hub.models.Llama3Tokenizer.from_preset(preset)
    assert tokenizer.vocabulary_size() > 0


def test_functional_form(tiny_presets_dir):
    lm = keras_hub_autodist.from_preset(
        keras_hub.models.CausalLM,
        tiny_presets_dir["gemma_mqa"],
        device_mesh={"batch": 8, "model": 1},
    )
    assert keras_hub_autodist.distribution_of(lm).distribution.batch_dim_name == "batch"


def test_without_device_mesh_nothing_changes(tiny_presets_dir):
    preset = tiny_presets_dir["gemma_mqa"]
    lm = keras_hub.models.CausalLM.from_preset(preset)
    assert len(lm.backbone.weights[0].value.sharding.device_set) == 1
    with pytest.raises(ValueError, match="not bound to a distribution"):
        keras_hub_autodist.distribution_of(lm)
    assert "fit" not in vars(lm)


def test_device_mesh_auto_picks_the_largest_batch_axis(tiny_presets_dir):
    lm = keras_hub.models.CausalLM.from_preset(
        tiny_presets_dir["gemma_mqa"], device_mesh="auto"
    )
    plan = keras_hub_autodist.distribution_of(lm).plan
    assert plan.mesh_axes.shape == (8, 1) and plan.strategy == "tp"


def test_preset_files_are_never_modified(tiny_presets_dir, tmp_path):
    preset = tiny_presets_dir["llama3_tied"]
    before = tiny_presets.folder_files(preset)
    lm = train(preset, "sgd", device_mesh={"batch": 2, "model": 4}).model
    lm.save_to_preset(str(tmp_path / "saved"))
    assert tiny_presets.folder_files(preset) == before


# Errors, each raised before JAX's own.


def test_error_non_jax_backend(tiny_presets_dir, monkeypatch):
    monkeypatch.setattr(keras.config, "backend", lambda: "torch")
    with pytest.raises(
        BackendError, match="KERAS_BACKEND=jax.*Received: backend='torch'"
    ):
        keras_hub.models.CausalLM.from_preset(
            tiny_presets_dir["gemma_mqa"], device_mesh={"batch": 8}
        )


def test_error_axis_without_role(tiny_presets_dir):
    with pytest.raises(MeshError, match=r"Mesh axes \['a', 'b'\] have no role"):
        keras_hub.models.CausalLM.from_preset(
            tiny_presets_dir["gemma_mqa"],
            device_mesh={"batch": 2, "model": 1, "a": 2, "b": 2},
        )


def test_error_mesh_size_does_not_match_devices(tiny_presets_dir):
    with pytest.raises(MeshError, match="has 4 devices .* but 8 devices are available"):
        keras_hub.models.CausalLM.from_preset(
            tiny_presets_dir["gemma_mqa"], device_mesh={"batch": 2, "model": 2}
        )


def test_error_batch_not_divisible(tiny_presets_dir):
    # Bound Tasks pad such batches (tests/test_batches.py); a Backbone has no
    # `preprocess_samples` to pad in, and refuses them before any step.
    preset = tiny_presets_dir["gemma_mqa"]
    lm = keras_hub.models.Backbone.from_preset(
        preset, device_mesh={"model": 2, "batch": 4}
    )
    lm.compile(optimizer="sgd", loss="mse")
    x, _ = batch_for(preset)
    y = np.zeros((BATCH_SIZE, 8, lm.hidden_dim), "float32")
    six = {k: v[:6] for k, v in x.items()}
    with pytest.raises(
        BatchSizeError,
        match="The batch size: 6 does not divide by the batch axis 'batch' of size 4",
    ):
        lm.train_on_batch(six, y[:6])
    with pytest.raises(
        BatchSizeError,
        match="last batch of 6 samples in batches of 4: 2 does not divide",
    ):
        lm.fit(six, y[:6], batch_size=4, verbose=0)
    with pytest.raises(BatchSizeError, match="batch size: 6 does not divide"):
        lm.fit(x, y, 6, verbose=0)
    assert keras.distribution.distribution() is None


def test_error_unsupported_architecture(tmp_path):
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=16,
        num_layers=1,
        num_heads=2,
        hidden_dim=8,
        intermediate_dim=16,
        max_sequence_length=8,
    )
    backbone.save_to_preset(str(tmp_path))
    with pytest.raises(
        UnsupportedArchitectureError, match="no layout for BertBackbone"
    ):
        keras_hub.models.Backbone.from_preset(str(tmp_path), device_mesh={"batch": 8})


def test_error_unknown_strategy(tiny_presets_dir):
    with pytest.raises(StrategyError, match="Received: strategy='ddp'"):
        keras_hub.models.CausalLM.from_preset(
            tiny_presets_dir["gemma_mqa"], device_mesh={"batch": 8}, strategy="ddp"
        )


def test_error_preset_without_config(tmp_path):
    with pytest.raises(PresetError, match="config.json.*Received: preset="):
        keras_hub.models.CausalLM.from_preset(str(tmp_path), device_mesh={"batch": 8})


def test_error_options_without_device_mesh(tiny_presets_dir):
    with pytest.raises(MeshError, match="strategy= only apply with `device_mesh=`"):
        keras_hub.models.CausalLM.from_preset(
            tiny_presets_dir["gemma_mqa"], strategy="tp"
        )


def test_error_bad_device_mesh_string(tiny_presets_dir):
    with pytest.raises(MeshError, match="Received: device_mesh='big'"):
        keras_hub.models.CausalLM.from_preset(
            tiny_presets_dir["gemma_mqa"], device_mesh="big"
        )
