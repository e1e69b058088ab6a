"""A partial last batch of arrays trains and predicts like one device, and
its loss, metrics and logged values are one device's (tests/test_batches.py
pads tf.data batches and checks the padding)."""

import warnings

import numpy as np
import pytest
from test_batches import MESH
from test_batches import assert_same_weights
from test_batches import causal_lm
from test_batches import data
from test_batches import preset  # noqa: F401 (a fixture)
from test_batches import weights
from test_padding_exact import causal_lm as metered_lm

from keras_hub_autodist import PaddingWarning

pytestmark = pytest.mark.slow


def test_arrays_with_a_partial_last_batch_match_single_device(preset):  # noqa: F811
    x, y = data(preset, 10)
    single = causal_lm(preset)
    sharded = causal_lm(preset, device_mesh=MESH)
    for lm in (single, sharded):
        lm.fit(x, y, batch_size=4, epochs=1, verbose=0)
    assert_same_weights(weights(sharded), weights(single))
    # One batch of 6 on a batch axis of 4: the same loss and update.
    x6, y6 = data(preset, 6, seed=2)
    losses = [
        lm.train_on_batch(x6, y6, return_dict=True)["loss"] for lm in (single, sharded)
    ]
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)
    assert_same_weights(weights(sharded), weights(single))
    # predict: 10 rows back, the padded ones dropped.
    np.testing.assert_allclose(
        sharded.predict(x, batch_size=4, verbose=0), single(x), atol=1e-5
    )


def rows(batch, count):
    return {key: value[:count] for key, value in batch.items()}


def results(lm, x, y, weights):
    """What a user reads off each method, on an uneven epoch."""
    by_weight = {} if weights is None else {"sample_weight": weights}
    first = {} if weights is None else {"sample_weight": weights[:3]}
    return {
        "evaluate": lm.evaluate(
            x, y, batch_size=4, verbose=0, return_dict=True, **by_weight
        ),
        "fit": lm.fit(x, y, batch_size=4, epochs=2, verbose=0, **by_weight).history,
        "test_on_batch": lm.test_on_batch(rows(x, 3), y[:3], return_dict=True, **first),
        "train_on_batch": lm.train_on_batch(
            rows(x, 3), y[:3], return_dict=True, **first
        ),
        "weights": [np.asarray(w) for w in lm.get_weights()],
    }


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
def test_an_uneven_epoch_equals_one_device(preset, weighted):  # noqa: F811
    x, y = data(preset, 10)
    weights = None
    if weighted:
        weights = np.random.default_rng(1).uniform(size=y.shape).astype("float32")
        weights[1] = 0.0  # a real row of weight 0 still counts as a row
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PaddingWarning)
        one = results(metered_lm(preset), x, y, weights)
        mesh = results(metered_lm(preset, device_mesh=MESH), x, y, weights)
    for key in ("evaluate", "fit", "test_on_batch", "train_on_batch"):
        assert mesh[key].keys() == one[key].keys(), key
        for name in one[key]:
            np.testing.assert_allclose(
                mesh[key][name], one[key][name], atol=1e-5, err_msg=f"{key} {name}"
            )
    for got, expected in zip(mesh["weights"], one["weights"]):
        np.testing.assert_allclose(got, expected, atol=1e-5)
