"""Errors raised by `keras_hub_autodist`.

Every error says what it received and how to fix it. All of them derive from
`AutodistError`, and from `ValueError` or `TypeError` so that existing
`except ValueError` blocks keep working.

Messages name options the way the caller passes them: keyword arguments
(`batch_axis=`) from Python, flags (`--batch-axis`) from the
`keras-hub-autodist` command, which runs inside `cli_spelling()`.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

_CLI_SPELLING = contextvars.ContextVar("keras_hub_autodist_cli", default=False)


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
    """An argument of a `LayoutPlan` method is invalid, or a handler gave
    one layout-map key two layouts."""


class UnsupportedArchitectureError(AutodistError, ValueError):
    """No layout handler is registered for the preset's backbone class."""


class BackendError(AutodistError, ValueError):
    """Distribution needs the JAX backend of Keras."""


class BatchSizeError(AutodistError, ValueError):
    """A batch does not divide evenly over the batch axis of the mesh."""


class DeviceMeshTypeError(AutodistError, TypeError):
    """`device_mesh` is of a type that can't describe a mesh."""


@contextlib.contextmanager
def cli_spelling() -> Iterator[None]:
    """Within this context, error messages name command-line flags.

    Example:
    >>> with cli_spelling():
    ...     option("batch_axis")
    '`--batch-axis`'
    """
    token = _CLI_SPELLING.set(True)
    try:
        yield
    finally:
        _CLI_SPELLING.reset(token)


def option(name: str, value: str | None = None) -> str:
    """How the caller spells option `name` (and its `value`) in messages.

    Args:
        name: the keyword argument, e.g. `"batch_axis"`.
        value: an optional value to show with it, already formatted.

    Example:
    >>> option("batch_axis", "'rows'")
    "`batch_axis='rows'`"
    """
    if _CLI_SPELLING.get():
        flag = "--" + name.replace("_", "-")
        if value is None:
            return f"`{flag}`"
        return f"`{flag} {value.strip(chr(39))}`"
    return f"`{name}=`" if value is None else f"`{name}={value}`"


def mesh_example(mesh: dict[str, int]) -> str:
    """A mesh as the caller writes it: a dict in Python, `--mesh a=1,b=2`
    on the command line.

    Example:
    >>> mesh_example({"batch": 1, "model": 8})
    "{'batch': 1, 'model': 8}"
    """
    if _CLI_SPELLING.get():
        return "--mesh " + ",".join(f"{k}={v}" for k, v in mesh.items())
    return repr(mesh)


class LayoutMismatchError(AutodistError, RuntimeError):
    """A loaded variable is not laid out as its plan says (a planner bug)."""


class SaveTargetError(AutodistError, ValueError):
    """`save_to_preset` was given a path that can't hold a preset folder."""


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
    """A checkpoint can't be restored whole into the model: part of the
    training state (optimizer slots, iteration count) would be lost or mixed."""


class UnplannedWeightWarning(UserWarning):
    """With `strict=False`: weights that match no rule stay replicated."""
