"""Configs and settings no real model has: each is refused with the package's
error, naming what it received, before anything is built."""

import json
import shutil

import keras_hub
import pytest
from real_presets import REAL_PRESETS

import keras_hub_autodist
from keras_hub_autodist.errors import ConfigError
from keras_hub_autodist.errors import MeshError
from keras_hub_autodist.errors import PresetError

MESH = {"batch": 2, "model": 4}


@pytest.fixture
def gemma_copy(tmp_path):
    folder = tmp_path / "gemma_2b"
    shutil.copytree(REAL_PRESETS / "gemma_2b", folder)
    return folder


@pytest.mark.parametrize("contents", ["null", "[1, 2]", "7"])
def test_a_config_that_is_not_an_object_is_a_config_error(gemma_copy, contents):
    (gemma_copy / "config.json").write_text(contents)
    with pytest.raises(ConfigError, match=r"config\.json` at .* holds .*not a JSON"):
        keras_hub_autodist.plan(str(gemma_copy), MESH)


def test_from_preset_refuses_a_null_config(tiny_presets_dir, tmp_path):
    folder = tmp_path / "null_config"
    shutil.copytree(tiny_presets_dir["gemma_mqa"], folder)
    (folder / "config.json").write_text("null")
    with pytest.raises(ConfigError, match=r"holds null, not a JSON object"):
        keras_hub.models.GemmaCausalLM.from_preset(str(folder), device_mesh=MESH)


def test_a_config_that_is_not_utf8_names_the_file(gemma_copy):
    path = gemma_copy / "config.json"
    path.write_bytes(b'{"model_type": "gemma", "name": "\xff\xfe"}')
    with pytest.raises(PresetError, match=rf"{path}.* is not UTF-8"):
        keras_hub_autodist.plan(str(gemma_copy), MESH)


def test_a_config_that_is_not_json_names_the_file(gemma_copy):
    path = gemma_copy / "config.json"
    path.write_text("{not json")
    with pytest.raises(PresetError, match=rf"{path} is not valid JSON"):
        keras_hub_autodist.plan(str(gemma_copy), MESH)


@pytest.mark.parametrize(
    "field, value", [("num_hidden_layers", 10**6), ("hidden_size", 2**40)]
)
def test_sizes_beyond_any_model_are_refused_before_building(gemma_copy, field, value):
    path = gemma_copy / "config.json"
    config = json.loads(path.read_text())
    config[field] = value
    path.write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=rf"`\w+={value}`, more than the"):
        keras_hub_autodist.plan(str(gemma_copy), MESH)


@pytest.mark.parametrize(
    "name, value",
    [
        ("KERAS_HUB_AUTODIST_DEVICE_MEMORY_GIB", "1e300"),
        ("KERAS_HUB_AUTODIST_DEVICE_MEMORY_GB", "1e300"),
        ("KERAS_HUB_AUTODIST_DEVICE_MEMORY_GIB", "inf"),
    ],
)
def test_device_memory_from_the_environment_is_bounded(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(MeshError, match=rf"Received: {name}='{value}'"):
        keras_hub_autodist.plan(str(REAL_PRESETS / "gemma_2b"), MESH)


def test_device_memory_environment_units(monkeypatch):
    preset = str(REAL_PRESETS / "gemma_2b")
    monkeypatch.setenv("KERAS_HUB_AUTODIST_DEVICE_MEMORY_GIB", "16")
    assert keras_hub_autodist.plan(preset, MESH).device_memory_bytes == 16 * 1024**3
    monkeypatch.delenv("KERAS_HUB_AUTODIST_DEVICE_MEMORY_GIB")
    monkeypatch.setenv("KERAS_HUB_AUTODIST_DEVICE_MEMORY_GB", "16")
    assert keras_hub_autodist.plan(preset, MESH).device_memory_bytes == 16 * 10**9
