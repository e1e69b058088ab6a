"""Restore a bound model's whole training state, or say what would be lost.

A bound model's `load_weights` runs here (`restore`), inside the model's
distribution:

1. What the checkpoint holds is compared with the model before anything is
   assigned (`fingerprint.py`, `weights_files.py`): every variable's path,
   shape and dtype, LoRA kernels and optimizer slots included, and the
   optimizer's class. Any difference raises `RestoreError`, which lists each
   differing variable and says how to fix it; nothing is restored in part.
2. When the checkpoint holds optimizer slots, the optimizer is built first,
   so that Keras has variables to put them in; a restore that would keep the
   weights but drop or mix the optimizer's state raises `RestoreError`.
3. Every variable, optimizer and metrics included, is given a lasting layout
   on the mesh (`placement.py`), so what is restored lands on its shards and
   stays there at the next assignment.
4. Orbax checkpoints (folders written by `keras.callbacks.OrbaxCheckpoint`
   or `ResumableCheckpoint`) are read with each array's target sharding, so
   every process reads only its own shards, on the same mesh or another one.
   In a folder of checkpoints, the newest complete one is restored: a newest
   one that is damaged (an empty folder, files missing or truncated) is
   skipped with a warning naming it, for the one before. Keras' `.weights.h5`
   and `.keras` files go through Keras' own loader once checked.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from collections.abc import Mapping
from typing import NamedTuple

import jax

from keras_hub_autodist import compat
from keras_hub_autodist.errors import AutodistError
from keras_hub_autodist.errors import RestoreError
from keras_hub_autodist.errors import warn
from keras_hub_autodist.training import fingerprint as fingerprints
from keras_hub_autodist.training.fingerprint import Fingerprint
from keras_hub_autodist.training.placement import place_state
from keras_hub_autodist.training.stopping import any_process
from keras_hub_autodist.training.weights_files import check_optimizer_state
from keras_hub_autodist.training.weights_files import check_weights_file

_RESTORED_ATTR = "_keras_hub_autodist_restored_optimizer"
# Names Orbax gives what it writes: a checkpoint's own files, and the
# temporary name of one being written.
ORBAX_MARKERS = ("pytree", "_CHECKPOINT_METADATA", "orbax.checkpoint")
ORBAX_TEMPORARY = ".orbax-checkpoint-tmp"
# A damaged step folder is renamed so (`move_damaged=True`).
DAMAGED_SUFFIX = ".damaged"


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


def step_numbers(directory: str) -> list[int]:
    """The steps of a folder of Orbax checkpoints, newest first (folders
    named by a number; those being written have a temporary name)."""
    if not os.path.isdir(directory):
        return []
    return sorted(
        (
            int(name)
            for name in os.listdir(directory)
            if name.isdigit() and os.path.isdir(os.path.join(directory, name))
        ),
        reverse=True,
    )


class Damaged(Exception):
    """A step folder that can't be read whole (internal: it is skipped)."""


class RestoredStep(NamedTuple):
    """What `restore_orbax` restored.

    Args:
        folder: the checkpoint's folder.
        step: its step (None when `path` was the checkpoint itself).
        fingerprint: what it held (`Training` too when it recorded one).
        optimizer_restored: whether the optimizer's state was restored.
        extras: the other checkpointables asked for, by name.
    """

    folder: str
    step: int | None
    fingerprint: Fingerprint
    optimizer_restored: bool
    extras: dict


def _read_step(ocp, folder: str):
    """The metadata of a checkpoint's `pytree` and its stored fingerprint."""
    # `metadata` replaces `pytree_metadata` (deprecated) in newer Orbax.
    reader = ocp.metadata if callable(getattr(ocp, "metadata", None)) else None
    reader = reader or ocp.pytree_metadata
    try:
        metadata = reader(folder, checkpointable_name="pytree").metadata
    except Exception as error:  # Orbax's errors have no common base
        raise Damaged(f"its `pytree` can't be read ({type(error).__name__})") from error
    if not isinstance(metadata, Mapping) or not metadata:
        raise Damaged("its `pytree` has no readable arrays (files missing, truncated)")
    stored = None
    if os.path.isdir(os.path.join(folder, fingerprints.STORED_NAME)):
        try:
            loaded = ocp.load_checkpointables(folder, {fingerprints.STORED_NAME: None})
            stored = Fingerprint.from_json(loaded[fingerprints.STORED_NAME]["json"])
        except Exception as error:
            raise Damaged(
                f"its fingerprint can't be read ({type(error).__name__})"
            ) from error
    saved = fingerprints.from_state_metadata(
        metadata,
        stored.optimizer if stored else None,
        stored.training if stored else None,
    )
    return metadata, saved


def check_state(model, saved: Fingerprint, source: str, all_metrics=False) -> bool:
    """Compare a checkpoint of Keras' state tree with `model` (see the module
    docstring); return whether its optimizer state is to be restored.

    Args:
        model: the model, its optimizer built or not.
        saved: the checkpoint's fingerprint.
        source: what the checkpoint is, for messages.
        all_metrics: compare every metric variable (once `fit` built them),
            not only those both sides have.

    Raises:
        RestoreError: any difference.
    """
    current = fingerprints.of_model(model)
    error = fingerprints.mismatch_error(source, saved, current, fingerprints.WEIGHTS)
    if error is not None:
        raise error
    saved_optimizer = saved.group(fingerprints.OPTIMIZER)
    restored = check_optimizer_state(model, len(saved_optimizer), source)
    current = fingerprints.of_model(model)  # with the optimizer's slots
    groups = (fingerprints.OPTIMIZER,) if restored else ()
    error = fingerprints.mismatch_error(
        source, saved, current, (*groups, fingerprints.METRICS), all_metrics=all_metrics
    )
    if error is not None:
        raise error
    return restored


def _sharding(variable, fallback):
    layout = compat.variable_layout(variable)
    if layout is not None:
        return getattr(layout, "backend_layout", layout)
    return getattr(variable.value, "sharding", fallback)


def _load(ocp, model, distribution, folder, metadata, restored, extras):
    """Read every array of the checkpoint into its target sharding; assign
    them only once all of them were read."""
    if distribution is not None:
        replicated = jax.sharding.NamedSharding(
            distribution.device_mesh.backend_mesh, jax.sharding.PartitionSpec()
        )
    else:
        replicated = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    live = fingerprints.live_variables(model)
    targets = {}  # (group, saved path) -> the variable it restores
    keys = {  # group -> saved path -> the key of the live variable
        group: fingerprints.saved_keys(
            group, (path for path, _ in fingerprints.flat_items(tree or {}))
        )
        for group, tree in metadata.items()
    }

    def abstract(group, path, meta):
        variable = live.get(group, {}).get(keys[group][path])
        if group == fingerprints.OPTIMIZER and not restored:
            variable = None
        sharding = replicated
        if variable is not None and tuple(variable.shape) == tuple(meta.shape):
            targets[(group, path)] = variable
            sharding = _sharding(variable, replicated)
        return jax.ShapeDtypeStruct(meta.shape, meta.dtype, sharding=sharding)

    def walk(group, tree, prefix=""):
        return {
            key: walk(group, value, f"{prefix}{key}/")
            if isinstance(value, Mapping)
            else abstract(group, f"{prefix}{key}", value)
            for key, value in tree.items()
        }

    wanted = {"pytree": {g: walk(g, t or {}) for g, t in metadata.items()}}
    for name in extras:
        if os.path.isdir(os.path.join(folder, name)):
            wanted[name] = None
    loaded = ocp.load_checkpointables(folder, wanted)
    pairs = []
    for group, tree in loaded["pytree"].items():
        for path, value in fingerprints.flat_items(tree):
            variable = targets.get((group, path))
            if variable is not None:
                pairs.append((variable, value))
    return pairs, {n: loaded.get(n) for n in extras}


def _move_aside(folders: list[str]) -> list[str]:
    """Rename damaged step folders so that Orbax neither lists them nor
    collides with them when it saves that step again; nothing is deleted."""
    moved = []
    for folder in folders:
        target, n = folder + DAMAGED_SUFFIX, 1
        while os.path.exists(target):
            n += 1
            target = f"{folder}{DAMAGED_SUFFIX}-{n}"
        moved.append(target)
        if jax.process_index() == 0:
            os.rename(folder, target)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("keras_hub_autodist_damaged_steps")
    return moved


def restore_orbax(
    model,
    distribution,
    path: str,
    *,
    check: Callable[[RestoredStep], None] | None = None,
    extras: tuple[str, ...] = (),
    all_metrics: bool = False,
    move_damaged: bool = False,
) -> RestoredStep:
    """Restore an Orbax checkpoint into `model`, each array read straight
    into its target sharding (every process calls it).

    Args:
        model: the model.
        distribution: its distribution, or None for an unbound model.
        path: a folder of checkpoints (the newest complete one is restored)
            or one checkpoint.
        check: called with what the chosen checkpoint holds, after it was
            compared with the model and before anything is assigned; raises
            to refuse it.
        extras: other checkpointables to read with it (None when absent).
        all_metrics: see `check_state`.
        move_damaged: rename the damaged newer step folders that were skipped
            (`<step>.damaged`), for a run that goes on saving there.

    Raises:
        RestoreError: the checkpoint does not match the model, or no
            checkpoint in `path` can be read whole.
    """
    ocp = _orbax()
    path = os.path.abspath(path)
    steps = step_numbers(path)
    candidates = [(s, os.path.join(path, str(s))) for s in steps] or [(None, path)]
    skipped = []  # (folder, why)
    for step, folder in candidates:
        source = f"The Orbax checkpoint {folder!r}"
        try:
            metadata, saved = _read_step(ocp, folder)
        except Damaged as damage:
            skipped.append((folder, str(damage)))
            continue
        restored = check_state(model, saved, source, all_metrics)
        if distribution is not None:  # the optimizer's new slots too
            place_state(model, distribution)
        chosen = RestoredStep(folder, step, saved, restored, {})
        if check is not None:
            check(chosen)
        failure = None
        try:
            pairs, found = _load(
                ocp, model, distribution, folder, metadata, restored, extras
            )
        except AutodistError:
            raise
        except Exception as error:  # a damaged array file
            failure = error
        if any_process(failure is not None):
            why = type(failure).__name__ if failure else "another process failed"
            skipped.append((folder, f"its arrays can't be read ({why})"))
            continue
        for variable, value in pairs:
            variable.assign(value)
        if skipped:
            _warn_skipped(path, skipped, chosen, move_damaged and step is not None)
        return chosen._replace(extras=found)
    listed = "; ".join(f"{f}: {why}" for f, why in skipped)
    if steps:
        raise RestoreError(
            f"The folder {path!r} holds no complete Orbax checkpoint: {listed}. "
            "Restore from an earlier copy, or start in a new folder. Received: "
            f"filepath={path!r}"
        )
    raise RestoreError(
        f"{listed}: not a complete Orbax checkpoint. Restore from another copy, "
        "or pass the folder of checkpoints to restore the newest complete one. "
        f"Received: filepath={path!r}"
    )


def _warn_skipped(path, skipped, chosen, move):
    names = [os.path.basename(f) for f, _ in skipped]
    moved = ""
    if move:
        targets = _move_aside([f for f, _ in skipped])
        moved = (
            " They were renamed to "
            + ", ".join(os.path.basename(t) for t in targets)
            + ", so that new checkpoints can be written there; nothing was deleted."
        )
    reasons = "; ".join(f"{os.path.basename(f)}: {why}" for f, why in skipped)
    warn(
        f"Skipped the damaged newest checkpoint(s) {', '.join(names)} of "
        f"{path!r} ({reasons}) and restored step {chosen.step}, the last "
        f"complete one.{moved}",
    )


def restore_state(model, distribution, path: str, **options) -> RestoredStep:
    """`restore_orbax`, with the model's state placed on its mesh before and
    after (a bound model) and the restored optimizer remembered for
    `note_compiled`."""
    if distribution is not None:
        place_state(model, distribution)
    restored = restore_orbax(model, distribution, path, **options)
    if distribution is not None:
        place_state(model, distribution)
    _remember(model, restored.optimizer_restored)
    return restored


def _remember(model, restored: bool) -> None:
    optimizer = fingerprints.model_optimizer(model)
    object.__setattr__(model, _RESTORED_ATTR, optimizer if restored else None)


def restore(load_weights, model, distribution, filepath=None, *args, **kwargs):
    """`model.load_weights(filepath, ...)` for a bound model, run inside its
    distribution (see the module docstring).

    Args:
        load_weights: the model's own `load_weights` method.
        model: the bound model.
        distribution: its distribution; the caller has entered its scope.
        filepath: a `.weights.h5`, `.weights.json` or `.keras` file, or an
            Orbax folder (of checkpoints, or one of them).
        *args: passed to `load_weights`.
        **kwargs: passed to `load_weights` (`skip_mismatch=True` restores
            what fits, as Keras does, unchecked).

    Raises:
        RestoreError: the checkpoint is of another model, optimizer or LoRA
            rank, would lose optimizer state, or can't be read whole.

    Example:
    ```python
    lm.compile(optimizer="adam", loss=loss)
    lm.load_weights("checkpoints/")  # weights, optimizer slots, iteration
    ```
    """
    if filepath is None:
        filepath = kwargs.pop("filepath")
    path = os.fspath(filepath)
    if os.path.isdir(path) and not args and not kwargs:
        restore_state(model, distribution, path)
        return None
    place_state(model, distribution)
    restored = False
    if not kwargs.get("skip_mismatch") and not args:
        restored = check_weights_file(model, path)
    place_state(model, distribution)
    result = load_weights(filepath, *args, **kwargs)
    place_state(model, distribution)
    _remember(model, restored)
    return result


def note_compiled(model) -> None:
    """Warn when `compile` replaced an optimizer whose state was restored."""
    restored = getattr(model, _RESTORED_ATTR, None)
    if restored is not None and restored is not fingerprints.model_optimizer(model):
        object.__setattr__(model, _RESTORED_ATTR, None)
        warn(
            "`compile` replaced the optimizer whose state `load_weights` "
            "restored: training starts with a fresh optimizer. To resume, "
            "call `compile` first, then `load_weights`.",
        )
