"""Steps on padded batches that count only the real rows.

A bound task pads a batch that doesn't divide the batch axis with copies of
its last row (`batches.pad_batch`), and marks which rows are real: its
sample weight becomes `{WEIGHTS_KEY: weights, REAL_ROWS_KEY: 0/1 per row}`,
the weights zero on padded rows and the caller's (or ones) on real rows.
The task's own steps take that mark apart:

- weighted metrics get the weights: a padded row weighs 0, a real row what
  it would on one device, so every weighted metric is the one-device value;
- unweighted metrics (`compile(metrics=...)`), which Keras updates without
  any weight, get the mark itself: 1 on each real row, 0 on each padded one,
  which on an unpadded batch is the same as no weight;
- the compiled loss, when it divides by the number of rows
  (`sum_over_batch_size`), is multiplied by padded/real rows, so the loss
  and its gradient are the unpadded batch's (losses added by layers are
  not);
- Keras' loss tracker, which weighs each batch's loss by its number of
  rows, weighs it by its real rows, so the loss `fit` logs and `evaluate`
  returns is the one-device value. (A model of several outputs also
  tracks each output's loss; those are not corrected.)
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator

import keras

from keras_hub_autodist import compat
from keras_hub_autodist.compat import steps as compat_steps

WEIGHTS_KEY = "keras_hub_autodist_sample_weight"
REAL_ROWS_KEY = "keras_hub_autodist_real_rows"
# Marks a method this module already wraps.
_PADDED_ATTR = "__keras_hub_autodist_padded__"
# Loss reductions that divide by the number of values of the batch.
_ROW_MEAN_REDUCTIONS = ("sum_over_batch_size", "mean", "auto")
# (real rows, rows, the 0/1 mark per row) of the padded batch whose step is
# being traced.
_ROWS = contextvars.ContextVar("keras_hub_autodist_padded_rows", default=None)


def marked(weights, real_rows) -> dict:
    """A padded batch's sample weight: `weights` (0 on padded rows) and
    `real_rows` (1.0 on real rows, 0.0 on padded ones)."""
    return {WEIGHTS_KEY: weights, REAL_ROWS_KEY: real_rows}


def unmarked(sample_weight):
    """`(weights, real_rows)` of a marked sample weight; `(sample_weight,
    None)` for any other."""
    if isinstance(sample_weight, dict) and set(sample_weight) == {
        WEIGHTS_KEY,
        REAL_ROWS_KEY,
    }:
        return sample_weight[WEIGHTS_KEY], sample_weight[REAL_ROWS_KEY]
    return sample_weight, None


def divides_by_rows(model) -> bool:
    """Whether the model's compiled losses divide by the number of values
    of a batch (so a padded batch's loss needs padded/real rows)."""
    losses = [loss for loss in keras.tree.flatten(getattr(model, "loss", None)) if loss]
    reductions = {getattr(loss, "reduction", "sum_over_batch_size") for loss in losses}
    return bool(reductions & set(_ROW_MEAN_REDUCTIONS))


@contextlib.contextmanager
def _counting(real_rows) -> Iterator[None]:
    rows = real_rows.shape[0]
    count = keras.ops.sum(keras.ops.cast(real_rows, "float32"))
    token = _ROWS.set((count, rows, real_rows))
    try:
        yield
    finally:
        _ROWS.reset(token)


def _step(step):
    """`train_step`/`test_step`: a marked batch counted by its real rows."""

    @functools.wraps(step)
    def call(state, data):
        _, _, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        _, real_rows = unmarked(sample_weight)
        if real_rows is None:
            return step(state, data)
        with _counting(real_rows):
            return step(state, data)

    return call


def _compute_loss(compute_loss, model):
    @functools.wraps(compute_loss)
    def call(x=None, y=None, y_pred=None, sample_weight=None, **kwargs):
        weights, _ = unmarked(sample_weight)
        total = compute_loss(x, y, y_pred, weights, **kwargs)
        counted = _ROWS.get()
        if counted is None or total is None or not divides_by_rows(model):
            return total
        count, rows, _ = counted
        dtype = keras.backend.standardize_dtype(total.dtype)
        added = [keras.ops.sum(keras.ops.cast(loss, dtype)) for loss in model.losses]
        added = sum(added) if added else keras.ops.zeros((), dtype)
        factor = keras.ops.cast(rows / count, dtype)
        return (total - added) * factor + added

    return call


def _compute_metrics(compute_metrics):
    @functools.wraps(compute_metrics)
    def call(x, y, y_pred, sample_weight=None):
        weights, _ = unmarked(sample_weight)
        return compute_metrics(x, y, y_pred, weights)

    return call


def _metrics_update(update_state, compiled):
    """The compiled metrics' `update_state`: on a padded batch, its
    unweighted metrics weigh each row by its mark."""

    @functools.wraps(update_state)
    def call(y_true, y_pred, sample_weight=None):
        counted = _ROWS.get()
        if counted is None:
            return update_state(y_true, y_pred, sample_weight=sample_weight)
        return compat_steps.update_metrics_by_rows(
            compiled, y_true, y_pred, sample_weight, counted[2]
        )

    return call


def _tracker_update(update_state):
    @functools.wraps(update_state)
    def call(values, sample_weight=None):
        counted = _ROWS.get()
        if counted is not None:
            sample_weight = counted[0]
        return update_state(values, sample_weight=sample_weight)

    return call


def _patch(target, attribute: str, wrap) -> None:
    method = getattr(target, attribute, None)
    if method is None or getattr(method, _PADDED_ATTR, False):
        return
    wrapped = wrap(method)
    setattr(wrapped, _PADDED_ATTR, True)
    compat.patch_instance("padded_steps", target, attribute, wrapped)


def count_real_rows(model) -> None:
    """Make `model`'s steps read the mark of a padded batch (module
    docstring). Run when bound, and again after each `compile` (which makes
    a new loss tracker)."""
    _patch(model, "train_step", _step)
    _patch(model, "test_step", _step)
    _patch(model, "compute_loss", lambda method: _compute_loss(method, model))
    _patch(model, "compute_metrics", _compute_metrics)
    tracker = compat_steps.loss_tracker(model)
    if tracker is not None:
        _patch(tracker, "update_state", _tracker_update)
    compiled = compat_steps.compiled_metrics(model)
    if compiled is not None:
        _patch(
            compiled, "update_state", lambda method: _metrics_update(method, compiled)
        )
