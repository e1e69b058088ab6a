"""Private Keras touchpoints of checkpoints: a variable's stored value, a
restored training position, and `keras.callbacks.OrbaxCheckpoint`'s batch
counters (re-exported by `compat`, whose `TOUCHPOINTS` list them)."""

from __future__ import annotations


def variable_value_or_none(variable):
    """A Keras variable's stored value (`variable._value`), without autocast;
    None while a running JAX `fit` holds the state."""
    return getattr(variable, "_value", None)


def set_initial_epoch(model, epoch: int) -> None:
    """Make the model's running `fit` start at `epoch` (`model._initial_epoch`),
    as `keras.callbacks.BackupAndRestore` does from `on_train_begin`."""
    model._initial_epoch = epoch


# `keras.callbacks.OrbaxCheckpoint` keeps its batch counters in attributes
# set by its `__init__`: `_total_batches_seen` (the step number of the next
# save), `_last_batch_seen` and `_batches_seen_since_last_saving`.


def orbax_unsaved_batches(callback) -> int:
    """Batches an `OrbaxCheckpoint` trained on since its last save."""
    return callback._batches_seen_since_last_saving


def orbax_resume_counters(callback, batches_done: int) -> None:
    """Make an `OrbaxCheckpoint` number its next saves after `batches_done`
    batches, as if it had seen them (a resumed run)."""
    callback._total_batches_seen = batches_done
    callback._batches_seen_since_last_saving = 0


def orbax_skip_batch(callback, batch: int) -> None:
    """Let an `OrbaxCheckpoint` see batch `batch` of the epoch without
    counting it (a batch skipped on resume)."""
    callback._last_batch_seen = batch


def orbax_save_now(callback, logs=None) -> None:
    """Save an `OrbaxCheckpoint` now, numbered by the batches seen
    (`OrbaxCheckpoint._save_checkpoint`), unless it just saved."""
    if callback._batches_seen_since_last_saving:
        callback._save_checkpoint(step=callback._total_batches_seen, logs=logs)
        callback._batches_seen_since_last_saving = 0
