"""A partial last batch of arrays trains and predicts like one device
(tests/test_batches.py pads tf.data batches and checks the padding)."""

import numpy as np
import pytest
from test_batches import MESH
from test_batches import assert_same_weights
from test_batches import causal_lm
from test_batches import data
from test_batches import preset  # noqa: F401 (a fixture)
from test_batches import weights

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
