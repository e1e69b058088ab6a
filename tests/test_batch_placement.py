"""A drawn batch is placed as Keras places it, once per `*_on_batch` call,
and afresh for every batch a loop draws."""

import jax
import keras
import numpy as np
import pytest

import keras_hub_autodist
from keras_hub_autodist.training import batch_placement

MESH = {"batch": 2, "model": 4}


@pytest.fixture
def bound_lm(tiny_presets_dir):
    import keras_hub

    lm = keras_hub.models.CausalLM.from_preset(
        tiny_presets_dir["gemma_mqa"], preprocessor=None, device_mesh=MESH
    )
    lm.compile(optimizer=keras.optimizers.SGD(1e-2))
    return lm


def _batch(lm, rows=4, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, lm.backbone.vocabulary_size, (rows, 8)).astype("int32")
    return {"token_ids": ids, "padding_mask": np.ones_like(ids)}, np.roll(ids, 1, 1)


def _counting_puts(monkeypatch) -> list:
    placed = []
    put = jax.device_put

    def counting(value, *args, **kwargs):
        placed.append(id(value))
        return put(value, *args, **kwargs)

    monkeypatch.setattr(batch_placement.jax, "device_put", counting)
    return placed


def test_an_on_batch_call_places_each_array_once(tiny_presets_dir, monkeypatch):
    lm = _one_device_lm(tiny_presets_dir)
    x, y = _batch(lm)
    lm.train_on_batch(x, y)
    placed = _counting_puts(monkeypatch)
    lm.train_on_batch(x, y)
    # Keras draws the batch twice, to build the model, then for the step:
    # the token ids, the padding mask and the labels are placed once each.
    assert len(placed) == len(set(placed)) == 3


def _one_device_lm(tiny_presets_dir):
    import keras_hub

    one_device = keras.distribution.DeviceMesh(
        (1, 1), ("batch", "model"), jax.devices()[:1]
    )
    lm = keras_hub.models.CausalLM.from_preset(
        tiny_presets_dir["gemma_mqa"], preprocessor=None, device_mesh=one_device
    )
    lm.compile(optimizer=keras.optimizers.SGD(1e-1))
    return lm


def test_arrays_refilled_in_place_between_calls_are_placed_again(tiny_presets_dir):
    drawn = [_batch(_Vocabulary, seed=seed) for seed in range(3)]
    fresh, refilled = _one_device_lm(tiny_presets_dir), _one_device_lm(tiny_presets_dir)
    x, y = _batch(_Vocabulary)
    for batch_x, batch_y in drawn:
        fresh.train_on_batch(batch_x, batch_y)
        for key in x:  # one set of arrays, refilled for each call
            x[key][...] = batch_x[key]
        y[...] = batch_y
        refilled.train_on_batch(x, y)
    for actual, wanted in zip(refilled.trainable_weights, fresh.trainable_weights):
        np.testing.assert_array_equal(np.asarray(actual), np.asarray(wanted))


def test_a_batch_is_placed_as_keras_places_it(bound_lm):
    x, _ = _batch(bound_lm)
    distribution = keras_hub_autodist.distribution_of(bound_lm)[0]
    layout = distribution.get_data_layout(x["token_ids"].shape)
    placed = batch_placement.place(x["token_ids"], layout, None)
    assert placed.sharding == layout.backend_layout
    np.testing.assert_array_equal(np.asarray(placed), x["token_ids"])
    assert batch_placement.place(None, None, None) is None


class _Vocabulary:
    """What `_batch` reads of a model, without one."""

    class backbone:
        vocabulary_size = 256
