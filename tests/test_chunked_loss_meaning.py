"""A bound causal LM computes the loss keras-hub's compiled loss computes:
the chunked loss stands in only for keras-hub's default cross-entropy,
computed as Keras computes it; any other loss, metric or step keeps Keras'
whole-logits step."""

import keras
import keras_hub
import numpy as np
import pytest

from keras_hub_autodist.errors import WholeLogitsWarning
from keras_hub_autodist.loss import chunked_steps

SEQUENCE = 16
ROWS = 8


@pytest.fixture
def chunk_calls(monkeypatch):
    """Every step chunked where its loss may be (4 chunks); the chunk
    counts of the chunked losses traced."""
    calls = []
    original = chunked_steps.chunked_cross_entropy

    def counting(*args):
        calls.append(args[-1])
        return original(*args)

    monkeypatch.setattr(chunked_steps, "chunked_cross_entropy", counting)
    monkeypatch.setattr(chunked_steps, "chunk_count", lambda *_: 4)
    return calls


class ZLoss(keras.losses.SparseCategoricalCrossentropy):
    """Cross-entropy plus a z-loss on the logits' log-sum-exp."""

    def call(self, y_true, y_pred):
        z = keras.ops.logsumexp(keras.ops.cast(y_pred, "float32"), axis=-1)
        return super().call(y_true, y_pred) + 1e-2 * keras.ops.square(z)


class SameClassName(keras.losses.SparseCategoricalCrossentropy):
    """A subclass that computes what its parent computes."""


def _label_smoothed(y_true, y_pred, **arguments):
    return keras.losses.sparse_categorical_crossentropy(
        y_true, y_pred, **arguments
    ) - 0.1 * keras.ops.mean(keras.ops.log_softmax(y_pred), axis=-1)


def _cross_entropy_of_logits(y_true, y_pred):
    return keras.losses.sparse_categorical_crossentropy(
        y_true, y_pred, from_logits=True
    )


def _replaced_call():
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    inner = loss.call
    loss.call = lambda y_true, y_pred: 2.0 * inner(y_true, y_pred)
    return loss


def _replaced_function():
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    loss.fn = _label_smoothed
    return loss


def _batch(vocabulary, labels_outside=False):
    rng = np.random.default_rng(0)
    ids = rng.integers(1, vocabulary, (ROWS, SEQUENCE)).astype("int32")
    padding = np.ones_like(ids)
    padding[:, -3:] = 0
    y = np.roll(ids, -1, axis=1)
    if labels_outside:
        y[:, -4:] = -100  # Hugging Face's "ignore"
        y[0, :2] = [-1, vocabulary]
        y[1, 0] = vocabulary + 7
    weights = rng.choice([0.5, 1.0, 2.0], (ROWS, SEQUENCE)).astype("float32")
    weights[:, -3:] = 0.0
    return {"token_ids": ids, "padding_mask": padding}, y, weights


def _train(path, loss=None, mesh=None, labels_outside=False, metrics=None):
    """Two training steps and an evaluation of the preset's causal LM
    compiled with `loss` (keras-hub's default where None); the logs and the
    trained weights."""
    kwargs = {} if mesh is None else {"device_mesh": mesh}
    lm = keras_hub.models.CausalLM.from_preset(path, preprocessor=None, **kwargs)
    compiled = {} if loss is None else {"loss": loss}
    if metrics is not None:
        compiled["weighted_metrics"] = metrics
    lm.compile(optimizer=keras.optimizers.Adam(1e-2, epsilon=1e-4), **compiled)
    x, y, weights = _batch(lm.backbone.vocabulary_size, labels_outside)
    logs = [lm.train_on_batch(x, y, weights, return_dict=True) for _ in range(2)]
    logs.append(lm.evaluate(x, y, sample_weight=weights, return_dict=True, verbose=0))
    return logs, [np.asarray(w.value) for w in lm.trainable_weights]


def _assert_same(ours, reference):
    (logs, weights), (logs_ref, weights_ref) = ours, reference
    for got, want in zip(logs, logs_ref):
        assert got.keys() == want.keys()
        for key in want:
            np.testing.assert_allclose(got[key], want[key], rtol=2e-5, atol=2e-6)
    for got, want in zip(weights, weights_ref):
        np.testing.assert_allclose(got, want, atol=2e-5)


# Compiled losses the chunked loss does not compute: each keeps Keras' own
# whole-logits step, whose reason the warning names.
NOT_CHUNKED = {
    "subclass-with-z-loss": (lambda: ZLoss(from_logits=True), "ZLoss"),
    "subclass-computing-the-same": (
        lambda: SameClassName(from_logits=True),
        "SameClassName",
    ),
    "call-replaced-on-the-instance": (_replaced_call, "replaces call"),
    "function-replaced": (_replaced_function, "_label_smoothed"),
    "ignore-class": (
        lambda: keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, ignore_class=-100
        ),
        "ignore_class=-100",
    ),
    "probabilities": (
        lambda: keras.losses.SparseCategoricalCrossentropy(from_logits=False),
        "from_logits=False",
    ),
    "bfloat16": (
        lambda: keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, dtype="bfloat16"
        ),
        "bfloat16",
    ),
    "another-axis": (
        lambda: keras.losses.SparseCategoricalCrossentropy(from_logits=True, axis=2),
        "axis=2",
    ),
    "a-function": (lambda: _cross_entropy_of_logits, "_cross_entropy_of_logits"),
}


@pytest.mark.parametrize("case", NOT_CHUNKED, ids=list(NOT_CHUNKED))
def test_a_loss_the_chunks_do_not_compute_keeps_keras_own_step(
    case, tiny_presets_dir, chunk_calls
):
    make, reason = NOT_CHUNKED[case]
    path = tiny_presets_dir["gemma_mqa"]
    reference = _train(path, make())
    with pytest.warns(WholeLogitsWarning, match=reason):
        ours = _train(path, make(), {"batch": 8})
    assert chunk_calls == []
    _assert_same(ours, reference)


def test_a_metric_of_its_own_keeps_keras_own_step(tiny_presets_dir, chunk_calls):
    class Accuracy(keras.metrics.SparseCategoricalAccuracy):
        def update_state(self, y_true, y_pred, sample_weight=None):
            top = keras.ops.max(keras.ops.softmax(y_pred), axis=-1)
            return super().update_state(y_true, y_pred, sample_weight * top)

    path = tiny_presets_dir["gemma_mqa"]
    reference = _train(path, metrics=[Accuracy()])
    with pytest.warns(WholeLogitsWarning, match="Accuracy"):
        ours = _train(path, mesh={"batch": 8}, metrics=[Accuracy()])
    assert chunk_calls == []
    _assert_same(ours, reference)


def test_a_task_whose_class_replaces_a_step_method_keeps_keras_own_step(
    tiny_presets_dir, chunk_calls, monkeypatch
):
    # A z-loss added in the task's `compute_loss`, from the logits.
    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, **kw):
        loss = keras.Model.compute_loss(self, x, y, y_pred, sample_weight, **kw)
        z = keras.ops.logsumexp(keras.ops.cast(y_pred, "float32"), axis=-1)
        return loss + 1e-2 * keras.ops.mean(keras.ops.square(z))

    monkeypatch.setattr(
        keras_hub.models.GemmaCausalLM, "compute_loss", compute_loss, raising=False
    )
    path = tiny_presets_dir["gemma_mqa"]
    reference = _train(path)
    with pytest.warns(WholeLogitsWarning, match="compute_loss"):
        ours = _train(path, mesh={"batch": 8})
    assert chunk_calls == []
    _assert_same(ours, reference)


def test_a_step_method_replaced_after_loading_keeps_keras_own_step(
    tiny_presets_dir, chunk_calls
):
    lm = keras_hub.models.CausalLM.from_preset(
        tiny_presets_dir["gemma_mqa"], preprocessor=None, device_mesh={"batch": 8}
    )
    lm.compile(optimizer="sgd")
    lm.compute_loss = lambda *args, **kwargs: 0.0
    x, y, _ = _batch(lm.backbone.vocabulary_size)
    why = chunked_steps.why_whole_logits(lm, y)
    assert why is not None and "compute_loss" in why
