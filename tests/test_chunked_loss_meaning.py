"""A bound causal LM computes the loss keras-hub's compiled loss computes:
the chunked loss stands in only for keras-hub's default cross-entropy,
computed as Keras computes it (any other loss, metric or step keeps Keras'
whole-logits step), and every label keeps Keras' meaning, those outside the
vocabulary included; such labels are said once, with how to mask them."""

import warnings

import jax.numpy as jnp
import keras
import keras_hub
import numpy as np
import pytest

from keras_hub_autodist.errors import OutOfVocabularyLabelWarning
from keras_hub_autodist.errors import WholeLogitsWarning
from keras_hub_autodist.loss import chunked_steps
from keras_hub_autodist.loss.label_range import outside_vocabulary

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


@pytest.mark.parametrize(
    "reduction", ["sum_over_batch_size", "sum", "mean", "mean_with_sample_weight"]
)
@pytest.mark.parametrize("mesh", [{"batch": 8}, {"batch": 2, "model": 4}])
def test_labels_outside_the_vocabulary_mean_what_they_mean_to_keras(
    reduction, mesh, tiny_presets_dir, chunk_calls
):
    def loss():
        return keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction=reduction
        )

    path = tiny_presets_dir["gemma2_gqa"]  # soft-capped logits
    reference = _train(path, loss(), labels_outside=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OutOfVocabularyLabelWarning)
        ours = _train(path, loss(), mesh, labels_outside=True)
    assert len(chunk_calls) == 2  # the train and the test step, chunked
    _assert_same(ours, reference)


def test_the_chunks_give_an_outside_label_no_loss_and_no_gradient():
    from keras_hub_autodist.loss import chunked_cross_entropy as chunked

    rng = np.random.default_rng(1)
    hidden = jnp.asarray(rng.normal(size=(2, 8, 4)), jnp.float32)
    kernel = jnp.asarray(rng.normal(size=(4, 10)), jnp.float32)
    labels = jnp.asarray(
        [[1, -100, 3, 10, -1, 9, 0, 2**20], [4, 5, -100, 6, 7, 8, 11, 3]], jnp.int32
    )
    weights = jnp.ones((2, 8), jnp.float32)

    def keras_loss(hidden, kernel):
        return keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction="sum"
        )(labels, hidden @ kernel)

    def ours(hidden, kernel):
        entropy, _ = chunked.chunked_cross_entropy(
            lambda k, h: h @ k, kernel, hidden, labels, weights, 4
        )
        return jnp.sum(entropy)

    np.testing.assert_allclose(ours(hidden, kernel), keras_loss(hidden, kernel), 1e-5)
    for got, want in zip(
        jax_grad(ours)(hidden, kernel), jax_grad(keras_loss)(hidden, kernel)
    ):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


def jax_grad(function):
    import jax

    return jax.grad(function, (0, 1))


def test_labels_outside_the_vocabulary_are_said_once_with_how_to_mask_them(
    tiny_presets_dir,
):
    lm = keras_hub.models.CausalLM.from_preset(
        tiny_presets_dir["gemma_mqa"], preprocessor=None, device_mesh={"batch": 8}
    )
    lm.compile(optimizer="sgd")
    vocabulary = lm.backbone.vocabulary_size
    x, y, weights = _batch(vocabulary)
    with warnings.catch_warnings():
        warnings.simplefilter("error", OutOfVocabularyLabelWarning)
        lm.train_on_batch(x, y, weights)  # every label in the vocabulary
        masked = y.copy()
        masked[:, -3:] = -100  # where the weights are 0 already
        lm.train_on_batch(x, masked, weights)
    y[:, -5:] = -100
    with pytest.warns(OutOfVocabularyLabelWarning) as said:
        lm.train_on_batch(x, y, weights)
    text = str(said[0].message)
    assert "16 labels" in text and f"[0, {vocabulary})" in text and "-100" in text
    assert "sample_weight" in text and "mean_with_sample_weight" in text
    with warnings.catch_warnings():
        warnings.simplefilter("error", OutOfVocabularyLabelWarning)
        lm.train_on_batch(x, y, weights)  # said once per model


def test_the_label_check_reads_labels_as_keras_does():
    labels = np.array([[0, 9, 10, -1], [-0.5, 9.9, 10.0, 3]], np.float32)
    assert outside_vocabulary(labels, None, 10) == (3, 10.0)
    assert outside_vocabulary(labels.astype(np.int32), None, 10) == (3, 10)
    # A label the loss ignores, or a token of weight 0, is not counted.
    assert outside_vocabulary(np.array([[-100, 5]]), None, 10, ignored=-100) is None
    row_weights = np.array([0.0, 1.0])
    assert outside_vocabulary(labels, row_weights, 10) == (1, 10.0)
    # Device arrays are not read back.
    assert outside_vocabulary(jnp.asarray(labels), None, 10) is None
