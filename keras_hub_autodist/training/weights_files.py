"""Keras' weights files, checked against the model before Keras loads them,
and the fingerprint written into them.

`save_weights` writes a `.weights.h5` (or, with `max_shard_size=`, a
`.weights.json` naming its `.weights.h5` shards) and `save` a `.keras` zip
whose `model.weights.h5` is the same format: one HDF5 dataset per variable,
`<saveable path>/vars/<index>`, and the optimizer's variables under
`optimizer/vars`. Keras writes a layer with LoRA enabled with its LoRA kernels
merged into its kernel, and zeroes them when it loads one.

Before a bound model's `load_weights` hands such a file to Keras' loader,
`check_weights_file` compares what the file holds with what Keras would write
for the model now (`weights_file_datasets`):

1. every dataset of the layers: same paths, same shapes and dtypes;
2. the optimizer state, when the model is compiled and the file holds some:
   the optimizer's class (from the file's fingerprint), and the shape of each
   of its variables, one by one.

Any difference raises `RestoreError` before anything is assigned. Files
without a fingerprint (older saves, plain Keras files) are checked the same
way; only the optimizer's class and the LoRA rank of the run that wrote them
are then unknown.

A bound model's `save_weights` and `save` write the model's fingerprint
(`fingerprint.py`) into the file, as the root dataset
`keras_hub_autodist_fingerprint` (`recording_fingerprint`), through the
weight stores of `weight_stores.py`.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import zipfile

from keras_hub_autodist import compat
from keras_hub_autodist.errors import RestoreError
from keras_hub_autodist.errors import warn
from keras_hub_autodist.saving.weight_stores import root_datasets_written
from keras_hub_autodist.training import fingerprint as fingerprints
from keras_hub_autodist.training.fingerprint import Fingerprint
from keras_hub_autodist.training.optimizer_state import optimizer_chain
from keras_hub_autodist.training.placement import build_optimizer

# An optimizer that was never built holds these two variables only
# (`iteration` and `learning_rate`), and a wrapper two per optimizer.
UNBUILT_OPTIMIZER_VARIABLES = 2
KERAS_ARCHIVE_WEIGHTS = "model.weights.h5"
# Keras' weights files (`.weights.h5`, the `model.weights.h5` of a `.keras`)
# hold each saveable's variables in a group `<path>/vars`, one dataset per
# variable, named by its index; `BaseOptimizer.save_own_variables` writes
# `optimizer/vars/<i>` for its i-th variable.
OPTIMIZER_H5_GROUP = "optimizer/vars"
_OPTIMIZER_PREFIX = OPTIMIZER_H5_GROUP + "/"
# Everything the optimizer writes, an inner optimizer's
# `optimizer/inner_optimizer/vars/<i>` included.
_OPTIMIZER_ROOT = "optimizer/"


def optimizer_file_groups(optimizer) -> dict[str, list]:
    """The groups Keras' `save_weights` writes for `optimizer` and each
    optimizer it keeps inside -> their variables, by index.

    Example:
    ```python
    list(optimizer_file_groups(lm.optimizer))
    # ['optimizer/vars', 'optimizer/inner_optimizer/vars']
    ```
    """
    return {
        "/".join(filter(None, ("optimizer", path, "vars"))): list(member.variables)
        for path, member in optimizer_chain(optimizer)
    }


def _recording_store(base):
    """A Keras weight store (a subclass of `base`, so that Keras' walk takes
    it) that keeps what it is handed and writes nothing."""

    class RecordingStore(base):
        def __init__(self):
            self.mode = "w"
            self.archive = None
            self.io_file = None
            self.entries = {}
            self._group = "vars"

        def __bool__(self):
            return True

        def make(self, path, metadata=None):
            self._group = f"{path}/vars" if path else "vars"
            return self

        def __setitem__(self, key, value):
            self.entries[f"{self._group}/{key}"] = value

        def close(self):
            pass

    return RecordingStore()


def weights_file_datasets(model) -> dict[str, object]:
    """The datasets Keras' `save_weights` writes for `model`, but the
    optimizer's (`OPTIMIZER_H5_GROUP`): HDF5 path -> the variable (or, for a
    layer that merges LoRA kernels into its kernel, the array) it holds.

    Found by Keras' own walk (`compat.save_state`) into a store that keeps
    what it is handed and writes nothing.

    Example:
    ```python
    shapes = {key: v.shape for key, v in weights_file_datasets(model).items()}
    ```
    """
    optimizer = getattr(model, "optimizer", None)
    skipped = {id(optimizer)} if optimizer is not None else set()
    return compat.save_state(model, _recording_store, skipped).entries


class WeightsFile:
    """What a Keras weights file holds.

    Args:
        datasets: HDF5 path -> (shape, dtype) of each variable's dataset,
            the optimizer's included.
        fingerprint: the fingerprint written with it, or None.
    """

    def __init__(self, datasets: dict, fingerprint: Fingerprint | None):
        self.datasets = datasets
        self.fingerprint = fingerprint

    def layers(self) -> dict:
        return {
            k: v for k, v in self.datasets.items() if not k.startswith(_OPTIMIZER_ROOT)
        }

    def optimizer_groups(self) -> dict[str, list]:
        """The optimizer's groups (`optimizer/vars`, and an inner
        optimizer's `optimizer/inner_optimizer/vars`) -> their variables'
        (shape, dtype), by index."""
        found = {}
        for key, spec in self.datasets.items():
            group, _, index = key.rpartition("/")
            if key.startswith(_OPTIMIZER_ROOT) and group.endswith("vars"):
                if index.isdigit():
                    found.setdefault(group, {})[int(index)] = spec
        return {g: [by[i] for i in sorted(by)] for g, by in found.items()}

    def optimizer(self) -> list:
        """The optimizer's own variables' (shape, dtype), by index (a
        wrapper's include its inner optimizer's)."""
        return self.optimizer_groups().get(OPTIMIZER_H5_GROUP, [])


def _dataset_spec(dataset):
    dtype = dataset.attrs.get("dtype")
    if isinstance(dtype, bytes):
        dtype = dtype.decode()
    return tuple(int(n) for n in dataset.shape), str(dtype or dataset.dtype.name)


def _read_h5(file, source: str, datasets: dict) -> Fingerprint | None:
    import h5py

    with h5py.File(file, "r") as f:
        found = None
        if fingerprints.STORED_NAME in f:
            text = f[fingerprints.STORED_NAME][()]
            try:
                found = Fingerprint.from_json(text)
            except ValueError as error:
                warn(
                    f"{source} holds {error}: it is checked by its datasets alone.",
                )

        def visit(name, item):
            if isinstance(item, h5py.Dataset) and name != fingerprints.STORED_NAME:
                datasets[name] = _dataset_spec(item)

        f.visititems(visit)
    return found


def read_weights_file(path: str) -> WeightsFile | None:
    """What the Keras weights file `path` holds; None when it is not one of
    the formats read here (`.weights.h5`, `.weights.json`, `.keras`).

    Raises:
        RestoreError: the file can't be read (damaged, truncated).
    """
    source = f"The file {path!r}"
    datasets = {}
    try:
        if path.endswith(".keras") and zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as archive:
                if KERAS_ARCHIVE_WEIGHTS not in archive.namelist():
                    return None
                with archive.open(KERAS_ARCHIVE_WEIGHTS) as member:
                    found = _read_h5(member, source, datasets)
        elif path.endswith(".weights.h5") and os.path.isfile(path):
            found = _read_h5(path, source, datasets)
        elif path.endswith(".weights.json") and os.path.isfile(path):
            with open(path) as index:
                shards = json.load(index)["weight_map"].values()
            names = sorted(
                {n for v in shards for n in (v if isinstance(v, list) else [v])}
            )
            found = None
            for name in names:
                shard = os.path.join(os.path.dirname(path), name)
                found = _read_h5(shard, source, datasets) or found
        else:
            return None
    except (OSError, KeyError, TypeError, ValueError, zipfile.BadZipFile) as error:
        raise RestoreError(
            f"{source} can't be read as a Keras weights file: {error}. It is "
            "damaged or was not written completely; restore from another "
            f"copy. Received: filepath={path!r}"
        ) from error
    return WeightsFile(datasets, found)


def _spec(value) -> tuple:
    return (
        tuple(int(n) for n in value.shape),
        fingerprints.stored_dtype(value.dtype),
    )


def check_optimizer_state(model, saved: int, source: str) -> bool:
    """Raise `RestoreError` when restoring `saved` optimizer variables into
    `model` would lose or mix state; warn when the model is not compiled.

    Returns:
        Whether the checkpoint's optimizer state is to be restored (the
        optimizer is then built, so that it has variables to receive it).
    """
    optimizer = fingerprints.model_optimizer(model)
    # A wrapper lists its inner optimizers' variables with its own.
    wrapped = len(optimizer_chain(optimizer)) if optimizer is not None else 1
    has_slots = saved > UNBUILT_OPTIMIZER_VARIABLES * wrapped
    if optimizer is None:
        if has_slots:
            warn(
                f"{source} holds optimizer state ({saved} variables) but the "
                "model is not compiled: only its weights are restored. To "
                "resume training, call `compile` first, then `load_weights`.",
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
    return True


def _labelled(entries: dict) -> dict:
    """HDF5 path -> its label in a message: the variable's path beside it."""
    return {
        key: f"{key} ({value.path})" if hasattr(value, "path") else key
        for key, value in entries.items()
    }


def _check_layers(model, saved: WeightsFile, source: str) -> None:
    entries = weights_file_datasets(model)
    labels = _labelled(entries)
    current = {labels[k]: _spec(v) for k, v in entries.items()}
    before = {labels.get(k, k): spec for k, spec in saved.layers().items()}
    lines = fingerprints.variable_differences(before, current)
    if not lines:
        return
    holds = f"{len(before)} weight datasets"
    has = f"{len(current)}"
    fix = fingerprints.weights_fix(
        Fingerprint({fingerprints.TRAINABLE: before}),
        Fingerprint({fingerprints.TRAINABLE: current}),
    )
    raise fingerprints.difference_error(source, holds, has, fix, lines)


def _lora_error(source, saved_rank, current_rank, saved_count, optimizer):
    run = f"a LoRA run of rank {saved_rank}" if saved_rank else "a run"
    model = (
        f"LoRA of rank {current_rank}" if current_rank else "no LoRA"
    ) + f", and {type(optimizer).__name__} with {len(optimizer.variables)} variables"
    return RestoreError(
        f"{source} holds the optimizer state of {run} ({saved_count} "
        f"variables); the model has {model}. Keras writes a weights file "
        "with each LoRA kernel merged into its layer's kernel, and zeroes a "
        "model's LoRA kernels when it loads one, so LoRA training can't "
        "resume from it: the LoRA kernels would restart from zero under "
        "their restored optimizer state. Resume from an Orbax checkpoint of "
        "the run (`ResumableCheckpoint` keeps the LoRA kernels). To use the "
        "LoRA weights elsewhere, save and load them with "
        "`backbone.save_lora_weights(...)` and "
        "`backbone.load_lora_weights(...)`; to load this file's merged "
        "weights as they are, pass `skip_mismatch=True` (Keras' loader, "
        "unchecked). Nothing was restored. Received: a weights file with "
        f"{saved_count} optimizer variables"
    )


def check_weights_file(model, path: str) -> bool:
    """Check the Keras weights file `path` against `model` (see the module
    docstring) before Keras loads it.

    Args:
        model: the bound model, its optimizer built or not.
        path: a `.weights.h5`, `.weights.json` or `.keras` file.

    Returns:
        Whether the file's optimizer state is to be restored.

    Raises:
        RestoreError: the file is of another model, another optimizer, a
            LoRA run (with optimizer state), or can't be read.
    """
    saved = read_weights_file(path)
    if saved is None:
        return False
    source = f"The file {path!r}"
    _check_layers(model, saved, source)
    saved_optimizer = saved.optimizer()
    current = fingerprints.of_model(model)
    saved_rank = saved.fingerprint.lora_rank() if saved.fingerprint else None
    current_rank = current.lora_rank()
    restored = check_optimizer_state(model, len(saved_optimizer), source)
    optimizer = fingerprints.model_optimizer(model)
    if not restored:
        if current_rank and optimizer is not None:
            warn(
                f"The model has LoRA of rank {current_rank}: Keras zeroes the "
                f"LoRA kernels when it loads {path!r} (a weights file holds "
                "them merged into the kernels), and with both LoRA factors "
                "zero their gradients are zero: LoRA won't train. Call "
                "`load_weights` before `enable_lora`.",
            )
        return False
    if saved_rank or current_rank:
        raise _lora_error(
            source, saved_rank, current_rank, len(saved_optimizer), optimizer
        )
    saved_class = saved.fingerprint.optimizer if saved.fingerprint else None
    current_class = type(optimizer).__name__
    fix = (
        "Compile with the optimizer the checkpoint was trained with, then "
        "call `load_weights`."
    )
    lines = []
    if saved_class and saved_class != current_class:
        lines = [f"optimizer: saved {saved_class}, the model has {current_class}"]
        fix = (
            f"The file was trained with {saved_class}: compile with "
            f"`keras.optimizers.{saved_class}`, then call `load_weights`."
        )
    else:
        lines = _optimizer_differences(saved, optimizer)
        if lines:
            fix += _BY_POSITION
    if lines:
        raise fingerprints.difference_error(
            source,
            f"{len(saved_optimizer)} optimizer variables"
            + (f" of {saved_class}" if saved_class else ""),
            f"the optimizer {optimizer.name!r} ({current_class}) with "
            f"{len(optimizer.variables)}",
            fix,
            lines,
        )
    return True


# A weights file stores the optimizer's variables by position.
_BY_POSITION = (
    " A weights file stores the optimizer's variables by position: a "
    "learning-rate schedule (no variable) in place of a constant rate (one "
    "variable), or the reverse, shifts them all. To resume with another "
    "schedule, resume from an Orbax checkpoint (`ResumableCheckpoint`), "
    "which matches them by name."
)


def _optimizer_differences(saved: WeightsFile, optimizer) -> list[str]:
    """One line per optimizer dataset that differs from what `optimizer`
    (and each optimizer it keeps inside) would write, group by group."""
    saved_groups = saved.optimizer_groups()
    live_groups = optimizer_file_groups(optimizer)
    before, now = {}, {}
    for group in sorted(set(saved_groups) | set(live_groups)):
        live = live_groups.get(group, [])
        for index, spec in enumerate(saved_groups.get(group, [])):
            name = live[index].path if index < len(live) else f"variable {index}"
            before[f"{group}/{index} ({name})"] = spec
        for index, variable in enumerate(live):
            now[f"{group}/{index} ({variable.path})"] = _spec(variable)
    return fingerprints.variable_differences(before, now)


# Set inside a `save_to_preset`: the saves it makes write no fingerprint.
_IN_PRESET_SAVE = contextvars.ContextVar(
    "keras_hub_autodist_in_preset_save", default=False
)


@contextlib.contextmanager
def recording_fingerprint(model, preset: bool = False):
    """A scope in which Keras' `save_weights` and `save` write `model`'s
    fingerprint into their HDF5 file (see the module docstring), in this
    thread (or task) only. With `preset=True` (`save_to_preset`: a preset is
    keras-hub's format, not a checkpoint), a scope in which they write none,
    also when the model's own bound `save_weights` runs inside it.

    Example:
    ```python
    with recording_fingerprint(lm):
        lm.save_weights("run.weights.h5")
    ```
    """
    if preset:
        token = _IN_PRESET_SAVE.set(True)
        try:
            yield
        finally:
            _IN_PRESET_SAVE.reset(token)
        return
    if _IN_PRESET_SAVE.get():
        yield
        return
    text = fingerprints.of_model(model).to_json()
    with root_datasets_written({fingerprints.STORED_NAME: text}):
        yield
