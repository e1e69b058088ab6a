"""Nothing the package does moves Python's, NumPy's or Keras' global random
streams: a model with dropout loaded after `set_random_seed` draws the
seeds keras-hub's own load draws, and trains to the same losses, whether
the package's disk cache is cold (it builds the model abstractly first) or
warm; planning and compiling a step leave every stream as it was."""

import random

import keras
import keras_hub
import numpy as np
import pytest
import tiny_presets

import keras_hub_autodist
from keras_hub_autodist.compat import state as compat_state
from keras_hub_autodist.planning import abstract

DROPOUT_GEMMA = {**tiny_presets.GEMMA_MQA, "dropout": 0.3}


@pytest.fixture(scope="module")
def dropout_preset(tmp_path_factory):
    return tiny_presets.save_preset(
        tmp_path_factory.mktemp("dropout") / "gemma",
        keras_hub.models.GemmaBackbone,
        DROPOUT_GEMMA,
        task_class=keras_hub.models.GemmaCausalLM,
    )


@pytest.fixture
def cold_cache(tmp_path, monkeypatch):
    """A fresh, empty disk cache, and nothing built in memory: the next plan
    builds its model abstractly."""
    monkeypatch.setenv("KERAS_HUB_AUTODIST_CACHE", str(tmp_path / "cache"))
    abstract.clear_cache()
    yield
    abstract.clear_cache()


def streams():
    """Python's, NumPy's and Keras' global random state, comparable."""
    name, keys, position, has_gauss, gauss = np.random.get_state()
    generator = compat_state.global_seed_generator_or_none()
    return (
        random.getstate(),
        (name, keys.tolist(), position, has_gauss, gauss),
        None if generator is None else np.asarray(generator.state.value).tolist(),
    )


def _load_and_train(preset, **kwargs):
    """From `set_random_seed(0)`: the streams after the load, and the losses
    of two training steps of the loaded model (its dropout on)."""
    keras.utils.set_random_seed(0)
    lm = keras_hub.models.CausalLM.from_preset(preset, preprocessor=None, **kwargs)
    after_load = streams()
    lm.compile(optimizer=keras.optimizers.SGD(0.1))
    x = tiny_presets.token_batch(8, DROPOUT_GEMMA["vocabulary_size"], 16)
    y = np.roll(x["token_ids"], -1, axis=1)
    losses = [float(lm.train_on_batch(x, y)[0]) for _ in range(2)]
    return after_load, losses


def test_a_load_draws_keras_hubs_seeds_with_a_cold_or_a_warm_cache(
    dropout_preset, cold_cache
):
    expected_streams, expected_losses = _load_and_train(dropout_preset)
    mesh = {"device_mesh": {"batch": 8}}
    for cache in ("cold", "warm"):
        loaded_streams, losses = _load_and_train(dropout_preset, **mesh)
        assert loaded_streams == expected_streams, cache
        np.testing.assert_allclose(losses, expected_losses, rtol=1e-5, err_msg=cache)


def _with_a_global_generator():
    """Seeded streams, Keras' global generator among them (made and drawn
    from, as an unseeded `keras.random` call does)."""
    keras.utils.set_random_seed(0)
    keras.random.uniform(())
    random.random()
    np.random.random()
    return streams()


def test_planning_leaves_every_stream_as_it_was(dropout_preset, cold_cache):
    before = _with_a_global_generator()
    keras_hub_autodist.plan(dropout_preset, {"batch": 2, "model": 4})
    assert streams() == before
    deeper = dict(DROPOUT_GEMMA, num_layers=3)
    config = {"class_name": "GemmaBackbone", "config": deeper}
    devices = keras.distribution.list_devices()
    mesh = keras.distribution.DeviceMesh((8,), ("batch",), devices)
    keras_hub_autodist.get_layout_map(config, mesh)
    assert streams() == before


def test_compiling_a_step_leaves_every_stream_as_it_was(dropout_preset, cold_cache):
    plan = keras_hub_autodist.plan(dropout_preset, {"batch": 2, "model": 4})
    before = _with_a_global_generator()
    keras_hub_autodist.compiled_memory(plan, 2, 16)
    assert streams() == before


def test_a_load_moves_the_streams_only_as_keras_hubs_own_load(
    dropout_preset, cold_cache
):
    # Keras' global generator in use: the load leaves it as keras-hub's does.
    _with_a_global_generator()
    keras_hub.models.CausalLM.from_preset(dropout_preset, preprocessor=None)
    expected = streams()
    _with_a_global_generator()
    keras_hub.models.CausalLM.from_preset(
        dropout_preset, preprocessor=None, device_mesh={"batch": 2, "model": 4}
    )
    assert streams() == expected
