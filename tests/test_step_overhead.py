"""A bound model's step costs the host nothing per batch beyond keras-hub's.

Keras asks for its compiled step before every batch and calls
`train_on_batch` once per batch. Walking every variable of the model on each
of those calls (to place the state, or to keep a copy to restore after an
error) costs milliseconds per step on a real model. The state is placed
when a step is made, and kept from the start only by the loops that take the
values off the variables (`fit`, `evaluate`, `predict`); a step records the
state it receives. These tests count the walks; the time itself is measured
by the benchmark, never here.
"""

import keras
import keras_hub
import numpy as np
import pytest
import tiny_presets

import keras_hub_autodist
from keras_hub_autodist.training import binding
from keras_hub_autodist.training import keeping

MESH = {"batch": 4, "model": 2}


@pytest.fixture(scope="module")
def preset(tiny_presets_dir):
    return tiny_presets_dir["gemma_mqa"]


def data(preset, count):
    info = keras_hub_autodist.reading.presets.read_preset_config(preset)
    x = tiny_presets.token_batch(count, info.config["vocabulary_size"], 8)
    return x, np.roll(x["token_ids"], -1, axis=1)


def causal_lm(preset):
    lm = keras_hub.models.CausalLM.from_preset(
        preset, preprocessor=None, device_mesh=MESH
    )
    lm.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return lm


@pytest.fixture
def walks(monkeypatch):
    """How often the bound methods placed the state and read every variable
    of a group, by what."""
    counts = {"place_state": 0, "variable_groups": 0}
    place_state, group = binding.place_state, keeping._group

    def counted_place_state(*args, **kwargs):
        counts["place_state"] += 1
        return place_state(*args, **kwargs)

    def counted_group(*args, **kwargs):
        counts["variable_groups"] += 1
        return group(*args, **kwargs)

    monkeypatch.setattr(binding, "place_state", counted_place_state)
    monkeypatch.setattr(keeping, "_group", counted_group)
    return counts


@pytest.mark.parametrize(
    "method", ["train_on_batch", "test_on_batch", "predict_on_batch"]
)
def test_a_made_step_walks_no_variable_on_later_batches(preset, walks, method):
    lm = causal_lm(preset)
    x, y = data(preset, 8)
    call = {
        "train_on_batch": lambda: lm.train_on_batch(x, y),
        "test_on_batch": lambda: lm.test_on_batch(x, y),
        "predict_on_batch": lambda: lm.predict_on_batch(x),
    }[method]
    walks.update(place_state=0)  # `compile` placed its optimizer's state
    call()  # makes the step: the state is placed once
    assert walks["place_state"] == 1
    walks.update(place_state=0, variable_groups=0)
    for _ in range(3):
        call()
    assert walks == {"place_state": 0, "variable_groups": 0}


def test_a_new_step_after_compile_places_the_new_state(preset, walks):
    lm = causal_lm(preset)
    x, y = data(preset, 8)
    lm.train_on_batch(x, y)
    lm.compile(  # a new optimizer: its variables are placed with the new step
        optimizer=keras.optimizers.SGD(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    walks.update(place_state=0)
    lm.train_on_batch(x, y)
    assert walks["place_state"] >= 1
    mesh_devices = len(keras.distribution.list_devices())
    for variable in lm.optimizer.variables:
        assert len(variable.value.sharding.device_set) == mesh_devices, variable.path


def test_a_fit_keeps_its_start_once_not_per_batch(preset, walks):
    lm = causal_lm(preset)
    x, y = data(preset, 32)
    lm.fit(x, y, batch_size=8, epochs=1, verbose=0)  # makes the step
    walks.update(place_state=0, variable_groups=0)
    lm.fit(x, y, batch_size=8, epochs=2, verbose=0)  # 8 batches
    assert walks["place_state"] == 0
    # The state at the start, one read of each of the four groups.
    assert walks["variable_groups"] == 4
