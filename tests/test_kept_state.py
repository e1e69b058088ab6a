"""No bound method loses a model's state.

Inputs known before a loop (arrays, a task's sequence length) are refused
before Keras takes the variables off the model; batches known only when
drawn (a dataset of unknown batch size) are refused as drawn, before a
step. Whatever raises inside a loop (the data, a step, a callback), the
model keeps the state of its last finished step: `predict` and
`save_to_preset` work, and weights and optimizer state are those of a run
that trained on the finished steps only.
"""

import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf
import tiny_presets

import keras_hub_autodist
from keras_hub_autodist import BatchSizeError
from keras_hub_autodist import SequenceLengthError

MESH = {"batch": 4, "model": 2}
CONTEXT = {"batch": 2, "context": 4}


@pytest.fixture(scope="module")
def preset(tiny_presets_dir):
    return tiny_presets_dir["gemma_mqa"]


def data(preset, count, sequence_length=8, seed=0):
    info = keras_hub_autodist.reading.presets.read_preset_config(preset)
    x = tiny_presets.token_batch(
        count, info.config["vocabulary_size"], sequence_length, seed=seed
    )
    return x, np.roll(x["token_ids"], -1, axis=1)


def causal_lm(preset, mesh, loss=None):
    lm = keras_hub.models.CausalLM.from_preset(
        preset, preprocessor=None, device_mesh=mesh
    )
    lm.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss=loss or keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return lm


def state(model):
    """Every value of the model's state, optimizer included."""
    found = {v.path: np.asarray(v.value) for v in model.variables}
    for v in model.optimizer.variables:  # named apart from the optimizer's name
        found["optimizer/" + v.path.split("/", 1)[-1]] = np.asarray(v.value)
    return found


def assert_same_state(got, expected):
    assert got.keys() == expected.keys()
    for path, value in expected.items():
        np.testing.assert_allclose(got[path], value, atol=1e-6, err_msg=path)


class Loops(keras.callbacks.Callback):
    """Records which Keras loops began."""

    def __init__(self):
        super().__init__()
        self.began = []

    def on_train_begin(self, logs=None):
        self.began.append("train")

    def on_test_begin(self, logs=None):
        self.began.append("test")

    def on_predict_begin(self, logs=None):
        self.began.append("predict")


def test_a_sequence_the_context_axis_does_not_divide_loses_nothing(preset, tmp_path):
    lm = causal_lm(preset, CONTEXT)
    x, y = data(preset, 4, sequence_length=16)
    lm.fit(x, y, batch_size=4, verbose=0)
    before = state(lm)
    x6, y6 = data(preset, 4, sequence_length=6)
    loops = Loops()
    calls = {
        "fit": lambda: lm.fit(x6, y6, verbose=0, callbacks=[loops]),
        "evaluate": lambda: lm.evaluate(x6, y6, verbose=0, callbacks=[loops]),
        "predict": lambda: lm.predict(x6, verbose=0, callbacks=[loops]),
        "train_on_batch": lambda: lm.train_on_batch(x6, y6),
        "test_on_batch": lambda: lm.test_on_batch(x6, y6),
        "predict_on_batch": lambda: lm.predict_on_batch(x6),
        "fit(validation_data=)": lambda: lm.fit(
            x, y, validation_data=(x6, y6), verbose=0, callbacks=[loops]
        ),
    }
    for method, call in calls.items():
        with pytest.raises(SequenceLengthError, match="a multiple of 4"):
            call()
        assert loops.began == [], method  # refused before any loop began
        assert_same_state(state(lm), before)
    # A dataset whose length is known only when drawn: refused as drawn.
    spec = {key: tf.TensorSpec((None, None), tf.int32) for key in x6}
    labels = tf.TensorSpec((None, None), tf.int64)
    drawn = tf.data.Dataset.from_generator(
        lambda: iter([(x6, y6)]), output_signature=(spec, labels)
    )
    with pytest.raises(SequenceLengthError, match=r"\(4, 6\)"):
        lm.fit(drawn, verbose=0)
    assert_same_state(state(lm), before)
    assert lm.predict(x, verbose=0).shape[:2] == (4, 16)
    lm.save_to_preset(str(tmp_path / "saved"))


def backbone(preset):
    model = keras_hub.models.Backbone.from_preset(preset, device_mesh=MESH)
    model.compile(optimizer="sgd", loss="mse")
    return model


def test_a_ragged_last_batch_of_a_dataset_is_refused_as_drawn(preset):
    model = backbone(preset)
    x, _ = data(preset, 6)
    target = np.zeros((6, 8, model.hidden_dim), "float32")
    before = state(model)
    message = r"A batch drawn from the data has 2 rows.*batch axis 'batch' of size 4"
    with pytest.raises(BatchSizeError, match=message):
        model.predict(tf.data.Dataset.from_tensor_slices(x).batch(4), verbose=0)
    assert_same_state(state(model), before)
    with pytest.raises(BatchSizeError, match=message + r".*fit\(\) drew"):
        model.fit(tf.data.Dataset.from_tensor_slices((x, target)).batch(4), verbose=0)
    # The first batch trained; the second was refused before its step.
    first = backbone(preset)
    first.fit(rows(x, 4), target[:4], batch_size=4, verbose=0)
    assert_same_state(state(model), state(first))
    assert model.predict(rows(x, 4), verbose=0).shape == target[:4].shape


def rows(batch, count):
    return {key: value[:count] for key, value in batch.items()}


def batches(x, y, count, fail_at=None, then=()):
    """A dataset of `count` batches of 4 rows, then the batches `then`; it
    raises instead of drawing batch `fail_at`."""

    def generate():
        for index in range(count):
            if index == fail_at:
                raise RuntimeError("the data source broke")
            rows = slice(4 * index, 4 * index + 4)
            yield {key: value[rows] for key, value in x.items()}, y[rows]
        yield from then

    spec = {key: tf.TensorSpec((None, None), tf.int32) for key in x}
    labels = tf.TensorSpec((None, None), tf.as_dtype(y.dtype))
    return tf.data.Dataset.from_generator(generate, output_signature=(spec, labels))


def trained_on(preset, x, y, steps, **compile_kwargs):
    """The state of a model trained on the first `steps` batches (compiled
    with `compile_kwargs`, the loss of the run it is compared with)."""
    lm = causal_lm(preset, MESH, **compile_kwargs)
    if steps:
        lm.fit(batches(x, y, steps), steps_per_epoch=steps, verbose=0)
    else:  # what `fit` builds before its first step: zero slots
        with keras_hub_autodist.distribution_of(lm).distribution.scope():
            lm.optimizer.build(lm.trainable_variables)
    return state(lm)


class FailAtBatchEnd(keras.callbacks.Callback):
    def __init__(self, batch):
        super().__init__()
        self.batch = batch

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.batch:
            raise RuntimeError("the callback broke")


def refuse_long_sequences(y_true, y_pred):
    """A loss that raises while tracing a batch longer than 8 tokens."""
    if y_pred.shape[1] > 8:
        raise ValueError("the step broke")
    return keras.losses.sparse_categorical_crossentropy(y_true, y_pred, True)


def test_an_error_drawing_the_first_batch_keeps_the_state(preset, tmp_path):
    """Keras had taken the variables off the model and had no step's state
    to put back. Errors at later steps and from a step or a callback:
    integration/test_kept_state_stages.py."""
    assert_kept_after_error(preset, tmp_path, "data", finished=0)


def assert_kept_after_error(preset, tmp_path, stage, finished):
    """`fit` raises from `stage` after `finished` steps: the model has the
    state of a run of `finished` steps, and predicts and saves."""
    x, y = data(preset, 12)
    lm = causal_lm(preset, MESH, loss=refuse_long_sequences)
    # Build the loss and metrics, so that `fit` draws its first batch inside
    # its loop (after taking the variables), not before it to build them.
    lm.evaluate(rows(x, 4), y[:4], verbose=0)
    callbacks = []
    if stage == "data":
        feed = batches(x, y, 3, fail_at=finished)
    elif stage == "step":
        # A longer batch: Keras traces the step again, and the loss raises.
        feed = batches(x, y, finished, then=[data(preset, 4, sequence_length=12)])
    else:
        feed = batches(x, y, 3)
        callbacks = [FailAtBatchEnd(finished - 1)]
    with pytest.raises(Exception, match="broke"):  # tf.data wraps the data's
        lm.fit(feed, steps_per_epoch=3, verbose=0, callbacks=callbacks)
    # The same loss (which keeps whole logits), so the same arithmetic.
    reference = trained_on(preset, x, y, finished, loss=refuse_long_sequences)
    assert_same_state(state(lm), reference)
    assert lm.predict(x, verbose=0).shape[:2] == (12, 8)
    lm.save_to_preset(str(tmp_path / "saved"))
