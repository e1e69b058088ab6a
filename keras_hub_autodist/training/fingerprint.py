"""What a checkpoint holds, recorded with it and compared with the model
before anything is restored.

A `Fingerprint` lists every variable of a model's training state by group,
as Keras' state tree groups them (`trainable_variables`,
`non_trainable_variables`, `optimizer_variables`, `metrics_variables`), each
with its shape and dtype; LoRA kernels and optimizer slots included. It also
names the optimizer's class and, for a checkpoint taken by a running `fit`,
the batch size and the batches per epoch of that fit (`Training`).

`ResumableCheckpoint` saves it beside each Orbax checkpoint, and a bound
model's `save_weights` and `save` write it into their HDF5 file
(`weights_files.py`). As JSON:

```
{"format": "keras_hub_autodist.fingerprint", "version": 1,
 "variables": {"trainable_variables": {"token_embedding/embeddings":
                                       [[100, 32], "float32"], ...},
               "non_trainable_variables": {...},
               "optimizer_variables": {"iteration": [[], "int32"], ...},
               "metrics_variables": {"loss/total": [[], "float32"], ...}},
 "optimizer": "Adam",
 "training": {"batch_size": 8, "steps_per_epoch": 4}}
```

Optimizer variables are named without the optimizer's own name, which Keras
numbers per process (`adam/iteration`, `adam_1/iteration`, ...). A wrapped
optimizer (Keras' `LossScaleOptimizer` around an `Adam`, under
`mixed_float16`) lists its own variables and its inner optimizer's, both
with an `iteration` and a `learning_rate`: there each is named by its
owner's name less that number (`loss_scale_optimizer/iteration`,
`adam/iteration`; `optimizer_keys`). Dtypes are
those the arrays are stored in (under JAX without 64-bit mode, `int64`
variables hold `int32` arrays). A mesh is not part of a fingerprint: a
checkpoint restores onto any mesh.

`mismatch_error` compares two fingerprints and returns the `RestoreError` that
lists each difference and says how to fix it, or None when they agree.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterable
from collections.abc import Mapping

from keras_hub_autodist.training.optimizer_state import optimizer_keys
from keras_hub_autodist.training.optimizer_state import without_one_sided_rates

FORMAT = "keras_hub_autodist.fingerprint"
VERSION = 1
# The name under which checkpoints store it: an Orbax checkpointable, and a
# dataset at the root of Keras' HDF5 weights files.
STORED_NAME = "keras_hub_autodist_fingerprint"

TRAINABLE = "trainable_variables"
NON_TRAINABLE = "non_trainable_variables"
OPTIMIZER = "optimizer_variables"
METRICS = "metrics_variables"
GROUPS = (TRAINABLE, NON_TRAINABLE, OPTIMIZER, METRICS)
WEIGHTS = (TRAINABLE, NON_TRAINABLE)

# Keras' LoRA variables (`Dense`, `EinsumDense`, `Embedding`); the rank is the
# last axis of the `_a` factor.
LORA_NAME = re.compile(r"(^|/)lora_(kernel|embeddings)_[ab]$")
LORA_FACTOR_A = re.compile(r"(^|/)lora_(kernel|embeddings)_a$")
# Differences listed in one message; the rest are counted.
MAX_LISTED = 60
# Variables whose trainability alone differs, listed one by one up to this.
FEW = 3

VariableSpec = tuple[tuple[int, ...], str]


@dataclasses.dataclass(frozen=True)
class Training:
    """How the `fit` that took a checkpoint fed its batches.

    Args:
        batch_size: rows in the first batch of an epoch, all processes
            together, as the caller of `fit` batched them (a bound task's
            train step receives them padded to a multiple of the batch axis).
        steps_per_epoch: batches per epoch.
    """

    batch_size: int | None
    steps_per_epoch: int


@dataclasses.dataclass(frozen=True)
class Fingerprint:
    """Every variable a checkpoint holds, its optimizer and its training.

    Args:
        variables: group -> variable path -> (shape, dtype).
        optimizer: the optimizer's class name; None when the model had none
            or the checkpoint does not say.
        training: the batches of the `fit` it was taken in, or None.

    Example:
    >>> saved = Fingerprint({TRAINABLE: {"dense/kernel": ((4, 2), "float32")}})
    >>> current = Fingerprint({TRAINABLE: {"dense/kernel": ((4, 3), "float32")}})
    >>> error = mismatch_error("The checkpoint 'ckpt'", saved, current)
    >>> print(str(error).splitlines()[2])
      - `dense/kernel`: saved (4, 2) float32, the model has (4, 3) float32
    """

    variables: Mapping[str, Mapping[str, VariableSpec]]
    optimizer: str | None = None
    training: Training | None = None

    def group(self, name: str) -> Mapping[str, VariableSpec]:
        return self.variables.get(name, {})

    def weights(self) -> dict[str, VariableSpec]:
        """Trainable and non-trainable variables together."""
        return {**self.group(TRAINABLE), **self.group(NON_TRAINABLE)}

    def lora_rank(self) -> int | None:
        """The rank of the LoRA kernels among the weights; None without LoRA."""
        ranks = {
            shape[-1]
            for path, (shape, _) in self.weights().items()
            if LORA_FACTOR_A.search(path) and shape
        }
        return max(ranks) if ranks else None

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": FORMAT,
                "version": VERSION,
                "variables": {
                    group: {p: [list(s), d] for p, (s, d) in paths.items()}
                    for group, paths in self.variables.items()
                },
                "optimizer": self.optimizer,
                "training": dataclasses.asdict(self.training)
                if self.training
                else None,
            },
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> Fingerprint:
        """Read `to_json()`'s text; `ValueError` says what is wrong with it."""
        try:
            data = json.loads(text)
            if data.get("format") != FORMAT or data.get("version") != VERSION:
                raise ValueError(
                    f"not a fingerprint of version {VERSION}: "
                    f"{data.get('format')!r} {data.get('version')!r}"
                )
            variables = {
                str(group): {
                    str(path): (tuple(int(n) for n in shape), str(dtype))
                    for path, (shape, dtype) in paths.items()
                }
                for group, paths in data["variables"].items()
            }
            training = data.get("training")
            if training is not None:
                training = Training(
                    int(training["batch_size"]), int(training["steps_per_epoch"])
                )
            optimizer = data.get("optimizer")
        except (TypeError, KeyError, AttributeError) as error:
            raise ValueError(f"a malformed fingerprint ({error!r})") from error
        return cls(variables, None if optimizer is None else str(optimizer), training)


def stored_dtype(dtype) -> str:
    """The dtype an array of Keras dtype `dtype` is stored in (JAX's
    canonical dtype: `int64` is `int32` without 64-bit mode)."""
    import jax
    import numpy as np

    return np.dtype(jax.dtypes.canonicalize_dtype(dtype)).name


def model_optimizer(model):
    """The model's Keras optimizer, or None (not compiled)."""
    import keras

    optimizer = getattr(model, "optimizer", None)
    return optimizer if isinstance(optimizer, keras.optimizers.Optimizer) else None


def live_variables(model) -> dict[str, dict[str, object]]:
    """group -> path -> the model's variable, as Keras' state tree groups
    them (optimizer variables named without the optimizer's name)."""
    optimizer = model_optimizer(model)
    return {
        TRAINABLE: {v.path: v for v in model.trainable_variables},
        NON_TRAINABLE: {v.path: v for v in model.non_trainable_variables},
        OPTIMIZER: _keyed(optimizer.variables if optimizer is not None else []),
        METRICS: {v.path: v for v in getattr(model, "metrics_variables", [])},
    }


def _keyed(variables) -> dict[str, object]:
    keys = optimizer_keys(v.path for v in variables)
    return {keys[v.path]: v for v in variables}


def of_model(model, training: Training | None = None) -> Fingerprint:
    """The fingerprint of `model`'s training state as it is now.

    Args:
        model: a Keras model.
        training: the batches of the running `fit`, if any.
    """
    optimizer = model_optimizer(model)
    variables = {
        group: {
            path: (tuple(int(n) for n in v.shape), stored_dtype(v.dtype))
            for path, v in paths.items()
        }
        for group, paths in live_variables(model).items()
    }
    return Fingerprint(
        variables, type(optimizer).__name__ if optimizer else None, training
    )


def from_state_metadata(
    metadata: Mapping, optimizer: str | None = None, training: Training | None = None
) -> Fingerprint:
    """The fingerprint of an Orbax checkpoint of Keras' state tree, from its
    metadata (nested dicts whose leaves have `shape` and `dtype`)."""

    variables = {}
    for group, tree in metadata.items():
        items = list(flat_items(tree or {}))
        keys = saved_keys(group, (path for path, _ in items))
        variables[group] = {
            keys[path]: (tuple(int(n) for n in meta.shape), stored_dtype(meta.dtype))
            for path, meta in items
        }
    return Fingerprint(variables, optimizer, training)


def saved_keys(group: str, paths: Iterable[str]) -> dict[str, str]:
    """Saved path -> the key of the live variable it restores, in `group`
    of Keras' state tree (`optimizer_keys` for the optimizer's).

    Example:
    >>> saved_keys(OPTIMIZER, ["adam_1/iteration"])
    {'adam_1/iteration': 'iteration'}
    """
    paths = list(paths)
    if group == OPTIMIZER:
        return optimizer_keys(paths)
    return {path: path for path in paths}


def flat_items(tree: Mapping, prefix: str = ""):
    """(path, leaf) of a nested dict, its keys joined by `/`.

    Example:
    >>> list(flat_items({"a": {"b": 1}, "c": 2}))
    [('a/b', 1), ('c', 2)]
    """
    for key, value in tree.items():
        if isinstance(value, Mapping):
            yield from flat_items(value, f"{prefix}{key}/")
        else:
            yield f"{prefix}{key}", value


# --- Comparing ------------------------------------------------------------------


def _shape(spec: VariableSpec) -> str:
    shape, dtype = spec
    return f"{tuple(shape)} {dtype}"


def describe(fingerprint: Fingerprint, groups: Iterable[str] = GROUPS) -> str:
    """What a fingerprint holds, in a few words."""
    groups = tuple(groups)
    parts = []
    weights = sum(len(fingerprint.group(g)) for g in WEIGHTS if g in groups)
    if any(g in groups for g in WEIGHTS):
        rank = fingerprint.lora_rank()
        lora = f" with LoRA of rank {rank}" if rank else " without LoRA"
        parts.append(f"{weights} weights{lora}")
    if OPTIMIZER in groups:
        count = len(fingerprint.group(OPTIMIZER))
        name = fingerprint.optimizer or "an optimizer"
        parts.append(f"{count} variables of {name}" if count else "no optimizer state")
    return ", ".join(parts) or "nothing"


def variable_differences(
    saved: Mapping[str, VariableSpec],
    current: Mapping[str, VariableSpec],
    saved_group: Mapping[str, str] | None = None,
    current_group: Mapping[str, str] | None = None,
) -> list[str]:
    """One line per variable that differs: missing on a side, or another
    shape or dtype; then, with the groups given, the variables trainable on
    one side only (more than `FEW` of them in one line: `enable_lora` and
    `trainable = False` freeze whole models).

    Example:
    >>> variable_differences({"w": ((2,), "float32")}, {"w": ((3,), "float32")})
    ['`w`: saved (2,) float32, the model has (3,) float32']
    """
    lines, moved = [], {}
    for path in sorted(set(saved) | set(current)):
        before, now = saved.get(path), current.get(path)
        if now is None:
            lines.append(f"`{path}`: saved {_shape(before)}, not in the model")
        elif before is None:
            lines.append(f"`{path}`: in the model {_shape(now)}, not in the checkpoint")
        elif tuple(before[0]) != tuple(now[0]) or before[1] != now[1]:
            lines.append(
                f"`{path}`: saved {_shape(before)}, the model has {_shape(now)}"
            )
        elif saved_group and current_group and saved_group[path] != current_group[path]:
            change = (
                f"{_trainability(saved_group[path])} in the checkpoint, "
                f"{_trainability(current_group[path])} in the model"
            )
            moved.setdefault(change, []).append(path)
    for change, paths in moved.items():
        if len(paths) > FEW:
            lines.append(f"`{paths[0]}` and {len(paths) - 1} more: {change}")
        else:
            lines.extend(f"`{path}`: {change}" for path in paths)
    return lines


def _trainability(group: str) -> str:
    return "trainable" if group == TRAINABLE else "frozen (non-trainable)"


def _base(weights: Mapping[str, VariableSpec]) -> dict[str, tuple]:
    """The shapes of the weights that are not LoRA kernels."""
    return {p: tuple(s) for p, (s, _) in weights.items() if not LORA_NAME.search(p)}


def weights_fix(saved: Fingerprint, current: Fingerprint) -> str:
    """How to fix a restore whose weights differ, as a sentence: the cause
    is looked for in this order: another model, another LoRA rank or
    LoRA layers, other dtypes, other trainable variables."""
    before, now = saved.weights(), current.weights()
    if _base(before) != _base(now):
        return (
            "The checkpoint is of another model (other variables or shapes): "
            "load the preset the run was trained from, with the same config, "
            "or restore a checkpoint of this model."
        )
    saved_rank, current_rank = saved.lora_rank(), current.lora_rank()
    if saved_rank and not current_rank:
        return (
            f"The checkpoint is of a LoRA run of rank {saved_rank} and the "
            f"model has no LoRA: call `backbone.enable_lora({saved_rank})` "
            "before restoring."
        )
    if current_rank and not saved_rank:
        return (
            f"The model has LoRA of rank {current_rank} and the checkpoint "
            "holds no LoRA weights: restore it into a model without "
            "`enable_lora`, and enable LoRA after the restore."
        )
    if saved_rank != current_rank:
        return (
            f"The checkpoint's LoRA rank is {saved_rank}, the model's "
            f"{current_rank}: call `backbone.enable_lora({saved_rank})` instead "
            f"of `enable_lora({current_rank})` before restoring."
        )
    if before.keys() != now.keys():
        return (
            "LoRA is enabled on other layers than in the run that saved it: "
            f"call `backbone.enable_lora({saved_rank}, target_layer_names=...)` "
            "with that run's layers before restoring."
        )
    if any(before[p] != now[p] for p in now):
        return (
            "The checkpoint's weights are of other dtypes: load the model "
            "with the dtype the run used (`dtype=` of `from_preset`), "
            "then restore."
        )
    return (
        "Other variables are trainable: freeze (`trainable = False`) "
        "the same layers as the run that saved it, then restore."
    )


def difference_error(source: str, holds: str, has: str, fix: str, lines: list[str]):
    """The `RestoreError` for a checkpoint that differs from the model.

    Args:
        source: what the checkpoint is (`"The Orbax checkpoint '...'"`).
        holds: what the checkpoint holds, in a few words.
        has: what the model has, in the same words.
        fix: the sentences that say how to fix it.
        lines: one line per difference (`variable_differences`).
    """
    from keras_hub_autodist.errors import RestoreError

    listed = lines[:MAX_LISTED]
    more = len(lines) - len(listed)
    tail = f"\n  ... and {more} more" if more else ""
    return RestoreError(
        f"{source} does not match the model: the checkpoint holds {holds}; "
        f"the model has {has}.\nDifferences ({len(lines)}):\n  - "
        + "\n  - ".join(listed)
        + f"{tail}\n{fix} Nothing was restored. Received: {len(lines)} "
        "differences"
    )


def mismatch_error(
    source: str,
    saved: Fingerprint,
    current: Fingerprint,
    groups: Iterable[str] = WEIGHTS,
    all_metrics: bool = False,
):
    """The `RestoreError` for restoring `saved` into a model of fingerprint
    `current`, or None when the `groups` compared agree.

    Weights are compared as one group (a path trainable on one side and
    frozen on the other is a difference); optimizer variables by path, and
    by class when both fingerprints name it; metrics only where both sides
    have them (`fit` and `evaluate` build the metrics a model lacks before
    it ever ran).

    Args:
        source: what the checkpoint is, for the message (`"The Orbax
            checkpoint '...'"`).
        saved: the checkpoint's fingerprint.
        current: the model's fingerprint.
        groups: the groups to compare (`GROUPS` or a part of them).
        all_metrics: compare every metric variable, not only those both
            sides have.
    """
    groups = tuple(groups)

    def refused(fix: str, lines: list[str]):
        holds, has = describe(saved, groups), describe(current, groups)
        return difference_error(source, holds, has, fix, lines)

    if any(g in groups for g in WEIGHTS):
        group_of = lambda f: {p: g for g in WEIGHTS for p in f.group(g)}  # noqa: E731
        lines = variable_differences(
            saved.weights(), current.weights(), group_of(saved), group_of(current)
        )
        if lines:
            return refused(weights_fix(saved, current), lines)
    if OPTIMIZER in groups:
        named = saved.optimizer and current.optimizer
        if named and saved.optimizer != current.optimizer:
            return refused(
                f"The checkpoint was trained with {saved.optimizer}: compile "
                f"with `keras.optimizers.{saved.optimizer}` (its settings "
                "are your run's), then restore.",
                [
                    f"optimizer: saved {saved.optimizer}, the model has "
                    f"{current.optimizer}"
                ],
            )
        lines = variable_differences(
            *without_one_sided_rates(saved.group(OPTIMIZER), current.group(OPTIMIZER))
        )
        if lines:
            return refused(
                "Compile with the optimizer the checkpoint was trained with "
                "(and its settings that make slots, e.g. `ema_momentum`), "
                "then restore.",
                lines,
            )
    if METRICS in groups:
        both = set(saved.group(METRICS)) & set(current.group(METRICS))
        if all_metrics:
            both = set(saved.group(METRICS)) | set(current.group(METRICS))
        lines = variable_differences(
            {p: s for p, s in saved.group(METRICS).items() if p in both},
            {p: s for p, s in current.group(METRICS).items() if p in both},
        )
        if lines:
            return refused(
                "Compile with the metrics the run used, then restore.",
                lines,
            )
    return None


def training_error(source: str, saved: Training, current: Training, processes: int = 1):
    """The `RestoreError` for resuming a run of `saved` batches with the
    batches `current`, or None when they are the same.

    A resume maps the batches already trained onto an epoch and a batch of
    it; with another batch size or another number of batches per epoch, that
    position holds other samples (some would be skipped, others trained
    twice). Resuming at the same sample with other batches is not attempted:
    this is refused.

    Args:
        source: what the checkpoint is, for the message.
        saved: the batches of the run that took the checkpoint.
        current: those of this run (`batch_size` None: not known yet, only
            the batches per epoch are compared).
        processes: the number of processes feeding each batch.
    """
    from keras_hub_autodist.errors import RestoreError

    what = []
    if current.batch_size is not None and saved.batch_size != current.batch_size:
        what.append(f"batch size {saved.batch_size}, this run's {current.batch_size}")
    if saved.steps_per_epoch != current.steps_per_epoch:
        what.append(
            f"{saved.steps_per_epoch} batches per epoch, this run's "
            f"{current.steps_per_epoch}"
        )
    if not what:
        return None
    fix = f"batch_size={saved.batch_size}"
    if processes > 1 and saved.batch_size % processes == 0:
        fix = (
            f"batch_size={saved.batch_size // processes} in each of "
            f"{processes} processes"
        )
    received = f"batch_size={current.batch_size}, " if current.batch_size else ""
    return RestoreError(
        f"{source} was taken by a run with {' and '.join(what)}: resuming "
        "would map its batches onto other samples (skipping some, training "
        f"others twice). Use {fix}, as the interrupted run did, and the same "
        f"data ({saved.steps_per_epoch} batches per epoch); or start in a new "
        f"`directory`. Nothing was trained. Received: {received}"
        f"{current.steps_per_epoch} batches per epoch"
    )
