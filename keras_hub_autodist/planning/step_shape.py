"""The training step a mesh runs for a batch and a sequence length.

A model bound to a mesh pads a batch that the batch axis doesn't divide up
to a multiple of it (zero-weight rows and a `PaddingWarning`), and refuses a
sequence length that the context axis doesn't divide (`SequenceLengthError`)
before anything runs. The memory estimate, the compiled check, the advice
and the automatic mesh take the step from here, so that each answers for the
step a bound `fit` runs: the same rows, the same refusals, one message.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from keras_hub_autodist.errors import PlanError
from keras_hub_autodist.errors import SequenceLengthError
from keras_hub_autodist.errors import mesh_example
from keras_hub_autodist.errors import option


@dataclasses.dataclass(frozen=True)
class Step:
    """One training step as a mesh runs it.

    Args:
        batch_size: the global batch as requested.
        sequence_length: tokens per sequence.
        rows: the global batch the step computes: `batch_size` padded up to
            a multiple of the batch axis.

    Example:
    >>> Step(3, 32, 4).padded
    True
    """

    batch_size: int
    sequence_length: int
    rows: int

    @property
    def padded(self) -> bool:
        """Whether the step adds zero-weight rows to the batch."""
        return self.rows != self.batch_size


def padded_rows(batch_size: int, batch_axis_size: int) -> int:
    """`batch_size` padded up to a multiple of `batch_axis_size`.

    Example:
    >>> padded_rows(3, 4), padded_rows(8, 4)
    (4, 8)
    """
    return -(-batch_size // batch_axis_size) * batch_axis_size


def check_sizes(batch_size, sequence_length, what: str = "memory estimate") -> None:
    """Raise `PlanError` unless both sizes are positive integers.

    Example:
    >>> check_sizes(8, 2048)
    """
    for name, value in (
        ("batch_size", batch_size),
        ("sequence_length", sequence_length),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PlanError(
                f"{option(name)} must be a positive integer for the {what}. "
                f"Received: {name}={value!r}"
            )


def sequence_length_error(
    sizes: Mapping[str, int],
    batch_axis: str,
    context_axis: str,
    length: int,
    *,
    change: str,
    received: str,
) -> SequenceLengthError:
    """The error for a sequence of `length` tokens that the context axis of a
    mesh of axis `sizes` doesn't divide: the nearest lengths that split, and
    the mesh of as many devices whose context axis divides `length`.

    Args:
        sizes: the mesh's axis sizes by name.
        batch_axis: the batch axis, which takes the devices the context
            axis gives up.
        context_axis: the axis that splits each sequence.
        length: tokens per sequence.
        change: what to change, e.g. "a `sequence_length=`".
        received: the message's `Received:` part.

    Example:
    >>> error = sequence_length_error({"batch": 2, "context": 4}, "batch",
    ...     "context", 6, change="a `sequence_length=`",
    ...     received="sequence_length=6")
    >>> "e.g. 4 or 8" in str(error)
    True
    """
    context = sizes[context_axis]
    lower = length // context * context
    multiples = " or ".join(str(m) for m in (lower, lower + context) if m > 0)
    splits = math.gcd(context, length)
    other = dict(sizes)
    other[batch_axis] *= context // splits
    other[context_axis] = splits
    return SequenceLengthError(
        f"The context axis {context_axis!r} splits each sequence over {context} "
        f"devices, and {length} tokens don't split into {context} equal "
        f"blocks. Use {change} that is a multiple of {context} (e.g. {multiples}), "
        f"or a mesh whose context axis divides {length}, e.g. "
        f"{mesh_example(other)}. Received: {received}"
    )


def runnable_step(
    axes, batch_size, sequence_length, what: str = "memory estimate"
) -> Step:
    """The step a bound model runs on a mesh of `axes` for `batch_size`
    sequences of `sequence_length` tokens: the batch padded to the batch
    axis, the sequence refused unless the context axis divides it.

    Args:
        axes: the plan's `MeshAxes`.
        batch_size: the global batch as requested.
        sequence_length: tokens per sequence.
        what: the answer being asked for, for the message.

    Raises:
        PlanError: a size is not a positive integer.
        SequenceLengthError: the context axis doesn't divide
            `sequence_length`.

    Example:
    ```python
    runnable_step(plan.mesh_axes, 3, 32).rows  # 4 on a batch axis of 4
    ```
    """
    check_sizes(batch_size, sequence_length, what)
    context = axes.size(axes.context_axis)
    if sequence_length % context:
        raise sequence_length_error(
            dict(zip(axes.axis_names, axes.shape)),
            axes.batch_axis,
            axes.context_axis,
            sequence_length,
            change=f"a {option('sequence_length')}",
            received=f"sequence_length={sequence_length} on the mesh "
            f"({axes.describe()})",
        )
    return Step(
        batch_size,
        sequence_length,
        padded_rows(batch_size, axes.size(axes.batch_axis)),
    )


def runnable_lengths(axes, sequence_length: int) -> list[int]:
    """The sequence lengths below `sequence_length` that a mesh of `axes`
    runs, each about half the one before: halvings rounded down to a multiple
    of the context axis, down to one token per device of it.

    Example:
    >>> from keras_hub_autodist.planning.mesh import resolve_mesh_axes
    >>> runnable_lengths(resolve_mesh_axes({"batch": 1, "context": 8}), 64)
    [32, 16, 8]
    >>> runnable_lengths(resolve_mesh_axes({"batch": 1, "context": 4}), 12)
    [4]
    """
    return _halvings(sequence_length, axes.size(axes.context_axis))


def runnable_batches(axes, batch_size: int) -> list[int]:
    """The batches below `batch_size` worth trying on a mesh of `axes`, each
    about half the one before: halvings rounded down to a multiple of the
    batch axis, down to one sequence per device of it (a smaller batch is
    padded to that, and costs as much).

    Example:
    >>> from keras_hub_autodist.planning.mesh import resolve_mesh_axes
    >>> runnable_batches(resolve_mesh_axes({"batch": 4}), 64)
    [32, 16, 8, 4]
    >>> runnable_batches(resolve_mesh_axes({"batch": 4}), 4)
    []
    """
    return _halvings(batch_size, axes.size(axes.batch_axis))


def _halvings(value: int, unit: int) -> list[int]:
    """The values below `value`, each about half the one before, rounded
    down to a multiple of `unit` and no smaller than it."""
    found = []
    current = value
    while current > unit:
        current = max(unit, current // 2 // unit * unit)
        if current < value and current not in found:
            found.append(current)
    return found
