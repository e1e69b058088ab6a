"""A padded batch counts as its real rows: loss, metrics, logged values.

10 samples in batches of 4 on a batch axis of 4 end with a batch of 2,
padded to 4: `evaluate` equals one device's (every method, with and
without `sample_weight`: integration/test_partial_batches.py), and every
method that pads says so once.
"""

import warnings

import keras
import keras_hub
import numpy as np
import pytest
import tiny_presets

import keras_hub_autodist
from keras_hub_autodist.compat import steps as compat_steps

MESH = {"batch": 4, "model": 2}


@pytest.fixture(scope="module")
def preset(tiny_presets_dir):
    return tiny_presets_dir["gemma_mqa"]


def data(preset, count, seed=0):
    info = keras_hub_autodist.reading.presets.read_preset_config(preset)
    x = tiny_presets.token_batch(count, info.config["vocabulary_size"], seed=seed)
    return x, np.roll(x["token_ids"], -1, axis=1)


def causal_lm(preset, **mesh):
    lm = keras_hub.models.CausalLM.from_preset(preset, preprocessor=None, **mesh)
    lm.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=[keras.metrics.SparseCategoricalAccuracy()],
    )
    return lm


def test_a_padded_evaluate_equals_one_device_with_weights(preset):
    """The quick case of integration/test_partial_batches.py: every batch's
    loss and metrics weighed by its real rows, one of weight 0 included."""
    x, y = data(preset, 10)
    weights = np.random.default_rng(1).uniform(size=y.shape).astype("float32")
    weights[1] = 0.0  # a real row of weight 0 still counts as a row
    found = [
        causal_lm(preset, **mesh).evaluate(
            x, y, batch_size=4, sample_weight=weights, verbose=0, return_dict=True
        )
        for mesh in ({}, {"device_mesh": MESH})
    ]
    assert found[1].keys() == found[0].keys()
    for name, value in found[0].items():
        np.testing.assert_allclose(found[1][name], value, atol=1e-5, err_msg=name)


def test_the_loss_tracker_is_where_keras_keeps_it(preset):
    lm = causal_lm(preset, device_mesh=MESH)
    tracker = compat_steps.loss_tracker(lm)
    assert isinstance(tracker, keras.metrics.Mean) and tracker.name == "loss"
    assert tracker in lm.metrics


def test_every_method_that_pads_says_so_once(preset):
    lm = causal_lm(preset, device_mesh=MESH)
    x, y = data(preset, 3)
    calls = {
        "predict": lambda: lm.predict(x, verbose=0),
        "predict_on_batch": lambda: lm.predict_on_batch(x),
        "train_on_batch": lambda: lm.train_on_batch(x, y),
        "test_on_batch": lambda: lm.test_on_batch(x, y),
        "evaluate": lambda: lm.evaluate(x, y, verbose=0),
        "fit": lambda: lm.fit(x, y, verbose=0),
    }
    for method, call in calls.items():
        for attempt in range(2):
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                call()
            padded = [
                str(w.message)
                for w in said
                if issubclass(w.category, keras_hub_autodist.PaddingWarning)
            ]
            if attempt == 0:
                assert len(padded) == 1, (method, padded)
                assert padded[0].startswith(f"{method}: batches of 3 rows")
            else:
                assert padded == [], method  # once per model and method
