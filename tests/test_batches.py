"""Batches that don't divide the batch axis: padded, or refused before a step.

10 samples in batches of 4 on a batch axis of 4 end with a batch of 2: a
bound keras-hub Task pads it with zero-weight rows, and the trained weights
equal a single-device run.
"""

import warnings

import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf
import tiny_presets

import keras_hub_autodist
from keras_hub_autodist import BatchSizeError
from keras_hub_autodist.training.batches import pad_batch
from keras_hub_autodist.training.batches import requested_rows
from keras_hub_autodist.training.padded_steps import unmarked

MESH = {"batch": 4, "model": 2}
PRESET = "gemma_mqa"


def data(preset, count, seed=0):
    info = keras_hub_autodist.reading.presets.read_preset_config(preset)
    x = tiny_presets.token_batch(count, info.config["vocabulary_size"], seed=seed)
    return x, np.roll(x["token_ids"], -1, axis=1)


def causal_lm(preset, **mesh):
    lm = keras_hub.models.CausalLM.from_preset(preset, preprocessor=None, **mesh)
    lm.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return lm


def weights(lm):
    return {w.path: np.asarray(w.value) for w in lm.backbone.weights}


def assert_same_weights(got, expected):
    assert got.keys() == expected.keys()
    for path, value in got.items():
        np.testing.assert_allclose(value, expected[path], atol=1e-5, err_msg=path)


@pytest.fixture(scope="module")
def preset(tiny_presets_dir):
    return tiny_presets_dir[PRESET]


def test_pad_batch_zeroes_padding_and_marks_the_real_rows():
    x, y, w = pad_batch((np.arange(6.0).reshape(2, 3), np.ones(2)), 4)
    assert x.shape == (4, 3) and y.shape == (4,)
    np.testing.assert_array_equal(x[3], x[1])
    weights, real = unmarked(w)
    np.testing.assert_array_equal(weights, [1, 1, 0, 0])  # not scaled
    np.testing.assert_array_equal(real, [1, 1, 0, 0])
    user = np.array([[1.0, 0.5], [0.0, 1.0], [1.0, 1.0]])
    _, _, w = pad_batch((np.ones((3, 2)), np.ones((3, 2)), user), 2)
    weights, real = unmarked(w)
    np.testing.assert_array_equal(weights, [[1, 0.5], [0, 1], [1, 1], [0, 0]])
    np.testing.assert_array_equal(real, [1, 1, 1, 0])  # a real row of weight 0


def test_the_rows_a_fit_asks_for_are_read_before_any_padding():
    x = {"token_ids": np.ones((10, 3))}
    assert requested_rows("fit", (x,), {"batch_size": 4}) == 4
    assert requested_rows("fit", (x, None, 3), {}) == 3  # positional
    assert requested_rows("fit", (), {"x": x}) == 10  # Keras' 32, capped
    exact = tf.data.Dataset.from_tensor_slices(x).batch(2, drop_remainder=True)
    assert requested_rows("fit", (exact,), {"batch_size": 4}) == 2
    unknown = tf.data.Dataset.from_tensor_slices(x).batch(2)  # (None, 3)
    assert requested_rows("fit", (unknown,), {}) is None
    assert requested_rows("fit", (), {}) is None


def test_fit_tf_data_without_drop_remainder_and_partial_validation(preset):
    x, y = data(preset, 10)
    vx, vy = data(preset, 6, seed=1)
    results, models = [], []
    for mesh in ({}, {"device_mesh": MESH}):
        lm = causal_lm(preset, **mesh)
        models.append(lm)
        history = lm.fit(
            tf.data.Dataset.from_tensor_slices((x, y)).batch(4),
            validation_data=(vx, vy),
            batch_size=None,
            epochs=1,
            verbose=0,
        )
        results.append((weights(lm), history.history))
    assert_same_weights(results[1][0], results[0][0])
    assert np.isfinite(results[1][1]["val_loss"][0])
    # predict on a dataset with a partial batch: its padded rows are dropped.
    np.testing.assert_allclose(
        models[1].predict(tf.data.Dataset.from_tensor_slices(vx).batch(4), verbose=0),
        models[0](vx),
        atol=1e-5,
    )


def test_generate_inputs_by_keyword(preset):
    lm = keras_hub.models.GemmaCausalLM.from_preset(preset, device_mesh=MESH)
    lm.compile(sampler="greedy")
    prompts = ["the quick brown", "a mesh has", "the quick"]
    with pytest.warns(UserWarning, match="3 prompts are padded to 4") as said:
        by_keyword = lm.generate(inputs=prompts, max_length=6)
        assert by_keyword == lm.generate(prompts, max_length=6)
    assert len([w for w in said if "padded" in str(w.message)]) == 1  # once
    assert len(by_keyword) == 3


def test_padding_a_fit_is_said_once_with_its_sizes(preset):
    lm = causal_lm(preset, device_mesh=MESH)
    x, y = data(preset, 6)
    with pytest.warns(
        keras_hub_autodist.PaddingWarning,
        match=r"fit: batches of 6 rows are padded to 8",
    ) as said:
        lm.fit(x, y, batch_size=6, epochs=1, verbose=0)
    # It names the user's line, not one inside keras or this package.
    assert [w.filename for w in said if "padded" in str(w.message)] == [__file__]
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        lm.fit(x, y, batch_size=6, epochs=1, verbose=0)
    assert not [w for w in again if "padded" in str(w.message)]  # said already


def test_backbone_partial_validation_fails_before_training(preset):
    backbone = keras_hub.models.Backbone.from_preset(preset, device_mesh=MESH)
    backbone.compile(optimizer="sgd", loss="mse")
    x, _ = data(preset, 8)
    vx, _ = data(preset, 6, seed=1)
    hidden = backbone.hidden_dim

    def target(n):
        return np.zeros((n, 8, hidden), "float32")

    before = {w.path: np.asarray(w.value) for w in backbone.weights}
    with pytest.raises(
        BatchSizeError,
        match=r"last batch of 6 samples in batches of 4: 2 does not divide by the "
        r"batch axis 'batch' of size 4\. Use a batch size that is a multiple of 4.*"
        r"Received: fit\(validation_data=\.\.\.\) with batch size 2",
    ):
        backbone.fit(
            x, target(8), batch_size=4, validation_data=(vx, target(6)), verbose=0
        )
    after = {w.path: np.asarray(w.value) for w in backbone.weights}
    assert_same_weights(after, before)
