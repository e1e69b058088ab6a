"""The abstract build: nothing allocated, cached in memory and on disk."""

import json
import os
import subprocess
import sys
import textwrap

import jax
import keras_hub
import pytest
from real_presets import REAL_PRESETS

import keras_hub_autodist
from keras_hub_autodist.architectures.llama import LLAMA
from keras_hub_autodist.architectures.weight import Weight
from keras_hub_autodist.planning import abstract
from keras_hub_autodist.planning.shapes import architecture_weights
from keras_hub_autodist.reading import disk_cache

CONFIG = dict(
    vocabulary_size=64,
    num_layers=2,
    num_query_heads=4,
    num_key_value_heads=2,
    hidden_dim=16,
    intermediate_dim=32,
)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _preset(folder, config):
    folder.mkdir()
    (folder / "config.json").write_text(
        json.dumps(
            {
                "module": "keras_hub.src.models.llama.llama_backbone",
                "class_name": "LlamaBackbone",
                "config": config,
                "registered_name": "keras_hub>LlamaBackbone",
            }
        )
    )
    return str(folder)


def test_abstract_build_allocates_nothing_and_leaves_no_pending_variables():
    before = _live_array_ids()
    variables = abstract.model_variables(keras_hub.models.LlamaBackbone, CONFIG)
    # Earlier tests' arrays may be collected meanwhile; none may appear.
    assert not _live_array_ids() - before
    shapes = {v.path: v.shape for v in variables}
    assert shapes["transformer_layer_1/self_attention/key/kernel"] == (16, 2, 4)
    # Keras would initialize deferred variables at the next stateless scope.
    import keras

    with keras.StatelessScope():
        pass
    assert not _live_array_ids() - before


def _live_array_ids():
    return {id(array) for array in jax.live_arrays()}


def test_a_later_process_plans_from_the_disk_cache_without_keras(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    preset = _preset(tmp_path / "llama", {**CONFIG, "intermediate_dim": 48})
    monkeypatch.setenv(disk_cache.CACHE_ENV, str(cache))
    expected = keras_hub_autodist.plan(preset, {"batch": 2, "model": 4})
    env = {**os.environ, "PYTHONPATH": ROOT}
    assert len(list(cache.glob("*.json"))) == 1
    code = textwrap.dedent(
        f"""
        import sys
        import keras_hub_autodist
        plan = keras_hub_autodist.plan({preset!r}, {{"batch": 2, "model": 4}})
        print([(r.path, r.shape, r.spec) for r in plan.rows])
        print("keras imported:", "keras" in sys.modules)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows, imported = done.stdout.strip().splitlines()[-2:]
    assert rows == str([(r.path, r.shape, r.spec) for r in expected.rows])
    assert imported == "keras imported: False"


def test_an_unreadable_cache_file_is_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv(disk_cache.CACHE_ENV, str(tmp_path))
    config = {**CONFIG, "hidden_dim": 24}
    path = disk_cache._disk_file(
        abstract.CACHE_KIND, abstract._variables_key("LlamaBackbone", config)
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    # Not JSON, or JSON of another shape (an older format, a truncated row).
    for text in ["not json", '{"rows": 1}', "[5]", '[["a/kernel", [2, "x"], "f"]]']:
        path.write_text(text)
        assert abstract.stored_variables("LlamaBackbone", config) is None, text
    weights = architecture_weights(LLAMA, config, keras_hub.models.LlamaBackbone)
    assert len(weights) == 21


def test_a_build_stored_by_other_keras_versions_is_not_read(tmp_path, monkeypatch):
    """An upgrade of keras or keras-hub may build other variables."""
    monkeypatch.setenv(disk_cache.CACHE_ENV, str(tmp_path))
    config = {**CONFIG, "hidden_dim": 32}
    built = abstract.model_variables(keras_hub.models.LlamaBackbone, config)
    assert abstract.stored_variables("LlamaBackbone", config) == built
    installed = {name: disk_cache._version(name) for name in ["keras", "keras-hub"]}
    for upgraded in installed:
        versions = {**installed, upgraded: installed[upgraded] + ".post1"}
        monkeypatch.setattr(disk_cache, "_version", versions.__getitem__)
        assert abstract.stored_variables("LlamaBackbone", config) is None, upgraded


@pytest.mark.parametrize("value", ["off", "0", "false"])
def test_the_disk_cache_can_be_turned_off(tmp_path, monkeypatch, value):
    monkeypatch.setenv(disk_cache.CACHE_ENV, value)
    assert disk_cache.cache_folder() is None
    config = {**CONFIG, "hidden_dim": 40}
    abstract.model_variables(keras_hub.models.LlamaBackbone, config)
    assert abstract.stored_variables("LlamaBackbone", config) is None


def test_a_config_that_is_not_plain_json_is_cached_in_memory_only(
    tmp_path, monkeypatch
):
    import keras

    monkeypatch.setenv(disk_cache.CACHE_ENV, str(tmp_path))
    config = {**CONFIG, "hidden_dim": 56, "dtype": keras.DTypePolicy("float32")}
    assert abstract._variables_key("LlamaBackbone", config) is None
    first = abstract.model_variables(keras_hub.models.LlamaBackbone, config)
    misses = abstract._cached_variables.cache_info().misses
    again = abstract.model_variables(keras_hub.models.LlamaBackbone, dict(config))
    assert again == first
    assert abstract._cached_variables.cache_info().misses == misses
    assert not list(tmp_path.glob("*.json"))


def test_quantization_scales_of_planned_weights_are_replicated():
    kernel = Weight(
        "transformer_layer_0/feedforward_output_dense/kernel",
        shape=(32, 16),
        dtype="int8",
    )
    scale = Weight(
        "transformer_layer_0/feedforward_output_dense/kernel_scale",
        shape=(16,),
        dtype="float32",
    )
    orphan = Weight("lonely/kernel_scale", shape=(16,), dtype="float32")
    specs = LLAMA.match_variables([kernel, scale], "LlamaBackbone")
    assert specs[1].logical_axes == ("unsharded",)
    with pytest.raises(Exception, match=r"lonely/kernel_scale \(16,\)"):
        LLAMA.match_variables([kernel, orphan], "LlamaBackbone")


def test_a_keras_hub_conversion_is_reused_by_a_later_process(tmp_path, monkeypatch):
    """Mixtral has no keras-free conversion: keras-hub converts its config
    once, and a later process plans it from the disk cache without keras."""
    cache = tmp_path / "cache"
    monkeypatch.setenv(disk_cache.CACHE_ENV, str(cache))
    preset = str(REAL_PRESETS / "mixtral_8x7b")
    expected = keras_hub_autodist.plan(preset, {"batch": 2, "model": 4})
    assert {p.name.split("-")[0] for p in cache.glob("*.json")} == {
        "conversion",
        abstract.CACHE_KIND,
    }
    code = textwrap.dedent(
        f"""
        import sys
        import keras_hub_autodist
        plan = keras_hub_autodist.plan({preset!r}, {{"batch": 2, "model": 4}})
        print(plan.architecture, plan.max_device_bytes)
        print("keras imported:", "keras" in sys.modules)
        """
    )
    env = {**os.environ, "PYTHONPATH": ROOT}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    planned, imported = done.stdout.strip().splitlines()[-2:]
    assert planned == f"mixtral {expected.max_device_bytes}"
    assert imported == "keras imported: False"


def test_a_build_read_from_disk_is_refused_like_a_fresh_one(tmp_path, monkeypatch):
    """Both go through `Architecture.weights_from`: the family's config
    check applies to a build another process stored."""
    import tiny_presets

    from keras_hub_autodist.architectures.gemma3 import GEMMA3
    from keras_hub_autodist.errors import UnsupportedArchitectureError
    from keras_hub_autodist.planning.options import PlanOptions
    from keras_hub_autodist.planning.shapes import validated_weights
    from keras_hub_autodist.reading.configs import PresetConfig

    monkeypatch.setenv(disk_cache.CACHE_ENV, str(tmp_path))
    config = {
        **tiny_presets.GEMMA3_TEXT,
        "is_embedding_model": True,
        "embedding_dim": 16,
        "pooling_intermediate_dim": 32,
    }
    abstract.model_variables(keras_hub.models.Gemma3Backbone, config)
    assert abstract.stored_variables("Gemma3Backbone", config) is not None
    # As a process that has not imported keras-hub reads the preset.
    info = PresetConfig("./embedder", None, config, "keras", "Gemma3Backbone")
    with pytest.raises(UnsupportedArchitectureError, match="embedding models"):
        validated_weights(GEMMA3, info, GEMMA3.config_fields, PlanOptions())


def test_a_load_plans_from_an_earlier_processes_build_on_disk(tmp_path, monkeypatch):
    """`from_preset` plans keras-hub's own classes from the disk, as the
    CLI does; a user's subclass of the same name is built."""
    monkeypatch.setenv(disk_cache.CACHE_ENV, str(tmp_path))
    config = {**CONFIG, "hidden_dim": 40}
    built = abstract.model_variables(keras_hub.models.LlamaBackbone, config)
    abstract.clear_cache()  # as in a later process
    builds = []
    cached_variables = abstract._cached_variables

    def counted(*args):
        builds.append(args[0])
        return cached_variables(*args)

    monkeypatch.setattr(abstract, "_cached_variables", counted)
    assert abstract.model_variables(keras_hub.models.LlamaBackbone, config) == built
    assert builds == []

    class LlamaBackbone(keras_hub.models.LlamaBackbone):
        pass

    abstract.model_variables(LlamaBackbone, config)
    assert builds == [LlamaBackbone]
