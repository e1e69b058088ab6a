"""Normalise `device_mesh` arguments and give each mesh axis its role.

A mesh axis has one of three roles:

- the **batch** axis: input batches are split over it (data parallelism);
  with the `"fsdp"` strategy weights are sharded over it too.
- the **model** axis: weights are split over it Megatron-style (heads, MLP
  columns, vocabulary).
- the **hidden** axis (optional, 3D meshes): a second model axis that shards
  the hidden/embedding dimension of the weights (2D tensor parallelism).

Roles are given by name, never by position.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import keras

from keras_hub_autodist.errors import DeviceMeshTypeError
from keras_hub_autodist.errors import MeshError

BATCH_AXIS_NAMES = ("batch", "data")
MODEL_AXIS_NAMES = ("model", "tensor")


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


def mesh_shape(device_mesh) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """Return `(axis_names, shape)` of a `DeviceMesh` or a mapping."""
    if isinstance(device_mesh, keras.distribution.DeviceMesh):
        return tuple(device_mesh.axis_names), tuple(device_mesh.shape)
    if isinstance(device_mesh, Mapping):
        if not device_mesh:
            raise MeshError(
                "`device_mesh` is an empty mapping. Give at least a batch "
                "axis, e.g. device_mesh={'batch': 2, 'model': 4}. "
                f"Received: device_mesh={device_mesh!r}"
            )
        names, sizes = [], []
        for name, size in device_mesh.items():
            if not isinstance(name, str) or not isinstance(size, int):
                raise MeshError(
                    "A `device_mesh` mapping goes from axis name (str) to "
                    "axis size (int), e.g. {'batch': 2, 'model': 4}. "
                    f"Received: device_mesh={dict(device_mesh)!r}"
                )
            if isinstance(size, bool) or size < 1:
                raise MeshError(
                    f"Mesh axis sizes must be positive integers. Received: "
                    f"{name}={size!r} in device_mesh={dict(device_mesh)!r}"
                )
            names.append(name)
            sizes.append(size)
        return tuple(names), tuple(sizes)
    raise DeviceMeshTypeError(
        "`device_mesh` must be a `keras.distribution.DeviceMesh` or a "
        "mapping of axis name to size such as {'batch': 2, 'model': 4}. "
        f"Received: device_mesh={device_mesh!r} of type "
        f"{type(device_mesh).__name__}"
    )


def _pick(names, requested, defaults, role, option):
    if requested is not None:
        if requested not in names:
            raise MeshError(
                f"`{option}={requested!r}` is not an axis of the mesh. Pass "
                f"one of {list(names)}. Received: {option}={requested!r}, "
                f"mesh axes={list(names)}"
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
) -> MeshAxes:
    """Give every axis of `device_mesh` a role.

    The batch axis is the one named `batch` (or `data`) unless `batch_axis`
    names another; the model axis is `model` (or `tensor`) unless
    `model_axis` names another. One remaining axis becomes the hidden axis
    (2D tensor parallelism); more than one is an error.

    Args:
        device_mesh: a `keras.distribution.DeviceMesh` or a mapping of axis
            name to size.
        batch_axis: name of the batch axis, if not `batch`/`data`.
        model_axis: name of the model axis, if not `model`/`tensor`.

    Returns:
        A `MeshAxes`.

    Example:
    >>> resolve_mesh_axes({"data": 4, "tensor": 2}).model_axis
    'tensor'
    """
    names, shape = mesh_shape(device_mesh)
    received = ", ".join(f"{n}={s}" for n, s in zip(names, shape))
    batch = _pick(names, batch_axis, BATCH_AXIS_NAMES, "batch", "batch_axis")
    if batch is None:
        raise MeshError(
            "The mesh has no batch axis. Name one axis `batch` (or `data`), "
            "or pass `batch_axis=`; for pure tensor parallelism add a batch "
            "axis of size 1, e.g. {'batch': 1, 'model': 8}. "
            f"Received: mesh axes ({received})"
        )
    if model_axis is not None and model_axis == batch:
        raise MeshError(
            f"`model_axis={model_axis!r}` is also the batch axis. Give the "
            f"two roles different axes. Received: mesh axes ({received})"
        )
    model = _pick(
        [n for n in names if n != batch],
        model_axis,
        MODEL_AXIS_NAMES,
        "model",
        "model_axis",
    )
    rest = [n for n in names if n not in (batch, model)]
    if model is None and rest:
        raise MeshError(
            f"Mesh axis {rest[0]!r} has no role: it is neither the batch "
            "axis nor a model axis. Name it `model` or pass "
            f"`model_axis={rest[0]!r}`. Received: mesh axes ({received})"
        )
    if len(rest) > 1:
        raise MeshError(
            f"Mesh axes {rest} have no role. A mesh has one batch axis, one "
            "model axis and at most one more axis (a second model axis that "
            "shards the hidden dimension). Merge or drop the extra axes, or "
            "name the roles with `batch_axis=`/`model_axis=`. "
            f"Received: mesh axes ({received})"
        )
    hidden = rest[0] if rest else None
    return MeshAxes(names, shape, batch, model, hidden)


def build_device_mesh(device_mesh, devices=None) -> keras.distribution.DeviceMesh:
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
    names, shape = mesh_shape(device_mesh)
    if isinstance(device_mesh, keras.distribution.DeviceMesh):
        return device_mesh
    available = keras.distribution.list_devices() if devices is None else devices
    if math.prod(shape) != len(available):
        raise MeshError(
            f"The mesh has {math.prod(shape)} devices "
            f"({', '.join(f'{n}={s}' for n, s in zip(names, shape))}) but "
            f"{len(available)} devices are available. Make the product of "
            f"the axis sizes equal {len(available)}. Received: "
            f"device_mesh={dict(zip(names, shape))!r}"
        )
    return keras.distribution.DeviceMesh(shape, names, available)
