"""`LayoutPlan.plot()`: a picture of the plan, drawn with matplotlib (the
optional `plot` extra): the planned memory of each device (weights, and the
gradients and Adam moments of training), and for one weight the slice of it
each device holds, on the mesh drawn as a grid (as
`jax.debug.visualize_array_sharding` draws an array's shards).

Example:
```python
figure = keras_hub_autodist.plan("./gemma_2b", {"batch": 2, "model": 4}).plot(
    "decoder_block_0/attention/query/kernel"
)
figure.savefig("plan.png")
```
"""

from __future__ import annotations

import itertools
import math
from typing import TYPE_CHECKING

from keras_hub_autodist.errors import ArgumentError
from keras_hub_autodist.fitting import memory
from keras_hub_autodist.fitting.device_memory import GIB

if TYPE_CHECKING:
    from keras_hub_autodist.architectures.weight import Weight
    from keras_hub_autodist.planning.plan_record import PlanRecord


def device_slices(plan: PlanRecord, weight: Weight) -> dict[tuple, str]:
    """Each mesh position's slice of `weight`, as index ranges per dimension.

    Args:
        plan: the plan.
        weight: one of its rows.

    Returns:
        Mesh position (one index per mesh axis) -> e.g. `"[0:2, :, :]"`.
    """
    names, shape = plan.mesh_axes.axis_names, plan.mesh_axes.shape
    slices = {}
    for position in itertools.product(*(range(size) for size in shape)):
        index = dict(zip(names, position))
        parts = []
        for dim, axis in zip(weight.shape, weight.spec):
            axes = (axis,) if isinstance(axis, str) else tuple(axis or ())
            if not axes:
                parts.append(":")
                continue
            count = math.prod(shape[names.index(a)] for a in axes)
            shard = 0
            for a in axes:
                shard = shard * shape[names.index(a)] + index[a]
            step = dim // count
            parts.append(f"{shard * step}:{(shard + 1) * step}")
        slices[position] = "[" + ", ".join(parts) + "]"
    return slices


def _find_weight(plan: PlanRecord, weight: str | None) -> Weight:
    rows = sorted(plan.rows, key=lambda row: -row.bytes)
    if weight is None:
        return rows[0]
    for row in plan.rows:
        if weight in (row.path, row.pattern):
            return row
    raise ArgumentError(
        "plot() draws the shards of one weight of the plan, named by its path "
        "as the table shows it for layer 0 (e.g. "
        f"{rows[0].path!r}). Received: weight={weight!r}"
    )


def plot(plan: PlanRecord, weight: str | None = None):
    """Draw `plan`: memory per device, and `weight`'s shards on the mesh.

    Args:
        plan: the plan.
        weight: the path of one weight (default: the largest).

    Returns:
        The matplotlib `Figure` (shown inline in a notebook).

    Raises:
        ArgumentError: matplotlib is missing, or `weight` is not in the plan.
    """
    try:
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise ArgumentError(
            "plot() needs matplotlib: `pip install matplotlib` (or this "
            "package's `plot` extra). Received: no module matplotlib"
        ) from error
    row = _find_weight(plan, weight)
    names, shape = plan.mesh_axes.axis_names, plan.mesh_axes.shape
    devices = math.prod(shape)
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 3.6))
    weights = plan.max_device_bytes / GIB
    training = memory.training_bytes_per_device(plan) / GIB
    ids = range(devices)
    left.bar(ids, [weights] * devices, label="weights")
    left.bar(
        ids,
        [training - weights] * devices,
        bottom=[weights] * devices,
        label="+ gradients and Adam",
    )
    left.axhline(plan.device_memory_bytes / GIB, color="gray", linestyle="--")
    left.set_xticks(list(ids))
    left.set_xlabel("device")
    left.set_ylabel("GiB (planned)")
    left.set_title(f"per device, of {plan.device_memory_bytes / GIB:.1f} GiB")
    left.legend(loc="lower right", fontsize=8)
    rows_axis = names[0]
    columns = list(names[1:]) or ["(one column)"]
    n_rows = shape[0]
    n_columns = math.prod(shape[1:]) if len(shape) > 1 else 1
    slices = device_slices(plan, row)
    right.set_xlim(0, n_columns)
    right.set_ylim(n_rows, 0)
    for flat, (position, text) in enumerate(slices.items()):
        r, c = position[0], flat % n_columns
        right.add_patch(
            plt.Rectangle(
                (c, r), 1, 1, fill=True, alpha=0.25, color=f"C{flat % 10}", ec="k"
            )
        )
        right.text(
            c + 0.5,
            r + 0.5,
            f"device {flat}\n{text}",
            ha="center",
            va="center",
            fontsize=7,
        )
    right.set_xticks([c + 0.5 for c in range(n_columns)])
    right.set_xticklabels(range(n_columns))
    right.set_yticks([r + 0.5 for r in range(n_rows)])
    right.set_yticklabels(range(n_rows))
    right.set_ylabel(rows_axis)
    right.set_xlabel(" x ".join(str(c) for c in columns))
    right.set_title(f"{row.path} {row.shape}, spec {row.spec}", fontsize=9)
    figure.tight_layout()
    plt.close(figure)
    return figure
