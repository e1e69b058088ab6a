"""Errors raised by `keras_hub_autodist`.

Every error says what it received and how to fix it. All of them derive from
`AutodistError`, and from `ValueError` or `TypeError` so that existing
`except ValueError` blocks keep working.

Messages name options as keyword arguments in backquotes (`option()`:
`` `batch_axis=` ``); the `keras-hub-autodist` command rewrites them into its
flags (`--batch-axis`) when it prints an error.
"""

from __future__ import annotations

import inspect
import os
import sys
import warnings

# The packages a warning is raised through on its way from the user's call:
# it names the first line outside them, the user's own.
_WRAPPED_PACKAGES = (
    "keras_hub_autodist",
    "keras_hub",
    "keras",
    "jax",
    "optree",
    "orbax",
    "tensorflow",
)


class AutodistError(Exception):
    """Base class of every error raised by `keras_hub_autodist`."""


class MeshError(AutodistError, ValueError):
    """The device mesh (or its axis roles) can't be used for this model."""


class StrategyError(AutodistError, ValueError):
    """An unknown sharding strategy was requested."""


class PresetError(AutodistError, ValueError):
    """The preset can't be read (missing, or without `config.json`)."""


class ConfigError(AutodistError, ValueError):
    """A field of the preset's config is missing or has an invalid value."""


class DTypeError(AutodistError, ValueError, TypeError):
    """`dtype` is not a dtype or dtype policy Keras knows."""


class PlanError(AutodistError, ValueError):
    """An option of `plan()` or an argument of a `LayoutPlan` method is
    invalid, or an architecture's activation keys collide with its weight
    keys."""


class UnsupportedArchitectureError(AutodistError, ValueError):
    """No architecture (rule table) is registered for the preset's backbone class."""


class BackendError(AutodistError, ValueError):
    """Distribution needs the JAX backend of Keras."""


class BatchSizeError(AutodistError, ValueError):
    """A batch does not divide evenly over the batch axis of the mesh."""


class DeviceMeshTypeError(AutodistError, TypeError):
    """`device_mesh` is of a type that can't describe a mesh."""


def option(name: str, value: str | None = None) -> str:
    """How a message names option `name` (and its `value`): as the keyword
    argument, in backquotes. The CLI rewrites these into its flags
    (`cli_flags.as_flags`).

    Args:
        name: the keyword argument, e.g. `"batch_axis"`.
        value: an optional value to show with it, already formatted.

    Example:
    >>> option("batch_axis", "'rows'")
    "`batch_axis='rows'`"
    """
    return f"`{name}=`" if value is None else f"`{name}={value}`"


def mesh_example(mesh: dict[str, int]) -> str:
    """A mesh as a message shows it: the `device_mesh=` keyword (the CLI
    rewrites it into `--mesh a=1,b=2`).

    Example:
    >>> mesh_example({"batch": 1, "model": 8})
    "`device_mesh={'batch': 1, 'model': 8}`"
    """
    return option("device_mesh", repr(mesh))


class LayoutMismatchError(AutodistError, RuntimeError):
    """A loaded variable is not laid out as its plan says (a planner bug)."""


class SaveTargetError(AutodistError, ValueError):
    """`save_to_preset` was given a path that can't hold a preset folder."""


class SavePermissionError(SaveTargetError, PermissionError):
    """`save_to_preset` may not create or replace files where it was asked to
    save (a `PermissionError` too, as keras-hub's own save raises)."""


class PluginOffError(AutodistError, TypeError):
    """`device_mesh=` was passed while keras-hub-autodist is not active."""


class ArgumentError(AutodistError, TypeError):
    """`from_preset` received arguments keras-hub's own would reject."""


class ModelClassError(AutodistError, TypeError):
    """A class without keras-hub's `from_preset` was passed."""


class NotBoundError(AutodistError, ValueError):
    """The model was not loaded with `device_mesh=`."""


class PlanInputError(PresetError, TypeError):
    """`plan()`/`get_layout_map()` got something that is neither a preset,
    a config dict nor a backbone (or task) instance."""


class UnplannedWeightError(AutodistError, ValueError):
    """A weight of the built model matches no layout rule, or more than one."""


class WeightShapeError(AutodistError, ValueError):
    """A weight is built with another shape than the plan computed for it
    (the model was built from a different config than the one planned)."""


class RestoreError(AutodistError, ValueError):
    """A checkpoint can't be restored whole into the model: it holds another
    model's variables (other shapes, another LoRA rank), another optimizer's
    state, or was taken with another batch size; or part of the training
    state (optimizer slots, iteration count) would be lost or mixed."""


class CheckpointOptionError(RestoreError, TypeError):
    """An argument of `ResumableCheckpoint` (or of its stop request) has the
    wrong type or is out of range. A `RestoreError`, so that handlers written
    for the checks it replaces keep working."""


class StateLostError(AutodistError, RuntimeError):
    """A bound method's step failed after it had consumed the model's state
    (its buffers donated to the step): the state can't be put back whole."""


class SequenceLengthError(AutodistError, ValueError):
    """A batch's sequence length doesn't divide the context axis that
    splits it."""


class UnplannedWeightWarning(UserWarning):
    """With `strict=False`: weights that match no rule stay replicated."""


class WholeLogitsWarning(UserWarning):
    """A bound causal LM's step computes its loss over the whole
    vocabulary's logits (the compiled loss or metrics need them), not one
    chunk of tokens at a time. Said once per model and reason."""


class OutOfVocabularyLabelWarning(UserWarning):
    """Labels outside the vocabulary (Hugging Face's -100) reach a bound
    causal LM's sparse cross-entropy, which, as Keras computes it, gives
    each such token a loss of 0 but still counts it in the mean. Said once
    per model."""


class KeptAttentionWarning(UserWarning):
    """Off a context mesh, a long sequence's attention layers keep their own
    (XLA's) attention, every score held, because the platform's fused
    kernel doesn't take them. Said once per reason."""


class PaddingWarning(UserWarning):
    """A bound model pads a batch (or prompts) to a multiple of the batch
    axis: results are those of the real rows, the padded ones cost compute.
    Said once per model and method; filter this category to silence it."""


class DemoError(AutodistError, ValueError):
    """An argument of the demo (`run_demo`, `keras-hub-autodist demo`) is
    invalid."""


class WeightFileChangedError(AutodistError, RuntimeError):
    """A weight file was modified in place, or replaced and reopened, while a
    model loaded from it; the load would mix two versions of the file."""


class WeightFileError(AutodistError, ValueError):
    """A weight file's header breaks the rules of its format (offsets that
    overlap or leave gaps, an unknown dtype, a length past the end of the
    file...); its format's own reader refuses it too."""


class EnvironmentVariableError(AutodistError, ValueError):
    """An environment variable of keras-hub-autodist holds a value it does
    not accept."""


class MultiprocessSaveError(AutodistError, RuntimeError):
    """Another process failed while the processes were saving a model
    together; this one stopped instead of waiting for it."""


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """Warn with the line of the user's code that led here.

    A warning raised deep inside a load, a save or a bound model's `fit`
    names the first frame outside this package and the libraries it runs
    through (keras, keras-hub, jax, ...), so the user sees their own line
    instead of ours, and Python's "once per location" filter counts theirs.

    Args:
        message: what happened and how to avoid it.
        category: the warning's class.
    """
    internal = tuple(
        os.path.dirname(module.__file__) + os.sep
        for name in _WRAPPED_PACKAGES
        if (module := sys.modules.get(name)) is not None
        and getattr(module, "__file__", None)
    )
    frame = inspect.currentframe().f_back
    level = 1
    while frame is not None and (
        frame.f_code.co_filename.startswith(internal)
        or frame.f_code.co_filename.startswith("<frozen ")
    ):
        frame = frame.f_back
        level += 1
    if frame is None:  # nothing of the user's on this thread's stack
        level = 1
    warnings.warn(message, category, stacklevel=level + 1)


class TargetCompileError(PlanError, RuntimeError):
    """The compiler refuses a training step for a reason other than its
    size: the same step can't run on that device as it is (e.g. bfloat16
    attention on a T4, which has no bfloat16 matrix arithmetic)."""


class ExtraMissingError(AutodistError, ImportError):
    """A feature needs an optional extra of the package that is not
    installed (e.g. `ResumableCheckpoint`: `keras-hub-autodist[checkpoints]`);
    the message names the extra."""


class CompilerMissingError(PlanError, ExtraMissingError):
    """The compiler of a named accelerator is not installed: the memory
    check can't compile for it on this machine without its extra
    (`keras-hub-autodist[tpu-compile]` or `[gpu-compile]`)."""
