"""`ResumableCheckpoint`: `keras.callbacks.OrbaxCheckpoint` that resumes.

At the start of `fit` it restores the newest complete checkpoint of its
folder (with the metrics' totals and Keras' global random state), refusing
one of another model, optimizer, LoRA rank or batch size (`restore.py`,
`fingerprint.py`), and skips the batches of the current epoch that were
already trained on. It says where it resumed, or that training is already
complete. It also saves and stops on `SIGTERM` or past a time limit, at the
same batch in every process (`stopping.py`). Every checkpoint it writes holds
the model's fingerprint and the batches of the `fit` that took it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import logging
import os

import jax
import keras

from keras_hub_autodist import compat
from keras_hub_autodist.errors import CheckpointOptionError
from keras_hub_autodist.errors import ExtraMissingError
from keras_hub_autodist.errors import NotBoundError
from keras_hub_autodist.errors import RestoreError
from keras_hub_autodist.errors import warn
from keras_hub_autodist.training import fingerprint as fingerprints
from keras_hub_autodist.training import global_random
from keras_hub_autodist.training.batches import fed_rows
from keras_hub_autodist.training.binding import distribution_of
from keras_hub_autodist.training.fingerprint import Training
from keras_hub_autodist.training.restore import ORBAX_MARKERS
from keras_hub_autodist.training.restore import restore_state
from keras_hub_autodist.training.restore import step_numbers
from keras_hub_autodist.training.stopping import StopRequest
from keras_hub_autodist.training.stopping import check_batch_count

logger = logging.getLogger(__name__)


class ExtraCheckpointables:
    """An Orbax `Checkpointer` that saves more checkpointables beside those
    of Keras' `OrbaxCheckpoint` (whose `pytree` stays exactly Keras' format,
    so that Keras' own `load_weights` reads the checkpoint as before).

    Args:
        checkpointer: an `orbax.checkpoint.v1.training.Checkpointer`.
        extras: called at each save; returns name -> checkpointable.

    Example:
    ```python
    callback.checkpointer = ExtraCheckpointables(
        callback.checkpointer,
        lambda: {global_random.CHECKPOINTABLE: global_random.saved_form()},
    )
    ```
    """

    def __init__(self, checkpointer, extras):
        self.wrapped = checkpointer
        self.extras = extras

    def __getattr__(self, name):
        return getattr(self.wrapped, name)

    def save_checkpointables(self, step, checkpointables, *args, **kwargs):
        return self.wrapped.save_checkpointables(
            step, {**checkpointables, **self.extras()}, *args, **kwargs
        )

    def save_checkpointables_async(self, step, checkpointables, *args, **kwargs):
        return self.wrapped.save_checkpointables_async(
            step, {**checkpointables, **self.extras()}, *args, **kwargs
        )


def _check_flag(keyword: str, value) -> None:
    if not isinstance(value, bool):
        raise CheckpointOptionError(
            f"`{keyword}=` is True or False. Received: {keyword}={value!r}"
        )


def _check_max_to_keep(value) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise CheckpointOptionError(
            "`max_to_keep=` is how many checkpoints to keep: an integer >= 1, "
            f"or None to keep all. Received: max_to_keep={value!r}"
        )
    if value < 1:
        raise CheckpointOptionError(
            "`max_to_keep=` must be at least 1: with fewer, each checkpoint "
            "would be deleted as it is written. Pass 1 or more, or None to "
            f"keep all. Received: max_to_keep={value!r}"
        )


def checked_directory(directory) -> str:
    """The absolute path of a folder of checkpoints `ResumableCheckpoint`
    can write in, or `CheckpointOptionError` saying why not.

    Example:
    >>> checked_directory("/tmp/ckpt")
    '/tmp/ckpt'
    """
    if not isinstance(directory, (str, os.PathLike)) or isinstance(
        os.fspath(directory), bytes
    ):
        raise CheckpointOptionError(
            "`directory=` is the path of a folder (a `str` or `pathlib.Path`). "
            f"Received: directory={directory!r} of type {type(directory).__name__}"
        )
    path = os.fspath(directory)
    if not path.strip():
        raise CheckpointOptionError(
            "`directory=` is empty: name the folder of the checkpoints, e.g. "
            f"'./checkpoints'. Received: directory={path!r}"
        )
    absolute = os.path.abspath(path)  # Orbax wants an absolute path
    if os.path.exists(absolute) and not os.path.isdir(absolute):
        raise CheckpointOptionError(
            f"`directory=` {absolute!r} is a file, not a folder: the first "
            "save would fail. Pass a folder (created if missing). Received: "
            f"directory={path!r}"
        )
    if os.path.isdir(absolute) and set(ORBAX_MARKERS) & set(os.listdir(absolute)):
        raise CheckpointOptionError(
            f"`directory=` {absolute!r} is one Orbax checkpoint, not a folder of "
            f"them: pass its parent, {os.path.dirname(absolute)!r}. Received: "
            f"directory={path!r}"
        )
    existing = absolute
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise CheckpointOptionError(
            f"`directory=` {absolute!r} can't be created: {existing!r} is a "
            f"file. Pass a folder elsewhere. Received: directory={path!r}"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise CheckpointOptionError(
            f"`directory=` {absolute!r} can't be written: {existing!r} is not "
            f"writable. Pass a folder you can write. Received: directory={path!r}"
        )
    return absolute


def _leading_rows(batch) -> int | None:
    """Rows of a batch as the train step receives it (all processes)."""
    for leaf in keras.tree.flatten(batch):
        shape = getattr(leaf, "shape", None)
        if shape is not None and len(shape) > 0:
            return int(shape[0])
    return None


def _put_back(model, state) -> None:
    """Give the model's variables the values of a train step's `state`
    again. A JAX `fit` takes the values off the variables while an epoch runs
    (Keras' `_purge_model_variables`) and puts them back when it ends, so a
    train step that raises would leave the model without its weights."""
    groups = (
        model.trainable_variables,
        model.non_trainable_variables,
        model.optimizer.variables,
        model.metrics_variables,
    )
    for variables, values in zip(groups, state):
        for variable, value in zip(variables, values or ()):
            variable.assign(value)


def _model_distribution(model):
    try:
        return distribution_of(model).distribution
    except NotBoundError:
        return keras.distribution.distribution()


def _require_orbax() -> None:
    """Raise `ExtraMissingError`, naming the extra, without Orbax."""
    try:
        found = importlib.util.find_spec("orbax.checkpoint") is not None
    except (ImportError, ValueError):  # `orbax` itself is missing
        found = False
    if not found:
        raise ExtraMissingError(
            "ResumableCheckpoint saves with Orbax, which is not installed: "
            "`pip install keras-hub-autodist[checkpoints]` (it installs "
            "orbax-checkpoint). Received: no module 'orbax.checkpoint'"
        )


class ResumableCheckpoint(keras.callbacks.OrbaxCheckpoint):
    """`keras.callbacks.OrbaxCheckpoint` that resumes where training stopped.

    Saves the weights, the optimizer state and its iteration count, the
    metrics' running totals and Keras' global random state every
    `save_freq` batches, as Orbax checkpoints numbered by the number of
    batches trained, each with the model's fingerprint (every variable's
    path, shape and dtype; the optimizer's class; the batch size and batches
    per epoch of the `fit`). At the start of `fit`, the newest complete
    checkpoint in `directory` is restored (for a bound model, straight into
    the model's layouts, on the same mesh or another), and training continues
    from the epoch and the batch within it where that checkpoint was taken:
    the batches of that epoch already trained on are read from the data and
    skipped, not trained on again. The data must come in the same order in
    each run (`shuffle=False`, or a seeded, deterministic dataset) and have a
    known number of batches per epoch.

    A checkpoint of another model (other shapes, another LoRA rank), of
    another optimizer, or taken with another batch size or another number of
    batches per epoch is refused with `RestoreError` before any batch is
    trained: resuming at the same sample with other batches is not
    attempted. A damaged newest checkpoint (an empty folder, files missing or
    truncated) is skipped with a warning and renamed `<step>.damaged`, for
    the last complete one. Resuming prints one line when `fit`'s `verbose`
    is not 0 (and logs it, logger `keras_hub_autodist.training.resumable`): `resumed
    from step N (epoch E, batch B) of <directory>` (epoch E counted from 1,
    as Keras prints it; B batches of it were trained), or `training already
    complete at step N: nothing to do`. The `History` of a `fit` that had
    nothing to do holds the metrics of the last epoch trained.

    Restored on resume, so that the resumed run equals one that never
    stopped: the weights and non-trainable variables (which hold the layers'
    own seed generators), the optimizer's variables, the metrics' totals
    within the interrupted epoch (the loss `fit` logs for that epoch covers
    all its batches, not only those after the resume), and the state of
    Keras' global seed generator (what `keras.random` functions given no
    seed draw from; it is restored at the point of the data where it was
    saved, after the skipped batches were read).

    Orbax writes each checkpoint under a temporary name and renames it when
    complete, so a process killed while saving leaves the previous complete
    checkpoint to resume from.

    On `SIGTERM` (a preemption notice) or past `time_limit`, it saves at the
    end of the current batch and stops training. In several processes
    (`jax.process_count() > 1`) the processes agree every `stop_check_freq`
    batches whether any of them wants to stop (one all-gather of one
    integer per process), so that all of them stop after the same batch and
    save together, even when only one received `SIGTERM`. The `SIGTERM`
    handler is installed at the start of `fit`, only when `fit` runs on the
    main thread (Python delivers signals there, and only the main thread can
    install handlers), and the previous handler is put back when `fit` ends
    (Keras skips `on_train_end` when `fit` raises; the handler then stays
    until the next `fit` ends). A second `SIGTERM` while `fit` runs goes to
    the previous handler (by default, the process ends).

    Args:
        directory: the folder of the checkpoints (created when missing;
            a relative path is taken from the current folder).
        save_freq: save every this many batches (an integer >= 1).
        max_to_keep: how many of the newest checkpoints to keep (>= 1), or
            None to keep all.
        save_on_background: write in a background thread while training
            goes on (Orbax's asynchronous save).
        save_on_sigterm: on `SIGTERM`, save at the end of the current batch
            and stop training. False leaves `SIGTERM`'s handler alone.
        time_limit: seconds after the start of `fit` past which to save and
            stop training, at the end of the batch that crosses it (a Kaggle
            session limit, less a margin); None for no limit.
        stop_check_freq: in several processes, agree on stopping every this
            many batches (with steps much shorter than the collective's round
            trip, a larger value saves its cost; the stop then comes up to
            this many batches later).

    Raises:
        CheckpointOptionError: an argument has the wrong type or is out of
            range, or `directory` is a file or can't be written.

    Example:
    ```python
    checkpoint = keras_hub_autodist.ResumableCheckpoint("ckpt", save_freq=2)
    lm.fit(x, y, batch_size=8, epochs=2, shuffle=False, callbacks=[checkpoint])
    ```
    """

    def __init__(
        self,
        directory: str,
        save_freq: int = 100,
        max_to_keep: int | None = 2,
        save_on_background: bool = True,
        save_on_sigterm: bool = True,
        time_limit: float | None = None,
        stop_check_freq: int = 1,
    ):
        _require_orbax()
        check_batch_count(
            "save_freq",
            save_freq,
            "Checkpoints are numbered by batches trained, so that a run can "
            "resume within an epoch. Pass an integer >= 1, e.g. the number "
            "of batches per epoch.",
        )
        _check_max_to_keep(max_to_keep)
        _check_flag("save_on_background", save_on_background)
        _check_flag("save_on_sigterm", save_on_sigterm)
        self.stop_request = StopRequest(
            on_sigterm=save_on_sigterm,
            time_limit=time_limit,
            check_freq=stop_check_freq,
        )
        super().__init__(
            checked_directory(directory),
            save_freq=save_freq,
            max_to_keep=max_to_keep,
            save_on_background=save_on_background,
        )
        self.checkpointer = ExtraCheckpointables(self.checkpointer, self._extras)
        self.resumed_from = None
        self._resume_epoch = None
        self._skip = 0
        self._skip_remaining = 0
        self._saved_metrics = []  # (variable, value) of the resumed epoch
        self._saved_random_state = None
        self._saved_training = None
        self._batches_trained = 0
        self._batch_rows = None
        # Holds the train function of `_wrap_train_function` in place.
        self._wrapped = contextlib.ExitStack()
        self._wrapped_model = None

    @property
    def save_on_sigterm(self) -> bool:
        return self.stop_request.on_sigterm

    @property
    def time_limit(self) -> float | None:
        return self.stop_request.time_limit

    @property
    def stop_check_freq(self) -> int:
        return self.stop_request.check_freq

    def _batch_size(self) -> int | None:
        """The rows of this run's batches, all processes together, as its
        caller batched them (`batches.fed_rows`: a bound task's train step
        receives them padded to the batch axis), else as the first train step
        received them; None before that step when unknown."""
        fed = fed_rows()
        if fed is not None:
            return fed * jax.process_count()
        return self._batch_rows

    def _training(self) -> Training | None:
        steps = (self.params or {}).get("steps")
        rows = self._batch_size()
        if rows is None or not steps:
            return None
        return Training(rows, steps)

    def _extras(self) -> dict:
        """What each checkpoint saves beside Keras' own checkpointables."""
        fingerprint = fingerprints.of_model(self.model, self._training())
        return {
            global_random.CHECKPOINTABLE: global_random.saved_form(),
            fingerprints.STORED_NAME: {"json": fingerprint.to_json()},
        }

    def _say(self, line: str) -> None:
        """Print `line` as Keras prints its progress, and log it."""
        logger.info(line)
        if (self.params or {}).get("verbose", 1) != 0 and (
            keras.config.is_interactive_logging_enabled()
        ):
            print(line, flush=True)

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        self._batches_trained = 0
        self._batch_rows, self._saved_training = None, None
        self._saved_metrics, self._saved_random_state = [], None
        self.stop_request.start()
        self._wrap_train_function()
        try:
            self._resume()
        except BaseException:
            self._abandon()
            raise

    def _resume(self):
        if not step_numbers(self.directory):
            return  # nothing saved yet, or only checkpoints being written
        steps = (self.params or {}).get("steps")
        if not steps:
            raise RestoreError(
                "Resuming within an epoch needs the number of batches per "
                "epoch: pass `steps_per_epoch=` to `fit`, or data of known "
                f"length. Received: fit with unknown steps, checkpoints in "
                f"{self.directory!r}"
            )
        restored = restore_state(
            self.model,
            _model_distribution(self.model),
            self.directory,
            check=self._check_batches,
            extras=(global_random.CHECKPOINTABLE,),
            all_metrics=True,
            move_damaged=True,
        )
        # Orbax lists the steps when it starts: it must forget those that
        # were moved aside, or it would refuse to save them again.
        self.checkpointer.reload()
        self.resumed_from = restored.folder
        self._saved_training = restored.fingerprint.training
        # The batches trained: the step Orbax saved at (its batch count). An
        # optimizer's `iterations` counts the updates it applied, fewer when
        # a `LossScaleOptimizer` skipped some (non-finite float16 gradients).
        optimizer = fingerprints.model_optimizer(self.model)
        done = restored.step
        if done is None:
            done = int(optimizer.iterations) if optimizer is not None else 0
        epoch, skip = divmod(done, steps)
        epochs = (self.params or {}).get("epochs")
        compat.orbax_resume_counters(self, done)
        if epochs is not None and epoch >= epochs:
            self._say(f"training already complete at step {done}: nothing to do")
            self._record_last_epoch(restored)
            compat.set_initial_epoch(self.model, epoch)
            return
        if skip and self.model.steps_per_execution != 1:
            raise RestoreError(
                "Resuming within an epoch skips batches one at a time: compile "
                "with `steps_per_execution=1`. Received: steps_per_execution="
                f"{self.model.steps_per_execution}"
            )
        self._say(
            f"resumed from step {done} (epoch {epoch + 1}, batch {skip}) of "
            f"{self.directory}"
        )
        self._resume_epoch, self._skip = epoch, skip
        # `fit` resets the metrics at the start of each epoch: their restored
        # totals are put back after that reset (`on_epoch_begin`).
        self._saved_metrics = [(v, v.value) for v in self.model.metrics_variables]
        self._saved_random_state = restored.extras.get(global_random.CHECKPOINTABLE)
        compat.set_initial_epoch(self.model, epoch)

    def _check_batches(self, chosen) -> None:
        """Refuse a checkpoint taken with another batch size or other batches
        per epoch, before anything is restored; a batch size known only from
        the first batch is checked there (`_check_batch_size`)."""
        saved = chosen.fingerprint.training
        if saved is None:
            warn(
                f"The checkpoint {chosen.folder!r} does not record the batch "
                "size and batches per epoch it was taken with (an older save, "
                "or Keras' `OrbaxCheckpoint`): make sure this `fit` has those "
                "of the interrupted run, or it resumes on other samples.",
            )
            return
        error = fingerprints.training_error(
            f"The checkpoint {chosen.folder!r}",
            saved,
            Training(self._batch_size(), self.params["steps"]),
            jax.process_count(),
        )
        if error is not None:
            raise error

    def _check_batch_size(self) -> None:
        saved = self._saved_training
        current = self._training()
        if saved is None or current is None:
            return
        error = fingerprints.training_error(
            f"The checkpoint {self.resumed_from!r}", saved, current, jax.process_count()
        )
        if error is not None:
            raise error

    def _wrap_train_function(self):
        """Read the first batch's size (checked against the checkpoint's),
        then make the next `self._skip_remaining` train steps read their
        batch and train on nothing; the model's own train function is put
        back at the first batch it trains (`compat.PATCHES`:
        `skipped_batches`).

        Inside a train step the model is reached through `model`, never
        `self.model`: under JAX, that property writes the state of the last
        step into the variables, and `fit` would then take its next state
        from buffers the step just donated.
        """
        model = self.model
        original = model.train_function

        def train_step(state, iterator):
            if self._batch_rows is None:
                batch = next(iterator)
                self._batch_rows = _leading_rows(batch)
                try:
                    self._check_batch_size()
                except BaseException:
                    _put_back(model, state)
                    self._abandon()
                    raise
                iterator = itertools.chain([batch], iterator)
            if self._skip_remaining:
                next(iterator)
                self._skip_remaining -= 1
                return {}, state
            self._unwrap()
            return original(state, iterator)

        self._wrapped.enter_context(
            compat.instance_patched(
                "skipped_batches", model, "train_function", train_step
            )
        )
        self._wrapped_model = model

    def _unwrap(self):
        self._wrapped.close()

    def _abandon(self):
        """Undo what `on_train_begin` set up, for a `fit` that raises (Keras
        then skips `on_train_end`)."""
        if self._wrapped_model is not None:
            compat.set_initial_epoch(self._wrapped_model, None)
            self._wrapped_model = None
        self._unwrap()
        self._resume_epoch, self._skip, self._skip_remaining = None, 0, 0
        self.stop_request.finish()

    def _record_last_epoch(self, restored) -> None:
        """Give the `History` of a `fit` with nothing to do the metrics of
        the last epoch trained (their totals are in the checkpoint), or
        empty lists when it holds none."""
        history = getattr(self.model, "history", None)
        if not isinstance(history, keras.callbacks.History):
            return
        results = self.model.get_metrics_result()
        kept = bool(restored.fingerprint.group(fingerprints.METRICS))
        for name, value in results.items():
            values = history.history.setdefault(name, [])
            if kept:
                values.append(float(value))

    def on_epoch_begin(self, epoch, logs=None):
        super().on_epoch_begin(epoch, logs)
        if epoch != self._resume_epoch:
            return
        if self._skip:
            for variable, value in self._saved_metrics:
                variable.assign(value)
            self._skip_remaining = self._skip
        else:
            self._restore_random_state()

    def _restore_random_state(self):
        """Put back Keras' global random state where the data and the
        callbacks are where they were when it was saved: after the batches
        trained before the checkpoint were read."""
        if self._saved_random_state is not None:
            global_random.restore(self._saved_random_state)
            self._saved_random_state = None

    def on_train_batch_end(self, batch, logs=None):
        if self._resume_epoch is not None and batch < self._skip:
            compat.orbax_skip_batch(self, batch)
            if batch == self._skip - 1:
                self._restore_random_state()
            return
        super().on_train_batch_end(batch, logs)
        self._batches_trained += 1
        if self.stop_request.should_stop(self._batches_trained):
            compat.orbax_save_now(self, logs)
            self.wait_until_finished()
            self.model.stop_training = True

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self._resume_epoch:
            self._resume_epoch, self._skip = None, 0
            self._saved_metrics = []
        super().on_epoch_end(epoch, logs)

    def on_train_end(self, logs=None):
        try:
            super().on_train_end(logs)
        finally:
            self._unwrap()
            compat.set_initial_epoch(self.model, None)
            self._resume_epoch, self._skip, self._skip_remaining = None, 0, 0
            self._saved_metrics, self._saved_random_state = [], None
            self.stop_request.finish()
