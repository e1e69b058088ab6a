"""Normalise `device_mesh` arguments and give each mesh axis its role.

A mesh axis has one of four roles:

- the **batch** axis: input batches are split over it (data parallelism);
  with the `"fsdp"` strategy weights are sharded over it too.
- the **model** axis: weights are split over it Megatron-style (heads, MLP
  columns, vocabulary).
- the **hidden** axis (optional, 3D meshes): a second model axis that shards
  the hidden/embedding dimension of the weights (2D tensor parallelism).
- the **expert** axis (optional, the axis named `expert`): mixtures of
  experts put their experts on it (expert parallelism); other weights are
  replicated over it and input batches are not split over it.
- the **context** axis (optional, the axis named `context`): the tokens of
  each sequence are split over it (context parallelism); attention gathers
  the keys and values over it. With `"fsdp"` weights are sharded over it too.

Roles are given by name, never by position.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import sys
import types
from collections.abc import Mapping
from typing import Any

from keras_hub_autodist.errors import DeviceMeshTypeError
from keras_hub_autodist.errors import MeshError
from keras_hub_autodist.errors import mesh_example
from keras_hub_autodist.errors import option

BATCH_AXIS_NAMES = ("batch", "data")
MODEL_AXIS_NAMES = ("model", "tensor")
EXPERT_AXIS_NAMES = ("expert",)
CONTEXT_AXIS_NAMES = ("context",)
# The most devices a mesh may span: far beyond the largest machines built
# (tens of thousands of chips), and small enough that planning for it (which
# tries every divisor of the device count) stays quick.
MAX_DEVICES = 2**20


@dataclasses.dataclass(frozen=True)
class MeshAxes:
    """The shape of a mesh and the role of each of its axes.

    Args:
        axis_names: the names of the mesh axes, in mesh order.
        shape: the size of each axis, in mesh order.
        batch_axis: the axis that splits input batches.
        model_axis: the axis that shards weights tensor-parallel, or `None`.
        hidden_axis: a second model axis sharding the hidden dimension, or
            `None`.
        expert_axis: the axis that shards the experts of a mixture of
            experts, or `None` (then the model axis does).
        context_axis: the axis that splits each sequence (context
            parallelism), or `None`.

    Example:
    >>> axes = resolve_mesh_axes({"model": 4, "batch": 2})
    >>> axes.batch_axis, axes.size("model")
    ('batch', 4)
    """

    axis_names: tuple[str, ...]
    shape: tuple[int, ...]
    batch_axis: str
    model_axis: str | None
    hidden_axis: str | None
    expert_axis: str | None = None
    context_axis: str | None = None
    # Each axis' size by name, and 1 for `None` (no such axis): the sizes as
    # data, for code that only reads them.
    sizes: Mapping[str | None, int] = dataclasses.field(
        init=False, repr=False, compare=False, hash=False
    )

    def __post_init__(self):
        sizes = {None: 1, **dict(zip(self.axis_names, self.shape))}
        object.__setattr__(self, "sizes", types.MappingProxyType(sizes))

    def size(self, axis: str | None) -> int:
        """Size of a mesh axis (1 for `None`)."""
        if axis is None:
            return 1
        return self.shape[self.axis_names.index(axis)]

    @property
    def num_devices(self) -> int:
        return math.prod(self.shape)

    def describe(self) -> str:
        return ", ".join(
            f"{name}={size}" for name, size in zip(self.axis_names, self.shape)
        )


def is_device_mesh(obj) -> bool:
    """True for a `keras.distribution.DeviceMesh`, without importing Keras.

    Nothing can be a `DeviceMesh` before Keras is imported, so planning for a
    mesh given as a mapping never imports Keras (or JAX).

    Example:
    >>> is_device_mesh({"batch": 2})
    False
    """
    keras = sys.modules.get("keras")
    distribution = getattr(keras, "distribution", None)
    mesh_cls = getattr(distribution, "DeviceMesh", None)
    return mesh_cls is not None and isinstance(obj, mesh_cls)


def _check_distinct_devices(names, shape, devices) -> None:
    devices = list(devices)
    seen = set()
    repeated = [d for d in devices if d in seen or seen.add(d)]
    if repeated:
        raise MeshError(
            "Each device may appear once in a mesh, but "
            f"{len(devices) - len(seen)} of the {len(devices)} entries repeat "
            f"a device (first: {repeated[0]}). List {len(devices)} distinct "
            "devices, e.g. `keras.distribution.list_devices()`. Received: "
            f"mesh axes {dict(zip(names, shape))}, devices={devices}"
        )


def _axis_size(size) -> int | None:
    """`size` as an `int` if it is an integer (`int`, `np.int64`, anything
    `operator.index` takes) other than a bool, else `None`."""
    if isinstance(size, bool) or type(size).__name__ == "bool_":
        return None
    try:
        return operator.index(size)
    except TypeError:
        return None


def check_device_count(count: int, *, received: str) -> int:
    """`count` if a mesh may span that many devices, else a `MeshError`.

    Args:
        count: a number of devices, at least 1.
        received: how the caller passed it, for the message, e.g.
            `"devices=1000000000000"` or `"--devices 1000000000000"`.

    Example:
    >>> check_device_count(8, received="devices=8")
    8
    """
    if count > MAX_DEVICES:
        raise MeshError(
            f"A mesh spans at most {MAX_DEVICES} (2**20) devices, far more "
            f"than any machine has, but this one spans {count}. Give the "
            "mesh the devices the model runs on, e.g. "
            "`len(keras.distribution.list_devices())` of them. Received: "
            f"{received}"
        )
    return count


def _unknown_devices(devices) -> list:
    """The entries of a `DeviceMesh` that name no device JAX has.

    Keras' JAX backend takes `jax.Device`s and their names as
    `keras.distribution.list_devices()` gives them (`"cpu:0"`, `"gpu:3"`).
    Other backends are left to Keras.
    """
    keras = sys.modules.get("keras")
    jax = sys.modules.get("jax")
    if jax is None or keras is None or keras.backend.backend() != "jax":
        return []
    ids_by_platform = {}

    def ids(platform):
        if platform not in ids_by_platform:
            try:
                found = jax.devices(backend=platform)
            except (RuntimeError, ValueError):  # "Unknown backend"
                found = []
            ids_by_platform[platform] = {device.id for device in found}
        return ids_by_platform[platform]

    unknown = []
    for device in devices:
        if isinstance(device, jax.Device):
            continue
        if isinstance(device, str):
            platform, _, index = device.partition(":")
            index = index or "0"
            if platform and index.isdigit() and int(index) in ids(platform):
                continue
        unknown.append(device)
    return unknown


def _check_devices_exist(names, shape, devices) -> None:
    unknown = _unknown_devices(devices)
    if unknown:
        shown = ", ".join(repr(d) for d in unknown[:4])
        more = ", ..." if len(unknown) > 4 else ""
        raise MeshError(
            "A `keras.distribution.DeviceMesh` lays out devices: JAX devices "
            "or their names such as 'cpu:0'. "
            f"{len(unknown)} of its {len(devices)} entries name no device of "
            f"this machine (first: {unknown[0]!r} of type "
            f"{type(unknown[0]).__name__}). Build the mesh over "
            "`keras.distribution.list_devices()`, or pass the axis sizes "
            "as a mapping such as {'batch': 2, 'model': 4}. Received: mesh "
            f"axes {dict(zip(names, shape))}, devices=[{shown}{more}]"
        )


@dataclasses.dataclass(frozen=True)
class MeshArgument:
    """A `device_mesh=` argument, read and checked once.

    Args:
        axis_names: the axis names, in mesh order (empty for `"auto"`).
        shape: the axis sizes, as `int`s (empty for `"auto"`).
        device_mesh: the `keras.distribution.DeviceMesh` given, if one was.
        auto: whether `"auto"` was given: the planner chooses the mesh.

    Example:
    >>> read_device_mesh({"batch": 2, "model": 4}).shape
    (2, 4)
    """

    axis_names: tuple[str, ...] = ()
    shape: tuple[int, ...] = ()
    device_mesh: Any = None
    auto: bool = False

    @property
    def devices(self) -> tuple | None:
        """The devices of the `DeviceMesh` given, in mesh order; else None."""
        if self.device_mesh is None:
            return None
        devices = self.device_mesh.devices
        return tuple(devices.ravel() if hasattr(devices, "ravel") else devices)


def read_device_mesh(device_mesh, *, auto_allowed: bool = True) -> MeshArgument:
    """Read a `device_mesh=` argument: a `DeviceMesh`, a mapping or `"auto"`.

    The one place that tells the forms apart. Axis sizes may be any
    integers (`np.int64` included) and are returned as `int`s; the mapping
    passed is left as it is. A `DeviceMesh` that lists a device more than
    once, or something that is not a device, is a `MeshError`, as is a mesh
    of more than `MAX_DEVICES` devices.

    Args:
        device_mesh: the argument.
        auto_allowed: whether `"auto"` is accepted here.

    Example:
    >>> import numpy as np
    >>> read_device_mesh({"batch": np.int64(2), "model": 4}).axis_names
    ('batch', 'model')
    >>> read_device_mesh("auto").auto
    True
    """
    if isinstance(device_mesh, str) and auto_allowed:
        if device_mesh != "auto":
            raise MeshError(
                "`device_mesh` takes a DeviceMesh, a mapping such as "
                "{'batch': 2, 'model': 4}, or 'auto'. Received: "
                f"device_mesh={device_mesh!r}"
            )
        return MeshArgument(auto=True)
    if is_device_mesh(device_mesh):
        names = tuple(device_mesh.axis_names)
        shape = tuple(device_mesh.shape)
        argument = MeshArgument(names, shape, device_mesh)
        if argument.devices is not None:
            _check_distinct_devices(names, shape, argument.devices)
            _check_devices_exist(names, shape, argument.devices)
        return argument
    if isinstance(device_mesh, Mapping):
        return MeshArgument(*_mapping_shape(device_mesh))
    raise DeviceMeshTypeError(
        "`device_mesh` must be a `keras.distribution.DeviceMesh`, a "
        "mapping of axis name to size such as {'batch': 2, 'model': 4}"
        + (", or 'auto'" if auto_allowed else "")
        + f". Received: device_mesh={device_mesh!r} of type "
        f"{type(device_mesh).__name__}"
    )


def _mapping_shape(device_mesh: Mapping) -> tuple[tuple[str, ...], tuple[int, ...]]:
    if not device_mesh:
        raise MeshError(
            "`device_mesh` is an empty mapping. Give at least a batch "
            "axis, e.g. device_mesh={'batch': 2, 'model': 4}. "
            f"Received: device_mesh={device_mesh!r}"
        )
    names, sizes = [], []
    for name, size in device_mesh.items():
        integer = _axis_size(size)
        if not isinstance(name, str) or (
            integer is None and not isinstance(size, bool)
        ):
            raise MeshError(
                "A `device_mesh` mapping goes from axis name (str) to "
                "axis size (an integer), e.g. {'batch': 2, 'model': 4}. "
                f"Received: device_mesh={dict(device_mesh)!r}"
            )
        if integer is None or integer < 1:
            raise MeshError(
                f"Mesh axis sizes must be positive integers. Received: "
                f"{name}={size!r} in device_mesh={dict(device_mesh)!r}"
            )
        names.append(name)
        sizes.append(integer)
    check_device_count(math.prod(sizes), received=f"device_mesh={dict(device_mesh)!r}")
    return tuple(names), tuple(sizes)


def mesh_shape(device_mesh) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """Return `(axis_names, shape)` of a `DeviceMesh` or a mapping
    (`read_device_mesh` without `"auto"`).

    Example:
    >>> mesh_shape({"batch": 2, "model": 4})
    (('batch', 'model'), (2, 4))
    """
    argument = read_device_mesh(device_mesh, auto_allowed=False)
    return argument.axis_names, argument.shape


def require_device_mesh(device_mesh, why: str):
    """`device_mesh` if it is a `keras.distribution.DeviceMesh`, else a
    `MeshError` that starts with `why` (what needs one, and what to do).

    Example:
    ```python
    require_device_mesh(mesh, "`layout_map()` needs a DeviceMesh.")
    ```
    """
    if not is_device_mesh(device_mesh):
        raise MeshError(f"{why} Received: device_mesh={device_mesh!r}")
    return device_mesh


def _pick(names, requested, defaults, role, keyword):
    if requested is not None:
        if requested not in names:
            raise MeshError(
                f"{option(keyword, repr(requested))} is not an axis of the "
                f"mesh. Pass one of {list(names)} as the {role} axis. "
                f"Received: {keyword}={requested!r}, mesh axes={list(names)}"
            )
        return requested
    for candidate in defaults:
        if candidate in names:
            return candidate
    return None


def resolve_mesh_axes(
    device_mesh,
    *,
    batch_axis: str | None = None,
    model_axis: str | None = None,
    context_axis: str | None = None,
) -> MeshAxes:
    """Give every axis of `device_mesh` a role.

    The batch axis is the one named `batch` (or `data`) unless `batch_axis`
    names another; the model axis is `model` (or `tensor`) unless
    `model_axis` names another. An axis named `expert` shards the experts of
    mixtures of experts; the axis named `context` (or `context_axis`) splits
    each sequence. One remaining axis becomes the hidden axis (2D
    tensor parallelism); more than one is an error.

    Args:
        device_mesh: a `keras.distribution.DeviceMesh` or a mapping of axis
            name to size.
        batch_axis: name of the batch axis, if not `batch`/`data`.
        model_axis: name of the model axis, if not `model`/`tensor`.
        context_axis: name of the context axis, if not `context`.

    Returns:
        A `MeshAxes`.

    Example:
    >>> resolve_mesh_axes({"data": 4, "tensor": 2}).model_axis
    'tensor'
    >>> resolve_mesh_axes({"batch": 2, "expert": 2, "model": 2}).expert_axis
    'expert'
    >>> resolve_mesh_axes({"batch": 2, "context": 4}).context_axis
    'context'
    """
    if isinstance(device_mesh, MeshArgument):
        names, shape = device_mesh.axis_names, device_mesh.shape
    else:
        names, shape = mesh_shape(device_mesh)
    received = ", ".join(f"{n}={s}" for n, s in zip(names, shape))
    batch = _pick(names, batch_axis, BATCH_AXIS_NAMES, "batch", "batch_axis")
    if batch is None:
        example = {"batch": 1, "model": math.prod(shape)}
        raise MeshError(
            "The mesh has no batch axis. Name one axis `batch` (or `data`), "
            f"or pass {option('batch_axis')}; for pure tensor parallelism add "
            f"a batch axis of size 1, e.g. {mesh_example(example)}. "
            f"Received: mesh axes ({received})"
        )
    if model_axis is not None and model_axis == batch:
        raise MeshError(
            f"{option('model_axis', repr(model_axis))} is also the batch "
            "axis. Give the two roles different axes. Received: mesh axes "
            f"({received})"
        )
    if context_axis is not None and context_axis in (batch, model_axis):
        raise MeshError(
            f"{option('context_axis', repr(context_axis))} is also the "
            f"{'batch' if context_axis == batch else 'model'} axis. Give the "
            f"roles different axes. Received: mesh axes ({received})"
        )
    context = _pick(
        [n for n in names if n not in (batch, model_axis)],
        context_axis,
        CONTEXT_AXIS_NAMES,
        "context",
        "context_axis",
    )
    model = _pick(
        [n for n in names if n not in (batch, context)],
        model_axis,
        MODEL_AXIS_NAMES,
        "model",
        "model_axis",
    )
    expert = next(
        (
            n
            for n in EXPERT_AXIS_NAMES
            if n in names and n not in (batch, model, context)
        ),
        None,
    )
    rest = [n for n in names if n not in (batch, model, expert, context)]
    if model is None and rest:
        raise MeshError(
            f"Mesh axis {rest[0]!r} has no role: it is neither the batch "
            "axis nor a model axis. Name it `model` or pass "
            f"{option('model_axis', repr(rest[0]))}. Received: mesh axes "
            f"({received})"
        )
    if len(rest) > 1:
        raise MeshError(
            f"Mesh axes {rest} have no role. A mesh has one batch axis, one "
            "model axis, optionally an `expert` and a `context` axis, and at "
            "most one more axis (a second model axis that shards the hidden "
            "dimension). "
            "Merge or drop the extra axes, or "
            f"name the roles with {option('batch_axis')}/"
            f"{option('model_axis')}. "
            f"Received: mesh axes ({received})"
        )
    hidden = rest[0] if rest else None
    return MeshAxes(names, shape, batch, model, hidden, expert, context)


@dataclasses.dataclass(frozen=True)
class ResolvedMesh:
    """The mesh a model is planned (and loaded) on: `device_mesh=` resolved
    once, at the entry, and taken by every later step.

    Args:
        axes: the axis names, sizes and roles.
        devices: the devices it spans, in mesh order; `None` when planning
            without devices (a mapping given to `plan()`).
        device_memory_bytes: the memory per device planned with.
        device_memory_source: where it comes from (`plan_record.MEMORY_*`).
        reason: why `device_mesh="auto"` chose this mesh; `""` otherwise.
        device_mesh: the `keras.distribution.DeviceMesh` given, if any.
    """

    axes: MeshAxes
    devices: tuple | None
    device_memory_bytes: int
    device_memory_source: str
    reason: str = ""
    device_mesh: Any = dataclasses.field(default=None, compare=False)

    def build(self):
        """The `keras.distribution.DeviceMesh`: the one given, or one of
        this shape over `devices`."""
        if self.device_mesh is not None:
            return self.device_mesh
        if self.devices is None:
            raise MeshError(
                "This mesh was planned without devices; pass them, e.g. "
                "plan for `keras.distribution.list_devices()`. Received: "
                f"mesh axes ({self.axes.describe()})"
            )
        return build_device_mesh(
            dict(zip(self.axes.axis_names, self.axes.shape)), list(self.devices)
        )


def build_device_mesh(device_mesh, devices=None):
    """Turn a mapping into a `DeviceMesh` over `devices` (default: all).

    A `DeviceMesh` is checked against the available devices and returned.

    Args:
        device_mesh: a `DeviceMesh` or a mapping of axis name to size.
        devices: the devices to lay out; defaults to
            `keras.distribution.list_devices()`.

    Example:
    >>> mesh = build_device_mesh({"batch": 2, "model": 4})
    >>> mesh.shape
    (2, 4)
    """
    import keras

    argument = read_device_mesh(device_mesh, auto_allowed=False)
    if argument.device_mesh is not None:
        return argument.device_mesh
    names, shape = argument.axis_names, argument.shape
    available = keras.distribution.list_devices() if devices is None else devices
    _check_distinct_devices(names, shape, available)
    if math.prod(shape) != len(available):
        raise MeshError(
            f"The mesh has {math.prod(shape)} devices "
            f"({', '.join(f'{n}={s}' for n, s in zip(names, shape))}) but "
            f"{len(available)} devices are available. Make the product of "
            f"the axis sizes equal {len(available)}. Received: "
            f"device_mesh={dict(zip(names, shape))!r}"
        )
    return keras.distribution.DeviceMesh(shape, names, available)
