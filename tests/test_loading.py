"""Sharded loading: values, layouts and peak device bytes while loading.

Every load with `device_mesh=` is compared with keras-hub loading the same
preset onto one device: values bitwise equal, each variable's sharding equal
to the plan's, and no device ever holding more than its final share plus its
largest single shard.
"""

import io
import json
import os

import hf_checkpoints
import jax
import keras
import keras_hub
import ml_dtypes
import numpy as np
import pytest
import safetensors
import safetensors.numpy
import tiny_presets
from equivalence import assert_laid_out_as_planned

import keras_hub_autodist
from keras_hub_autodist import compat
from keras_hub_autodist import devices
from keras_hub_autodist.loading import file_reads
from keras_hub_autodist.loading import lazy_tensors
from keras_hub_autodist.loading import progress
from keras_hub_autodist.loading import session
from keras_hub_autodist.loading import transfer
from keras_hub_autodist.loading import verify


def backbone_preset(path, config, dtype="float32", **save_kwargs):
    """Save a bare GemmaBackbone (no tokenizer) as a Keras preset."""
    return tiny_presets.save_preset(
        path, keras_hub.models.GemmaBackbone, {**config, "dtype": dtype}, **save_kwargs
    )


@pytest.fixture(scope="module")
def presets(tmp_path_factory):
    root = tmp_path_factory.mktemp("loading")
    return {
        "keras": backbone_preset(root / "keras", tiny_presets.GEMMA_MQA),
        "transformers": hf_checkpoints.llama3(root / "transformers"),
    }


@pytest.fixture(scope="module")
def references(presets):
    """Each preset loaded by keras-hub onto one device, as numpy arrays."""
    found = {}
    for name, path in presets.items():
        backbone = keras_hub.models.Backbone.from_preset(path)
        found[name] = {v.path: np.asarray(v.value) for v in backbone.weights}
    return found


def mesh_of(shape):
    devices = keras.distribution.list_devices()
    return keras.distribution.DeviceMesh(shape, ("batch", "model"), devices)


# Formats and strategies rotated over the four meshes; the whole matrix in
# integration/test_loading_matrix.py.
ROTATION = [
    ("keras", (1, 8), "tp"),
    ("transformers", (2, 4), "fsdp"),
    ("keras", (4, 2), "fsdp"),
    ("transformers", (8, 1), "tp"),
]


def assert_load_equals_single_device_and_follows_the_plan(
    preset, reference, shape, strategy, format
):
    """`preset` loaded on a mesh of `shape`: bitwise `reference`, laid out as
    planned, every weight read once and its initializer skipped."""
    mesh = mesh_of(shape)
    backbone = keras_hub.models.Backbone.from_preset(
        preset, device_mesh=mesh, strategy=strategy
    )
    for variable in backbone.weights:
        np.testing.assert_array_equal(
            np.asarray(variable.value), reference[variable.path]
        )
    assert_laid_out_as_planned(backbone, mesh)
    stats = keras_hub_autodist.load_stats(backbone)
    assert stats.weights_loaded == len(backbone.weights)
    assert stats.initializers_skipped == len(backbone.weights)
    total = sum(v.nbytes for v in reference.values())
    # Every tensor is read slice by slice, each byte once: Gemma's converter
    # hooks only reshape and transpose.
    assert stats.bytes_read == total
    assert stats.bytes_received == 0


@pytest.mark.parametrize("format,shape,strategy", ROTATION)
def test_load_equals_single_device_and_follows_the_plan(
    presets, references, format, shape, strategy
):
    assert_load_equals_single_device_and_follows_the_plan(
        presets[format], references[format], shape, strategy, format
    )


def test_sharded_keras_weight_files(tmp_path):
    path = backbone_preset(
        tmp_path / "sharded", tiny_presets.GEMMA_MQA, max_shard_size=0.00002
    )
    assert os.path.exists(os.path.join(path, "model.weights.json"))
    shards = [f for f in os.listdir(path) if f.startswith("model_")]
    assert len(shards) > 1, shards
    single = keras_hub.models.Backbone.from_preset(path)
    mesh = mesh_of((2, 4))
    backbone = keras_hub.models.Backbone.from_preset(
        path, device_mesh=mesh, strategy="fsdp"
    )
    for mine, theirs in zip(backbone.weights, single.weights):
        np.testing.assert_array_equal(np.asarray(mine.value), np.asarray(theirs.value))
    assert_laid_out_as_planned(backbone, mesh)
    assert keras_hub_autodist.load_stats(backbone).weights_loaded == len(
        backbone.weights
    )


@pytest.mark.parametrize(
    "saved,loaded", [("bfloat16", "float32"), ("float32", "bfloat16")]
)
def test_dtype_casts_like_keras_hub(tmp_path, saved, loaded):
    path = backbone_preset(tmp_path / saved, tiny_presets.GEMMA_MQA, dtype=saved)
    single = keras_hub.models.Backbone.from_preset(path, dtype=loaded)
    backbone = keras_hub.models.Backbone.from_preset(
        path, dtype=loaded, device_mesh={"batch": 2, "model": 4}
    )
    for mine, theirs in zip(backbone.weights, single.weights):
        assert mine.dtype == theirs.dtype == loaded
        np.testing.assert_array_equal(
            np.asarray(mine.value.astype("float32")),
            np.asarray(theirs.value.astype("float32")),
        )


def test_bfloat16_preset_keeps_its_dtype(tmp_path):
    path = backbone_preset(tmp_path / "bf16", tiny_presets.GEMMA_MQA, dtype="bfloat16")
    single = keras_hub.models.Backbone.from_preset(path, dtype="bfloat16")
    backbone = keras_hub.models.Backbone.from_preset(
        path, dtype="bfloat16", device_mesh={"batch": 1, "model": 8}
    )
    for mine, theirs in zip(backbone.weights, single.weights):
        assert mine.dtype == "bfloat16"
        assert np.asarray(mine.value).tobytes() == np.asarray(theirs.value).tobytes()


def test_load_weights_false_computes_initial_values(presets):
    backbone = keras_hub.models.Backbone.from_preset(
        presets["keras"], load_weights=False, device_mesh={"batch": 2, "model": 4}
    )
    stats = keras_hub_autodist.load_stats(backbone)
    assert stats.weights_loaded == 0 and stats.initializers_skipped == 0
    kernels = [v for v in backbone.weights if v.path.endswith("kernel")]
    assert all(np.abs(np.asarray(v.value)).sum() > 0 for v in kernels)


def test_variables_the_checkpoint_does_not_cover_get_their_initializer(
    tiny_presets_dir,
):
    lm = keras_hub.models.CausalLM.from_preset(
        tiny_presets_dir["gemma_mqa"], device_mesh={"batch": 2, "model": 4}
    )
    stats = keras_hub_autodist.load_stats(lm)
    # Every skipped initial value was overwritten by the checkpoint; the
    # compiled metrics' counters, which are not in it, were initialised
    # (to zeros) after loading.
    assert stats.weights_loaded == stats.initializers_skipped
    assert stats.weights_loaded == len(lm.backbone.weights)
    assert stats.initialized_after_load >= len(lm.metrics_variables) > 0
    assert all(float(np.asarray(v.value)) == 0.0 for v in lm.metrics_variables)


def test_lora_after_loading_and_reload_on_another_mesh(presets, tmp_path):
    backbone = keras_hub.models.Backbone.from_preset(
        presets["keras"], device_mesh={"batch": 2, "model": 4}, strategy="fsdp"
    )
    backbone.enable_lora(2)
    lora = [v for v in backbone.trainable_weights if "lora" in v.path]
    assert lora and all(len(v.value.sharding.device_set) == 8 for v in lora)
    saved = str(tmp_path / "saved")
    backbone.save_to_preset(saved)
    again = keras_hub.models.Backbone.from_preset(
        saved, device_mesh={"batch": 8, "model": 1}
    )
    values = {v.path: np.asarray(v.value) for v in backbone.weights}
    for variable in again.weights:
        np.testing.assert_array_equal(np.asarray(variable.value), values[variable.path])
    assert_laid_out_as_planned(
        again, keras_hub_autodist.distribution_of(again)[0].device_mesh
    )


MEDIUM_GEMMA = dict(
    vocabulary_size=4096,
    num_layers=2,
    num_query_heads=8,
    num_key_value_heads=8,
    hidden_dim=256,
    intermediate_dim=1024,
    head_dim=32,
)


def sample_peaks(monkeypatch):
    """Record per-device bytes after every allocation the loader makes."""
    peaks = {}

    def record():
        for device, size in devices.per_device_bytes().items():
            peaks[device] = max(peaks.get(device, 0), size)

    put, placeholder = session._Session.put, transfer.placeholder

    def recording_put(self, *args, **kwargs):
        result = put(self, *args, **kwargs)
        record()
        return result

    def recording_placeholder(*args, **kwargs):
        result = placeholder(*args, **kwargs)
        record()
        return result

    monkeypatch.setattr(session._Session, "put", recording_put)
    monkeypatch.setattr(transfer, "placeholder", recording_placeholder)
    return peaks, record


@pytest.mark.parametrize("shape,strategy", [((1, 8), "tp"), ((2, 4), "fsdp")])
def test_peak_bytes_per_device_while_loading(tmp_path, monkeypatch, shape, strategy):
    """No device holds more than its final share + its largest shard."""
    path = backbone_preset(tmp_path / "medium", MEDIUM_GEMMA)
    keras.utils.clear_session(free_memory=True)
    baseline = devices.per_device_bytes()
    peaks, _ = sample_peaks(monkeypatch)
    mesh = mesh_of(shape)
    backbone = keras_hub.models.Backbone.from_preset(
        path, device_mesh=mesh, strategy=strategy
    )
    _, plan = keras_hub_autodist.distribution_of(backbone)
    largest_shard = max(row.device_bytes for row in plan.rows)
    final = devices.per_device_bytes()
    for device, peak in peaks.items():
        share = final.get(device, 0) - baseline.get(device, 0)
        assert share >= plan.max_device_bytes
        grown = peak - baseline.get(device, 0)
        assert grown <= share + largest_shard, (device, grown, share, largest_shard)


def test_each_device_receives_only_its_shards_while_loading(tmp_path, monkeypatch):
    """keras-hub alone, even inside a hand-made `ModelParallel` scope, assigns
    each weight whole to one device before sharding it, far over the bound
    above. Through the plugin each weight goes from the file straight to its
    shards: every device receives exactly its planned share of each weight."""
    path = backbone_preset(tmp_path / "medium", MEDIUM_GEMMA)
    received = []
    put = session._Session.put

    def recording_put(session, source, variable):
        array = put(session, source, variable)
        shards = [shard.data.nbytes for shard in array.addressable_shards]
        received.append((variable.path, shards))
        return array

    monkeypatch.setattr(session._Session, "put", recording_put)
    backbone = keras_hub.models.Backbone.from_preset(
        path, device_mesh=mesh_of((1, 8)), strategy="tp"
    )
    _, plan = keras_hub_autodist.distribution_of(backbone)
    rows = {row.path: row for row in plan.rows}
    assert sorted(path for path, _ in received) == sorted(rows)
    for path, shards in received:
        assert len(shards) == 8, path
        assert set(shards) == {rows[path].device_bytes}, (path, shards)
    assert any(row.device_bytes < row.bytes for row in rows.values())


def test_hooks_are_removed_after_loading(presets):
    before = dict(vars(keras.Variable))
    keras_hub.models.Backbone.from_preset(
        presets["keras"], device_mesh={"batch": 2, "model": 4}
    )
    assert dict(vars(keras.Variable)) == before
    assert keras.Variable.assign is session._original_assign
    # Outside the plugin, weights load exactly as keras-hub loads them.
    plain = keras_hub.models.Backbone.from_preset(presets["keras"])
    assert all(v.value.sharding.num_devices == 1 for v in plain.weights)


def test_hooks_are_removed_when_loading_fails(presets, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in os.listdir(presets["keras"]):
        if name != "model.weights.h5":
            data = open(os.path.join(presets["keras"], name), "rb").read()
            (broken / name).write_bytes(data)
    with open(broken / "model.weights.h5", "wb") as f:
        f.write(b"not hdf5")
    with pytest.raises((OSError, ValueError)):
        keras_hub.models.Backbone.from_preset(
            str(broken), device_mesh={"batch": 2, "model": 4}
        )
    assert keras.Variable.assign is session._original_assign
    assert session.active_sessions() == 0
    assert compat.installed_patches() == {}


def test_progress_bar_on_a_terminal(presets, monkeypatch):
    stream = io.StringIO()
    stream.isatty = lambda: True
    monkeypatch.setattr("sys.stderr", stream)
    monkeypatch.setattr(progress, "PROGRESS_DELAY_SECONDS", 0.0)
    keras_hub.models.Backbone.from_preset(
        presets["keras"], device_mesh={"batch": 2, "model": 4}
    )
    text = stream.getvalue()
    assert "Loading weights" in text
    total = len(tiny_presets_weights(presets["keras"]))
    assert f"{total}/{total} weights" in text
    assert "MiB/s" in text


def tiny_presets_weights(path):
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)["config"]
    return keras_hub_autodist.plan(path, {"batch": 1}, dtype=config.get("dtype")).rows


@pytest.mark.parametrize(
    "env,tty,shown",
    [("", False, False), ("0", True, False), ("off", True, False), ("", True, True)],
)
def test_progress_bar_switches(presets, monkeypatch, env, tty, shown):
    stream = io.StringIO()
    stream.isatty = lambda: tty
    monkeypatch.setattr("sys.stderr", stream)
    monkeypatch.setattr(progress, "PROGRESS_DELAY_SECONDS", 0.0)
    monkeypatch.setenv(progress.PROGRESS_ENV, env)
    keras_hub.models.Backbone.from_preset(
        presets["keras"], device_mesh={"batch": 2, "model": 4}
    )
    assert ("Loading weights" in stream.getvalue()) == shown


def test_progress_keyword_turns_it_off(presets, monkeypatch):
    stream = io.StringIO()
    stream.isatty = lambda: True
    monkeypatch.setattr("sys.stderr", stream)
    monkeypatch.setattr(progress, "PROGRESS_DELAY_SECONDS", 0.0)
    keras_hub_autodist.from_preset(
        keras_hub.models.Backbone,
        presets["keras"],
        device_mesh={"batch": 2, "model": 4},
        progress=False,
    )
    assert stream.getvalue() == ""


def test_verify_layouts_names_a_misplaced_variable(presets):
    backbone = keras_hub.models.Backbone.from_preset(
        presets["keras"], device_mesh={"batch": 2, "model": 4}, strategy="fsdp"
    )
    variable = backbone.weights[0]
    variable._value = jax.device_put(np.asarray(variable.value), jax.devices()[0])
    with pytest.raises(
        keras_hub_autodist.LayoutMismatchError,
        match=f"not laid out as planned.*Received: {variable.path}",
    ):
        verify.verify_layouts(backbone)


def mapped(path):
    """Whether `path` is mapped into this process (Linux)."""
    real = os.path.realpath(path)
    with open("/proc/self/maps") as f:
        return any(line.rstrip("\n").endswith(" " + real) for line in f)


@pytest.mark.skipif(
    not os.path.exists("/proc/self/maps"), reason="needs Linux's /proc/self/maps"
)
def test_safetensors_file_is_mapped_only_while_a_tensor_is_read(presets, monkeypatch):
    """keras-hub keeps each safetensors file open, i.e. mapped, for the whole
    load, so every page read stayed in host RSS: the whole checkpoint. While
    a weight goes to its shards, its file is no longer mapped."""
    path = os.path.join(presets["transformers"], "model.safetensors")
    safetensor_utils = keras_hub_autodist.compat.safetensor_utils_module()
    port_weight = safetensor_utils.SafetensorLoader.port_weight
    seen = []
    put = session._Session.put

    def recording_put(session, source, variable):
        seen.append(mapped(path))
        return put(session, source, variable)

    monkeypatch.setattr(session._Session, "put", recording_put)
    keras_hub.models.Backbone.from_preset(
        presets["transformers"], device_mesh={"batch": 2, "model": 4}
    )
    assert seen and not any(seen), seen
    assert safetensor_utils.safetensors.safe_open is safetensors.safe_open
    assert safetensor_utils.SafetensorLoader.port_weight is port_weight


def test_unconverted_safetensors_weights_are_read_slice_by_slice(presets, monkeypatch):
    """A tensor keras-hub's converter passes on without a hook goes from the
    file to each device's slice; the host never holds it whole."""
    reads = []
    read_slices = lazy_tensors.LazySafetensor.read_slices

    def recording_read_slices(tensor, indices, executor=None, dtype=None, **kw):
        values = read_slices(tensor, indices, executor, dtype, **kw)
        reads.extend((tensor.name, v.nbytes) for v in values)
        return values

    monkeypatch.setattr(
        lazy_tensors.LazySafetensor, "read_slices", recording_read_slices
    )
    backbone = keras_hub.models.Backbone.from_preset(
        presets["transformers"], device_mesh=mesh_of((1, 8)), strategy="tp"
    )
    embeddings = backbone.get_layer("token_embedding").embeddings
    assert embeddings.value.sharding.num_devices == 8
    sizes = [nbytes for name, nbytes in reads if name == "model.embed_tokens.weight"]
    assert len(sizes) == 8
    assert max(sizes) < embeddings.value.nbytes
    assert sum(sizes) == embeddings.value.nbytes


def test_safetensors_file_reads_large_tensors_in_blocks(presets, tmp_path, monkeypatch):
    """Tensors read block by block are bitwise those `safe_open` reads."""
    monkeypatch.setattr(file_reads, "READ_CHUNK_BYTES", 100)
    extra = str(tmp_path / "extra.safetensors")
    rng = np.random.default_rng(1)
    safetensors.numpy.save_file(
        {
            "bf16": rng.standard_normal((7, 5)).astype(ml_dtypes.bfloat16),
            "int8": rng.integers(-9, 9, (30, 2, 3)).astype("int8"),
            "vector": rng.standard_normal(50).astype("float32"),
            "scalar": np.array(3.0, "float32"),
            "empty": np.zeros((0, 4), "float32"),
        },
        extra,
    )
    for path in (os.path.join(presets["transformers"], "model.safetensors"), extra):
        with (
            lazy_tensors.SafetensorsFile(path) as file,
            safetensors.safe_open(path, framework="np") as reference,
        ):
            assert file.keys() == list(reference.keys())
            for name in reference.keys():
                expected = reference.get_tensor(name)
                values = file.get_tensor(name)
                assert values.dtype == expected.dtype, name
                assert values.shape == expected.shape, name
                assert values.tobytes() == expected.tobytes(), name
