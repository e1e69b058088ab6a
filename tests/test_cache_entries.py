"""Disk cache entries: served only when they answer the request, healed when
not, and readable by every user the umask allows."""

import json
import os

import keras
import keras_hub
import pytest
from test_abstract_cache import _preset

import keras_hub_autodist
from keras_hub_autodist.planning import abstract
from keras_hub_autodist.reading import disk_cache

CONFIG = dict(
    vocabulary_size=64,
    num_layers=2,
    num_query_heads=4,
    num_key_value_heads=2,
    hidden_dim=16,
    intermediate_dim=32,
)
MESH = {"batch": 2, "model": 4}


def _shapes(preset):
    return {row.path: row.shape for row in keras_hub_autodist.plan(preset, MESH).rows}


def _layouts(preset):
    import keras

    mesh = keras.distribution.DeviceMesh(
        tuple(MESH.values()), tuple(MESH), keras.distribution.list_devices()
    )
    layout_map = keras_hub_autodist.get_layout_map(preset, mesh)
    return {key: tuple(layout.axes) for key, layout in layout_map.items()}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv(disk_cache.CACHE_ENV, str(folder))
    return folder


def _only_entry(cache):
    (path,) = cache.glob(f"{abstract.CACHE_KIND}-*.json")
    return path


def _older_format(variables, entry_text, other_text):
    """A list of rows, as entries were before they recorded their key; odd
    sizes, which no mesh axis divides."""
    return json.dumps(
        [[v.path, [size + 1 for size in v.shape], v.dtype] for v in variables]
    )


def _other_configs_entry(variables, entry_text, other_text):
    return other_text


def _edited_shape(variables, entry_text, other_text):
    entry = json.loads(entry_text)
    entry["value"][0][1] = [size + 1 for size in entry["value"][0][1]]
    return json.dumps(entry)


@pytest.mark.parametrize("stale", [_older_format, _other_configs_entry, _edited_shape])
def test_a_stale_entry_is_not_served_and_is_rewritten(tmp_path, cache, stale):
    """Valid JSON with other shapes is served neither by `plan()` nor by
    `get_layout_map()`; the build that replaces it rewrites it."""
    config = {**CONFIG, "intermediate_dim": 40}
    preset = _preset(tmp_path / "llama", config)
    other = _preset(tmp_path / "other", {**CONFIG, "intermediate_dim": 24})
    _shapes(other)
    other_text = _only_entry(cache).read_text()
    _only_entry(cache).unlink()
    expected, expected_layouts = _shapes(preset), _layouts(preset)
    path = _only_entry(cache)
    entry_text = path.read_text()
    variables = abstract.model_variables(keras_hub.models.LlamaBackbone, config)
    text = stale(variables, entry_text, other_text)
    path.write_text(text)
    assert _shapes(preset) == expected
    assert path.read_text() == entry_text
    path.write_text(text)
    assert _layouts(preset) == expected_layouts
    assert path.read_text() == entry_text


def test_an_entry_records_what_it_answers(tmp_path, cache):
    config = {**CONFIG, "hidden_dim": 24}
    abstract.model_variables(keras_hub.models.LlamaBackbone, config)
    entry = json.loads(_only_entry(cache).read_text())
    assert entry["format"] == disk_cache.ENTRY_FORMAT
    assert entry["kind"] == abstract.CACHE_KIND
    assert entry["key"] == abstract._variables_key("LlamaBackbone", config)
    assert entry["key"].startswith("LlamaBackbone|")
    # The config, and the global dtype policy it is built in (it names none).
    config_text, _, policy = entry["key"].partition("|")[2].rpartition("|")
    assert json.loads(config_text) == config
    assert policy == f"global_dtype_policy={keras.config.dtype_policy().name}"
    assert set(entry["versions"]) == {"keras", "keras-hub"}


@pytest.mark.parametrize("corrupt", ["", "not json", '{"format": 2', "[5]"])
def test_a_corrupt_entry_is_rewritten_by_the_next_plan(tmp_path, cache, corrupt):
    preset = _preset(tmp_path / "llama", {**CONFIG, "intermediate_dim": 56})
    expected = _shapes(preset)
    path = _only_entry(cache)
    entry_text = path.read_text()
    path.write_text(corrupt)
    assert _shapes(preset) == expected
    assert path.read_text() == entry_text
    assert list(cache.glob("*.tmp")) == []


def test_a_sound_entry_is_not_rewritten(tmp_path, cache):
    preset = _preset(tmp_path / "llama", {**CONFIG, "intermediate_dim": 64})
    _shapes(preset)
    path = _only_entry(cache)
    os.utime(path, ns=(0, 0))
    _shapes(preset)
    abstract.model_variables(
        keras_hub.models.LlamaBackbone, {**CONFIG, "intermediate_dim": 64}
    )
    assert path.stat().st_mtime_ns == 0


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_entries_follow_the_umask(tmp_path, cache, umask):
    previous = os.umask(umask)
    try:
        config = {**CONFIG, "hidden_dim": 32, "intermediate_dim": 8 + umask}
        abstract.model_variables(keras_hub.models.LlamaBackbone, config)
        disk_cache.store("conversion", json.dumps({"umask": umask}), {"class": "X"})
    finally:
        os.umask(previous)
    files = list(cache.glob("*.json"))
    assert len(files) == 2
    for path in files:
        assert path.stat().st_mode & 0o777 == 0o666 & ~umask, path.name
