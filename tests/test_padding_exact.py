"""A padded batch counts as its real rows: loss, metrics, logged values.

10 samples in batches of 4 on a batch axis of 4 end with a batch of 2,
padded to 4: `evaluate` equals one device's (every method, with and
without `sample_weight`: integration/test_partial_batches.py), and every
method that pads says so once. 5 rows in batches of 3 on a batch axis of 8
count as their real rows in every kind of metric `compile` takes, in
`evaluate`, `fit`'s history and the `*_on_batch` methods.
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


# Every kind of metric `compile` takes: unweighted (`metrics`: a name, an
# object, a loss as a metric) and weighted (`weighted_metrics`).
METRIC_KINDS = {
    "metrics": lambda: [
        "accuracy",
        keras.metrics.SparseCategoricalAccuracy(name="object_accuracy"),
        keras.metrics.SparseTopKCategoricalAccuracy(k=3, name="top3"),
        keras.metrics.SparseCategoricalCrossentropy(from_logits=True, name="xent"),
    ],
    "weighted_metrics": lambda: [
        keras.metrics.SparseCategoricalAccuracy(name="weighted_accuracy"),
        "sparse_categorical_crossentropy",
    ],
}


def every_metric_lm(preset, **mesh):
    lm = keras_hub.models.CausalLM.from_preset(preset, preprocessor=None, **mesh)
    lm.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        **{kind: make() for kind, make in METRIC_KINDS.items()},
    )
    return lm


def assert_same_values(found, expected, what):
    assert found.keys() == expected.keys(), what
    for name, value in expected.items():
        np.testing.assert_allclose(
            found[name], value, rtol=1e-4, atol=1e-5, err_msg=f"{what}: {name}"
        )


# 5 rows in batches of 3 on a batch axis of 8: every batch is padded.
UNEVEN_MESH = {"batch": 8}


def partly_right(preset, count, seed):
    """Inputs and labels the untrained model gets right on about half the
    tokens, unevenly across rows, so that every accuracy is far from 0 and
    1 and a padded row counted would move it."""
    x, _ = data(preset, count, seed=seed)
    lm = keras_hub.models.CausalLM.from_preset(preset, preprocessor=None)
    y = np.argmax(lm.predict(x, verbose=0), axis=-1).astype("int32")
    rng = np.random.default_rng(seed)
    wrong = rng.uniform(size=y.shape) < np.linspace(0.1, 0.9, count)[:, None]
    return x, np.where(wrong, (y + 1) % lm.backbone.vocabulary_size, y)


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
def test_every_metric_of_a_padded_evaluate_counts_real_rows(preset, weighted):
    """With the caller's sample weights too: unweighted metrics ignore them,
    as on one device, and still drop the padded rows."""
    x, y = partly_right(preset, 5, seed=3)
    weights = None
    if weighted:
        weights = np.random.default_rng(3).uniform(size=y.shape).astype("float32")
    one, bound = (
        every_metric_lm(preset, **mesh).evaluate(
            x, y, batch_size=3, sample_weight=weights, verbose=0, return_dict=True
        )
        for mesh in ({}, {"device_mesh": UNEVEN_MESH})
    )
    assert 0.2 < one["accuracy"] < 0.8, one
    assert_same_values(bound, one, "evaluate")


def test_every_logged_value_of_a_padded_fit_counts_real_rows(preset):
    x, y = partly_right(preset, 5, seed=4)
    validation = partly_right(preset, 5, seed=6)
    fit = {
        "batch_size": 3,
        "epochs": 2,
        "shuffle": False,
        "validation_data": validation,
        "validation_batch_size": 3,
        "verbose": 0,
    }
    one, bound = (
        every_metric_lm(preset, **mesh).fit(x, y, **fit).history
        for mesh in ({}, {"device_mesh": UNEVEN_MESH})
    )
    assert "val_accuracy" in one
    assert_same_values(
        {name: np.asarray(values) for name, values in bound.items()},
        {name: np.asarray(values) for name, values in one.items()},
        "fit history",
    )


def test_every_metric_of_a_padded_batch_method_counts_real_rows(preset):
    x, y = partly_right(preset, 3, seed=5)
    one, bound = (
        every_metric_lm(preset, **m) for m in ({}, {"device_mesh": UNEVEN_MESH})
    )
    for method in ("test_on_batch", "train_on_batch"):
        values = [getattr(lm, method)(x, y, return_dict=True) for lm in (one, bound)]
        assert_same_values(values[1], values[0], method)


def test_the_compiled_metrics_are_where_keras_keeps_them(preset):
    """The private pieces of `CompileMetrics` that padded steps use."""
    lm = every_metric_lm(preset, device_mesh=UNEVEN_MESH)
    x, y = data(preset, 8)
    lm.test_on_batch(x, y)
    compiled = compat_steps.compiled_metrics(lm)
    assert isinstance(compiled, keras.metrics.Metric) and compiled.built
    assert compiled in lm.metrics
    unweighted = [m for kept in compiled._flat_metrics for m in kept.metrics]
    weighted = [m for kept in compiled._flat_weighted_metrics for m in kept.metrics]
    assert [m.name for m in unweighted] == [
        "accuracy",
        "object_accuracy",
        "top3",
        "xent",
    ]
    assert [m.name for m in weighted] == [
        "weighted_accuracy",
        "sparse_categorical_crossentropy",
    ]
    assert compiled._flatten_y(y)[0] is y
