"""The ways to lay a model's weights out on a mesh, and what each holds.

An `Alternative` is a mesh, a strategy and a key/value layout. The planner
in the fitting stage asks, for each mesh and strategy it weighs, what
planning counts (`kv_costs`, a `KVCosts` each): the key/value layout the
layout alone decides (`fixed_kv_layout`), else each one worth comparing
(`kv_fallbacks`) with its per-device parameter bytes, counted for every
mesh and strategy in one pass over the weights (`held_bytes`); then the
rows of the one it keeps (`rows`). Nothing here weighs an alternative
against a device's memory.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from collections.abc import Sequence

from keras_hub_autodist.errors import StrategyError
from keras_hub_autodist.planning import sharding
from keras_hub_autodist.planning.mesh import MeshAxes
from keras_hub_autodist.planning.options import PlanOptions
from keras_hub_autodist.planning.shapes import ModelWeights
from keras_hub_autodist.reading.dtypes import itemsize

# The layouts of key/value kernels whose heads don't divide the model axis
# (`sharding.assign_mesh_axes`'s `kv_fallback`), fewest collectives first.
KV_FALLBACKS = ("replicate", "head_dim")


@dataclasses.dataclass(frozen=True)
class Alternative:
    """One way to lay a model out: a mesh, a strategy, a key/value layout."""

    mesh_axes: MeshAxes
    strategy: str
    kv_fallback: str = "replicate"


@dataclasses.dataclass(frozen=True)
class KVCosts:
    """What planning counts for the key/value layout of one mesh and
    strategy; the fitting stage chooses by memory.

    Args:
        mesh_axes: the mesh.
        strategy: `"tp"` or `"fsdp"`.
        held: per-device parameter bytes of each key/value layout worth
            costing (`kv_fallbacks`), by its `kv_fallback`.
        fixed: `(kv_fallback, reason)` where the layout alone decides it
            (`fixed_kv_layout`); `None` where the layouts are compared.
        ideal: where they are compared, all parameter bytes spread
            perfectly over the devices the strategy shards over (the model
            axis for `"tp"`, every device for `"fsdp"`); else 0.
    """

    mesh_axes: MeshAxes
    strategy: str
    held: Mapping[str, int]
    fixed: tuple[str, str] | None
    ideal: float


def kv_costs(
    model: ModelWeights, cases: Sequence[tuple[MeshAxes, str]]
) -> list[KVCosts]:
    """A `KVCosts` for each `(mesh_axes, strategy)` of `cases`, the
    parameter bytes of all of them counted in one pass over the weights.

    Example:
    ```python
    tp, fsdp = kv_costs(weights, [(mesh_axes, "tp"), (mesh_axes, "fsdp")])
    tp.held["replicate"]
    ```
    """
    alternatives = [
        Alternative(mesh_axes, strategy, kv_fallback)
        for mesh_axes, strategy in cases
        for kv_fallback in kv_fallbacks(model, mesh_axes)
    ]
    held = dict(zip(alternatives, held_bytes(model, alternatives)))
    total = ideal_device_bytes(model, 1)
    costs = []
    for mesh_axes, strategy in cases:
        fixed = fixed_kv_layout(model, mesh_axes, strategy)
        shards = (
            mesh_axes.num_devices
            if strategy == "fsdp"
            else mesh_axes.sizes[mesh_axes.model_axis]
        )
        costs.append(
            KVCosts(
                mesh_axes,
                strategy,
                {
                    alternative.kv_fallback: bytes_held
                    for alternative, bytes_held in held.items()
                    if (alternative.mesh_axes, alternative.strategy)
                    == (mesh_axes, strategy)
                },
                fixed,
                0.0 if fixed is not None else total / shards,
            )
        )
    return costs


def check_sequence_split(options: PlanOptions, mesh_axes: MeshAxes) -> None:
    """Sequence parallelism and a context axis both split each sequence:
    refuse the two together.

    Example:
    ```python
    check_sequence_split(PlanOptions(), resolve_mesh_axes({"batch": 2}))
    ```
    """
    if options.sequence_parallel and mesh_axes.sizes[mesh_axes.context_axis] > 1:
        raise StrategyError(
            "sequence_parallel=True splits the residual stream's sequence over "
            "the model axis, and the context axis "
            f"{mesh_axes.context_axis!r} already splits every sequence: use "
            "one of them. Drop `sequence_parallel=True` (the context axis "
            "splits more: attention and logits too). Received: "
            f"sequence_parallel=True, mesh axes ({mesh_axes.describe()})"
        )


def held_bytes(model: ModelWeights, alternatives: list[Alternative]) -> list[int]:
    """Per-device parameter bytes of each alternative, in one pass over the
    weights. A layer's weights repeat in every block, so each distinct
    (shape, logical axes) is laid out once per alternative.

    Example:
    ```python
    held_bytes(weights, [Alternative(mesh_axes, "tp"), Alternative(mesh_axes, "fsdp")])
    ```
    """
    size_of = itemsize(model.dtype)
    held = [0] * len(alternatives)
    shards_of: dict[tuple, int] = {}
    for weight in model.weights:
        size = math.prod(weight.shape) * size_of
        for index, alternative in enumerate(alternatives):
            key = (weight.shape, weight.logical_axes, index)
            if key not in shards_of:
                spec, _ = _assign(model, weight, alternative)
                shards_of[key] = _shards(spec, alternative.mesh_axes)
            held[index] += size // shards_of[key]
    return held


def ideal_device_bytes(model: ModelWeights, shards: int) -> float:
    """All parameter bytes spread perfectly over `shards` devices.

    Example:
    ```python
    ideal_device_bytes(weights, 4)
    ```
    """
    total = sum(math.prod(w.shape) for w in model.weights) * itemsize(model.dtype)
    return total / shards


def rows(model: ModelWeights, alternative: Alternative, kv_policy: str = ""):
    """Every weight laid out by `alternative`: one `Weight` each, with its
    spec, fallbacks and shards; `kv_policy` says why its key/value layout
    (recorded on the key/value rows).

    Example:
    ```python
    rows(weights, Alternative(mesh_axes, "tp"))[0].spec
    ```
    """
    laid_out = []
    for weight in model.weights:
        spec, fallbacks = _assign(model, weight, alternative, kv_policy)
        laid_out.append(
            dataclasses.replace(
                weight,
                dtype=model.dtype,
                spec=spec,
                fallbacks=tuple(fallbacks),
                shards=_shards(spec, alternative.mesh_axes),
            )
        )
    return laid_out


def _assign(model, weight, alternative: Alternative, kv_policy: str = ""):
    return sharding.assign_mesh_axes(
        weight,
        alternative.mesh_axes,
        alternative.strategy,
        model.config_fields,
        kv_fallback=alternative.kv_fallback,
        kv_policy=kv_policy,
    )


def _shards(spec, mesh_axes: MeshAxes) -> int:
    return math.prod(mesh_axes.sizes[axis] for axis in spec)


def _first_with(model: ModelWeights, logical: str):
    return next((w for w in model.weights if logical in w.logical_axes), None)


def kv_fallbacks(model: ModelWeights, mesh_axes: MeshAxes) -> tuple[str, ...]:
    """The key/value layouts worth costing: all of `KV_FALLBACKS` when
    key/value heads don't divide the model axis, else replication only.

    Example:
    ```python
    kv_fallbacks(weights, mesh_axes)  # ('replicate', 'head_dim')
    ```
    """
    model_size = mesh_axes.sizes[mesh_axes.model_axis]
    kv = _first_with(model, "kv_heads")
    if model_size == 1 or kv is None:
        return ("replicate",)
    if kv.shape[kv.logical_axes.index("kv_heads")] % model_size == 0:
        return ("replicate",)
    return KV_FALLBACKS


def fixed_kv_layout(
    model: ModelWeights, mesh_axes: MeshAxes, strategy: str
) -> tuple[str, str] | None:
    """The key/value layout and why, where the layout alone decides it; `None`
    where the alternatives are to be compared.

    Replication when there is nothing to choose (`kv_fallbacks`). When the
    query heads don't divide the model axis either, K/V follow the query's
    layout: sharded on head_dim when the query is, else replicated.

    Example:
    ```python
    fixed_kv_layout(weights, mesh_axes, "tp")  # ('replicate', '')
    ```
    """
    fallbacks = kv_fallbacks(model, mesh_axes)
    if len(fallbacks) == 1:
        return fallbacks[0], ""
    model_axis = mesh_axes.model_axis
    model_size = mesh_axes.sizes[model_axis]
    query = _first_with(model, "heads")
    if (
        query is not None
        and query.shape[query.logical_axes.index("heads")] % model_size
    ):
        spec, _ = _assign(model, query, Alternative(mesh_axes, strategy, "head_dim"))
        if spec[query.logical_axes.index("head_dim")] == model_axis:
            return "head_dim", "query heads are sharded on head_dim, so are K/V"
        # The query is replicated over the model axis; so are K/V, and their
        # own notes say why.
        return "replicate", ""
    return None
