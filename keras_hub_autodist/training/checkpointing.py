"""Restore a bound model's whole training state, or say what would be lost.

A bound model's `load_weights` runs here (`restore`), inside the model's
distribution:

1. When the checkpoint holds optimizer slots, the optimizer is built first,
   so that Keras has variables to put them in (an unbuilt optimizer has only
   `iteration` and `learning_rate`, and Keras skips the rest with a warning).
2. Every variable, optimizer and metrics included, is given a lasting layout
   on the mesh (`placement.py`), so what is restored lands on its shards and
   stays there at the next assignment.
3. The checkpoint is compared with the model: a restore that would keep the
   weights but drop or mix the optimizer's state raises `RestoreError`.
4. Orbax checkpoints (folders written by `keras.callbacks.OrbaxCheckpoint`
   or `ResumableCheckpoint`) are read with each array's target sharding, so
   every process reads only its own shards, on the same mesh or another one.
   Keras' `.weights.h5` and `.keras` files go through Keras' own loader.

`ResumableCheckpoint` is `keras.callbacks.OrbaxCheckpoint` that also resumes:
at the start of `fit` it restores the newest complete checkpoint (with the
metrics' totals and Keras' global random state) and skips the batches of the
current epoch that were already trained on. It also saves and stops on
`SIGTERM` or past a time limit, at the same batch in every process
(`stopping.py`).
"""

from __future__ import annotations

import os
import warnings
import zipfile

import jax
import keras

from keras_hub_autodist import compat
from keras_hub_autodist.errors import RestoreError
from keras_hub_autodist.training import global_random
from keras_hub_autodist.training.placement import build_optimizer
from keras_hub_autodist.training.placement import place_state
from keras_hub_autodist.training.stopping import StopRequest
from keras_hub_autodist.training.stopping import check_batch_count

# An optimizer that was never built holds these two variables only.
UNBUILT_OPTIMIZER_VARIABLES = 2
# Groups of Keras' state tree (`model.get_state_tree()`).
WEIGHT_GROUPS = ("trainable_variables", "non_trainable_variables")
OPTIMIZER_GROUP = "optimizer_variables"
METRICS_GROUP = "metrics_variables"
_RESTORED_ATTR = "_keras_hub_autodist_restored_optimizer"


def _orbax():
    try:
        import orbax.checkpoint as ocp
    except ImportError as error:
        raise RestoreError(
            "Restoring an Orbax checkpoint needs the `orbax-checkpoint` "
            "package. Install it with `pip install orbax-checkpoint`. "
            f"Received: {error}"
        ) from error
    return ocp.v1


def is_orbax_folder(path: str) -> bool:
    """Whether `path` is a folder of Orbax checkpoints, or one of them."""
    if not os.path.isdir(path):
        return False
    names = os.listdir(path)
    markers = {"pytree", "_CHECKPOINT_METADATA", "orbax.checkpoint"}
    return bool(markers & set(names)) or any(
        n.isdigit() and os.path.isdir(os.path.join(path, n)) for n in names
    )


def latest_step_folder(path: str) -> str:
    """The newest complete checkpoint of an Orbax folder (or `path` itself
    when it is one checkpoint). Folders still being written are never
    picked: Orbax writes each into a temporary name and renames it when
    complete.
    """
    names = os.listdir(path)
    if not any(n.isdigit() and os.path.isdir(os.path.join(path, n)) for n in names):
        return path
    latest = _orbax().training.Checkpointer(directory=path).latest
    if latest is None:
        raise RestoreError(
            f"The folder {path!r} holds no complete Orbax checkpoint (only "
            "folders still being written, or none). Restore from an earlier "
            f"copy, or start without restoring. Received: filepath={path!r}"
        )
    return os.path.join(path, str(latest.step))


def saved_optimizer_variables(path: str) -> int | None:
    """How many optimizer variables a Keras weights file holds; None when
    the format isn't one this check reads (a sharded `.weights.json`)."""
    import h5py

    def count(file):
        with h5py.File(file, "r") as f:
            group = f.get("optimizer/vars")
            return 0 if group is None else len(group)

    if path.endswith(".keras") and zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as archive:
            if "model.weights.h5" not in archive.namelist():
                return None
            with archive.open("model.weights.h5") as member:
                return count(member)
    if path.endswith(".weights.h5") and os.path.isfile(path):
        return count(path)
    return None


def _optimizer(model):
    optimizer = getattr(model, "optimizer", None)
    return optimizer if isinstance(optimizer, keras.optimizers.Optimizer) else None


def _check_optimizer_state(model, saved: int, source: str) -> bool:
    """Raise `RestoreError` when restoring `saved` optimizer variables into
    `model` would lose or mix state; True when the optimizer is restored."""
    optimizer = _optimizer(model)
    has_slots = saved > UNBUILT_OPTIMIZER_VARIABLES
    if optimizer is None:
        if has_slots:
            warnings.warn(
                f"{source} holds optimizer state ({saved} variables) but the "
                "model is not compiled: only its weights are restored. To "
                "resume training, call `compile` first, then `load_weights`.",
                stacklevel=4,
            )
        return False
    if not has_slots:
        if int(optimizer.iterations) > 0:
            raise RestoreError(
                f"{source} holds weights but no optimizer state, while the "
                f"model's optimizer has taken {int(optimizer.iterations)} "
                "steps: loading would mix the new weights with the "
                "optimizer state of the current run. To start training from "
                "these weights with a fresh optimizer, call `compile` again "
                "before `load_weights`; to resume a run, restore a checkpoint "
                "saved with its optimizer (`save_weights` or `OrbaxCheckpoint` "
                "after training started). Received: a weights-only checkpoint"
            )
        return False
    build_optimizer(model)
    if saved != len(optimizer.variables):
        raise RestoreError(
            f"{source} holds {saved} optimizer variables but the model's "
            f"optimizer {optimizer.name!r} ({type(optimizer).__name__}) has "
            f"{len(optimizer.variables)}: Keras would restore the weights and "
            "skip the optimizer state. Compile with the optimizer the "
            "checkpoint was trained with, then call `load_weights`. "
            f"Received: {saved} saved optimizer variables"
        )
    return True


def _flat(tree, prefix=""):
    found = {}
    for key, value in (tree or {}).items():
        if isinstance(value, dict):
            found.update(_flat(value, f"{prefix}{key}/"))
        else:
            found[f"{prefix}{key}"] = value
    return found


def _without_owner(path):
    """An optimizer variable's path without the optimizer's own name, which
    Keras numbers per process (`adam`, `adam_1`, ...)."""
    return path.split("/", 1)[-1]


def _live_groups(model):
    optimizer = _optimizer(model)
    return {
        "trainable_variables": {v.path: v for v in model.trainable_variables},
        "non_trainable_variables": {v.path: v for v in model.non_trainable_variables},
        OPTIMIZER_GROUP: {
            _without_owner(v.path): v
            for v in (optimizer.variables if optimizer is not None else [])
        },
        METRICS_GROUP: {v.path: v for v in getattr(model, "metrics_variables", [])},
    }


def _restore_orbax(model, distribution, path: str) -> bool:
    """Restore an Orbax checkpoint into `model`, each array read straight into
    its target sharding. Returns whether the optimizer state was restored."""
    ocp = _orbax()
    folder = latest_step_folder(os.path.abspath(path))
    metadata = ocp.pytree_metadata(folder, checkpointable_name="pytree").metadata
    saved = {group: _flat(tree) for group, tree in metadata.items()}
    saved_optimizer = saved.get(OPTIMIZER_GROUP, {})
    restored = _check_optimizer_state(
        model, len(saved_optimizer), f"The Orbax checkpoint {folder!r}"
    )
    place_state(model, distribution)
    live = _live_groups(model)
    for group in WEIGHT_GROUPS:
        missing = sorted(set(live[group]) - set(saved.get(group, {})))
        extra = sorted(set(saved.get(group, {})) - set(live[group]))
        if missing or extra:
            raise RestoreError(
                f"The Orbax checkpoint {folder!r} does not match the model's "
                f"{group.replace('_', ' ')}: missing {missing[:3]}, unknown "
                f"{extra[:3]}. Restore a checkpoint of this model (same "
                "preset, same LoRA rank). Received: "
                f"{len(missing)} missing and {len(extra)} unknown paths"
            )
    if restored:
        names = {_without_owner(p) for p in saved_optimizer}
        if names != set(live[OPTIMIZER_GROUP]):
            raise RestoreError(
                f"The optimizer variables of {folder!r} are not those of the "
                "model's optimizer: its state would be dropped. Compile with "
                "the optimizer the checkpoint was trained with. Received: "
                f"{sorted(names - set(live[OPTIMIZER_GROUP]))[:3]}"
            )
    replicated = jax.sharding.NamedSharding(
        distribution.device_mesh.backend_mesh, jax.sharding.PartitionSpec()
    )
    targets = {}  # (group, saved path) -> the variable it restores

    def abstract(group, path, meta):
        key = _without_owner(path) if group == OPTIMIZER_GROUP else path
        variable = live.get(group, {}).get(key)
        if group == OPTIMIZER_GROUP and not restored:
            variable = None
        if variable is not None and tuple(variable.shape) != tuple(meta.shape):
            variable = None
        sharding = replicated
        if variable is not None:
            targets[(group, path)] = variable
            sharding = compat.variable_layout(variable).backend_layout
        return jax.ShapeDtypeStruct(meta.shape, meta.dtype, sharding=sharding)

    def walk(group, tree, prefix=""):
        return {
            key: walk(group, value, f"{prefix}{key}/")
            if isinstance(value, dict)
            else abstract(group, f"{prefix}{key}", value)
            for key, value in tree.items()
        }

    target_tree = {group: walk(group, tree) for group, tree in metadata.items()}
    loaded = ocp.load_checkpointables(folder, {"pytree": target_tree})["pytree"]
    for group, tree in loaded.items():
        for path, value in _flat(tree).items():
            variable = targets.get((group, path))
            if variable is not None:
                variable.assign(value)
    return restored


def restore(load_weights, model, distribution, filepath=None, *args, **kwargs):
    """`model.load_weights(filepath, ...)` for a bound model, run inside its
    distribution (see the module docstring).

    Args:
        load_weights: the model's own `load_weights` method.
        model: the bound model.
        distribution: its distribution; the caller has entered its scope.
        filepath: a `.weights.h5` or `.keras` file, or an Orbax folder.
        *args: passed to `load_weights`.
        **kwargs: passed to `load_weights`.

    Example:
    ```python
    lm.compile(optimizer="adam", loss=loss)
    lm.load_weights("checkpoints/")  # weights, optimizer slots, iteration
    ```
    """
    if filepath is None:
        filepath = kwargs.pop("filepath")
    path = os.fspath(filepath)
    place_state(model, distribution)
    if is_orbax_folder(path) and not args and not kwargs:
        restored = _restore_orbax(model, distribution, path)
        result = None
    else:
        saved = saved_optimizer_variables(path)
        restored = False
        if saved is not None:
            restored = _check_optimizer_state(model, saved, f"The file {path!r}")
        place_state(model, distribution)
        result = load_weights(filepath, *args, **kwargs)
    place_state(model, distribution)
    object.__setattr__(model, _RESTORED_ATTR, _optimizer(model) if restored else None)
    return result


def note_compiled(model) -> None:
    """Warn when `compile` replaced an optimizer whose state was restored."""
    restored = getattr(model, _RESTORED_ATTR, None)
    if restored is not None and restored is not _optimizer(model):
        object.__setattr__(model, _RESTORED_ATTR, None)
        warnings.warn(
            "`compile` replaced the optimizer whose state `load_weights` "
            "restored: training starts with a fresh optimizer. To resume, "
            "call `compile` first, then `load_weights`.",
            stacklevel=3,
        )


class ResumableCheckpoint(keras.callbacks.OrbaxCheckpoint):
    """`keras.callbacks.OrbaxCheckpoint` that resumes where training stopped.

    Saves the weights, the optimizer state and its iteration count, the
    metrics' running totals and Keras' global random state every
    `save_freq` batches, as Orbax checkpoints numbered by the number of
    batches trained. At the start of `fit`, the newest complete checkpoint in
    `directory` is restored (for a bound model, straight into the model's
    layouts, on the same mesh or another), and training continues from the
    epoch and the batch within it where that checkpoint was taken: the
    batches of that epoch already trained on are read from the data and
    skipped, not trained on again. The data must come in the same order in
    each run (`shuffle=False`, or a seeded, deterministic dataset) and have a
    known number of batches per epoch.

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
        save_freq: save every this many batches.
        max_to_keep: how many of the newest checkpoints to keep.
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
        check_batch_count(
            "save_freq",
            save_freq,
            "Checkpoints are numbered by batches trained, so that a run can "
            "resume within an epoch. Pass an integer >= 1, e.g. the number "
            "of batches per epoch.",
        )
        self.stop_request = StopRequest(
            on_sigterm=save_on_sigterm,
            time_limit=time_limit,
            check_freq=stop_check_freq,
        )
        super().__init__(
            os.path.abspath(os.fspath(directory)),  # Orbax wants absolute
            save_freq=save_freq,
            max_to_keep=max_to_keep,
            save_on_background=save_on_background,
        )
        self.checkpointer = global_random.CheckpointerWithRandomState(self.checkpointer)
        self.resumed_from = None
        self._resume_epoch = None
        self._skip = 0
        self._saved_metrics = []  # (variable, value) of the resumed epoch
        self._saved_random_state = None
        self._batches_trained = 0

    @property
    def save_on_sigterm(self) -> bool:
        return self.stop_request.on_sigterm

    @property
    def time_limit(self) -> float | None:
        return self.stop_request.time_limit

    @property
    def stop_check_freq(self) -> int:
        return self.stop_request.check_freq

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        self._batches_trained = 0
        self._saved_metrics, self._saved_random_state = [], None
        self.stop_request.start()
        latest = self.checkpointer.latest
        if latest is None:
            return
        folder = os.path.join(self.directory, str(latest.step))
        self.model.load_weights(folder)
        self.resumed_from = folder
        optimizer = _optimizer(self.model)
        done = int(optimizer.iterations) if optimizer is not None else latest.step
        steps = (self.params or {}).get("steps")
        if not steps:
            raise RestoreError(
                "Resuming within an epoch needs the number of batches per "
                "epoch: pass `steps_per_epoch=` to `fit`, or data of known "
                f"length. Received: fit with unknown steps, checkpoint {folder!r}"
            )
        epoch, self._skip = divmod(done, steps)
        if self._skip and self.model.steps_per_execution != 1:
            raise RestoreError(
                "Resuming within an epoch skips batches one at a time: compile "
                "with `steps_per_execution=1`. Received: steps_per_execution="
                f"{self.model.steps_per_execution}"
            )
        self._resume_epoch = epoch
        # `fit` resets the metrics at the start of each epoch: their restored
        # totals are put back after that reset (`on_epoch_begin`).
        self._saved_metrics = [(v, v.value) for v in self.model.metrics_variables]
        self._saved_random_state = global_random.load(folder)
        compat.orbax_resume_counters(self, done)
        compat.set_initial_epoch(self.model, epoch)

    def on_epoch_begin(self, epoch, logs=None):
        super().on_epoch_begin(epoch, logs)
        if epoch != self._resume_epoch:
            return
        if self._skip:
            for variable, value in self._saved_metrics:
                variable.assign(value)
            self._skip_batches(self._skip)
        else:
            self._restore_random_state()

    def _skip_batches(self, count):
        """Make the next `count` train steps read their batch and train on
        nothing."""
        model = self.model
        original = model.train_function
        remaining = [count]

        def skip_or_train(state, iterator):
            if remaining[0] == 0:
                model.train_function = original
                return original(state, iterator)
            next(iterator)
            remaining[0] -= 1
            return {}, state

        model.train_function = skip_or_train

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
            compat.set_initial_epoch(self.model, None)
            self._resume_epoch, self._skip = None, 0
            self._saved_metrics, self._saved_random_state = [], None
            self.stop_request.finish()
