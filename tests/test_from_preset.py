"""`from_preset(..., device_mesh=...)` against a single-device run of a preset."""

import functools

import jax
import keras
import keras_hub
import numpy as np
import pytest
import tiny_presets

import keras_hub_autodist
from keras_hub_autodist import BackendError
from keras_hub_autodist import BatchSizeError
from keras_hub_autodist import MeshError
from keras_hub_autodist import PresetError
from keras_hub_autodist import StrategyError
from keras_hub_autodist import UnsupportedArchitectureError

PRESETS = sorted(tiny_presets.BUILDERS)
MESHES_2D = [(8, 1), (4, 2), (2, 4), (1, 8)]
MESHES = (
    [{"batch": b, "model": m} for b, m in MESHES_2D]
    + [{"model": m, "batch": b} for b, m in MESHES_2D]
    + [{"batch": 2, "model": 2, "x": 2}]
)
BATCH = 8


def mesh_id(mesh):
    return "-".join(f"{k}{v}" for k, v in mesh.items())


def batch_for(preset, seed=0):
    info = keras_hub_autodist.presets.read_preset_config(preset)
    x = tiny_presets.token_batch(BATCH, info.config["vocabulary_size"], seed=seed)
    y = np.roll(x["token_ids"], -1, axis=1)
    return x, y


def optimizer_for(name):
    # Built before compile on purpose: its iteration/learning-rate variables
    # then live on one device (the "incompatible devices" report).
    return keras.optimizers.SGD(0.1) if name == "sgd" else keras.optimizers.Adam(1e-2)


def train(preset, optimizer="sgd", steps=3, **mesh_kwargs):
    lm = keras_hub.models.CausalLM.from_preset(preset, preprocessor=None, **mesh_kwargs)
    lm.compile(
        optimizer=optimizer_for(optimizer),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        sampler="greedy",
    )
    x, y = batch_for(preset)
    losses = [
        float(lm.train_on_batch(x, y, return_dict=True)["loss"]) for _ in range(steps)
    ]
    weights = {w.path: np.asarray(w.value) for w in lm.backbone.weights}
    return lm, losses, weights


@functools.cache
def reference(preset, optimizer):
    _, losses, weights = train(preset, optimizer)
    return losses, weights


def assert_same_training(preset, optimizer, **mesh_kwargs):
    lm, losses, weights = train(preset, optimizer, **mesh_kwargs)
    ref_losses, ref_weights = reference(preset, optimizer)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    if optimizer == "sgd":
        assert weights.keys() == ref_weights.keys()
        for path, value in weights.items():
            np.testing.assert_allclose(
                value, ref_weights[path], atol=1e-5, err_msg=path
            )
    assert keras.distribution.distribution() is None
    return lm


# Every mesh (each axis order and the 3D one) with a rotating preset and
# strategy, so that each preset, mesh and strategy is covered in the default
# session; the full cross product runs in the `slow` (integration) session.
ROTATION = [
    (PRESETS[i % len(PRESETS)], mesh, ("tp", "fsdp")[i % 2])
    for i, mesh in enumerate(MESHES)
] + [
    (PRESETS[i], MESHES[(i + 3) % len(MESHES)], ("fsdp", "tp")[i % 2]) for i in range(5)
]


# The default session covers every mesh once; the five extra cases (each
# preset on another mesh) and the full matrix run in the integration session.
ROTATION_CASES = [
    pytest.param(
        *case,
        id=f"{case[0]}-{mesh_id(case[1])}-{case[2]}",
        marks=[pytest.mark.slow] if i >= len(MESHES) else [],
    )
    for i, case in enumerate(ROTATION)
]


@pytest.mark.parametrize("name, mesh, strategy", ROTATION_CASES)
def test_sgd_training_matches_single_device(tiny_presets_dir, name, mesh, strategy):
    assert_same_training(
        tiny_presets_dir[name], "sgd", device_mesh=mesh, strategy=strategy
    )


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(
            name,
            marks=[] if name == "gemma_mqa" else [pytest.mark.slow],
        )
        for name in PRESETS
    ],
)
def test_adam_losses_match_single_device(tiny_presets_dir, name):
    mesh = MESHES[PRESETS.index(name) % len(MESHES)]
    assert_same_training(
        tiny_presets_dir[name], "adam", device_mesh=mesh, strategy="fsdp"
    )


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["tp", "fsdp"])
@pytest.mark.parametrize("mesh", MESHES, ids=mesh_id)
@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_full_matrix_matches_single_device(
    tiny_presets_dir, name, mesh, strategy, optimizer
):
    assert_same_training(
        tiny_presets_dir[name], optimizer, device_mesh=mesh, strategy=strategy
    )


def greedy_tokens(lm, preset):
    x, _ = batch_for(preset, seed=1)
    mask = np.zeros_like(x["padding_mask"])
    mask[:, :3] = 1
    prompt = {"token_ids": x["token_ids"] * mask, "padding_mask": mask}
    out = lm.generate(prompt, max_length=8, stop_token_ids=None)
    return np.asarray(out["token_ids"])


@pytest.mark.parametrize(
    "name, mesh",
    [
        pytest.param("gemma_mqa", {"batch": 1, "model": 8}, marks=pytest.mark.slow),
        ("llama3_untied", {"model": 2, "batch": 4}),
        pytest.param(
            "gemma2_gqa", {"batch": 2, "model": 2, "x": 2}, marks=pytest.mark.slow
        ),
    ],
)
def test_greedy_generate_matches_single_device(tiny_presets_dir, name, mesh):
    preset = tiny_presets_dir[name]
    single = keras_hub.models.CausalLM.from_preset(preset, preprocessor=None)
    single.compile(sampler="greedy")
    sharded = keras_hub.models.CausalLM.from_preset(
        preset, preprocessor=None, device_mesh=mesh
    )
    sharded.compile(sampler="greedy")
    np.testing.assert_array_equal(
        greedy_tokens(sharded, preset), greedy_tokens(single, preset)
    )


def test_generate_a_single_prompt_on_a_batch_axis(tiny_presets_dir):
    lm = keras_hub.models.GemmaCausalLM.from_preset(
        tiny_presets_dir["gemma_mqa"], device_mesh={"batch": 4, "model": 2}
    )
    lm.compile(sampler="greedy")
    single = lm.generate("the quick brown", max_length=6)
    several = lm.generate(["the quick brown", "a mesh has"], max_length=6)
    assert isinstance(single, str) and len(several) == 2 and several[0] == single


@pytest.mark.parametrize(
    "mesh",
    [
        pytest.param({"batch": 4, "model": 2}, marks=pytest.mark.slow),
        pytest.param({"model": 2, "batch": 4}, marks=pytest.mark.slow),
        {"model": 2, "x": 2, "batch": 2},
    ],
    ids=mesh_id,
)
def test_batch_is_sharded_on_batch_axis_inside_train_step(tiny_presets_dir, mesh):
    preset = tiny_presets_dir["llama3_untied"]
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
    lm.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    assert seen, "the loss was never traced"
    assert seen[0].spec[0] == "batch"
    assert seen[0].shard_shape(y.shape)[0] == BATCH // mesh["batch"]


def test_seed_report_gemma_mqa_on_two_devices(tiny_presets_dir):
    devices = keras.distribution.list_devices()[:2]
    mesh = keras.distribution.DeviceMesh((1, 2), ("batch", "model"), devices)
    assert_same_training(tiny_presets_dir["gemma_mqa"], "sgd", device_mesh=mesh)


def test_seed_report_model_batch_mesh_fine_tuning(tiny_presets_dir):
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


@pytest.mark.slow
def test_two_models_on_two_meshes(tiny_presets_dir):
    preset = tiny_presets_dir["gemma3_text"]
    first = keras_hub.models.CausalLM.from_preset(
        preset, preprocessor=None, device_mesh={"batch": 2, "model": 4}
    )
    second = keras_hub.models.CausalLM.from_preset(
        preset, preprocessor=None, device_mesh={"model": 2, "batch": 4}
    )
    x, y = batch_for(preset)
    for lm in (first, second):
        lm.compile(
            optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(True)
        )
    losses = [
        float(m.train_on_batch(x, y, return_dict=True)["loss"])
        for m in (first, second, first, second)
    ]
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-5)
    np.testing.assert_allclose(losses[2], losses[3], rtol=1e-5)
    for lm, names in ((first, ("batch", "model")), (second, ("model", "batch"))):
        assert tuple(lm.backbone.weights[0].value.sharding.mesh.axis_names) == names


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
    lm, _, _ = train(preset, "sgd", device_mesh={"batch": 2, "model": 4})
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
    y = np.zeros((BATCH, 8, lm.hidden_dim), "float32")
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


@pytest.mark.slow
def test_quantize_runs_in_the_models_scope(tiny_presets_dir):
    preset = tiny_presets_dir["llama3_untied"]
    single = keras_hub.models.CausalLM.from_preset(preset, preprocessor=None)
    sharded = keras_hub.models.CausalLM.from_preset(
        preset, preprocessor=None, device_mesh={"batch": 2, "model": 4}
    )
    for lm in (single, sharded):
        lm.quantize("int8")
        lm.compile(sampler="greedy")
    assert keras.distribution.distribution() is None
    mesh_devices = set(
        keras_hub_autodist.distribution_of(
            sharded
        ).distribution.device_mesh.backend_mesh.devices.flat
    )
    for weight in sharded.backbone.weights:
        assert set(weight.value.sharding.device_set) == mesh_devices, weight.path
    np.testing.assert_array_equal(
        greedy_tokens(sharded, preset), greedy_tokens(single, preset)
    )
