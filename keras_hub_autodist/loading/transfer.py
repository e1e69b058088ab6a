"""Putting host slices on the devices: placeholders, aligned buffers, casts.

On CPU, JAX's devices adopt 64-byte-aligned host buffers without a copy, so
slices are read straight into such buffers, cast to the model's dtype by
the reading threads. On accelerators, a weight whose file dtype is a
narrower float than the model's crosses as it is stored and is cast on the
devices (`device_cast`), so a bfloat16 checkpoint costs the same transfer
into a float32 model as into a bfloat16 one.

Fresh host memory is dear on CPU: the kernel zeroes each page as it is
first touched, which costs more than copying the file's bytes into it. The
buffers of each placeholder made while keras-hub builds the model are the
ones its variable's value will be read into (`ReservedShards`): one mapping
per variable, whose pages the reading threads fault in as they fill them.
"""

from __future__ import annotations

import collections
import functools
import math
import sys
import threading

import jax
import jax.numpy as jnp
import keras
import numpy as np

from keras_hub_autodist.loading.file_reads import BUFFER_ALIGNMENT
from keras_hub_autodist.loading.file_reads import aligned_empty
from keras_hub_autodist.loading.file_reads import local_shape


def _glibc_malloc_trim():
    """glibc's `malloc_trim`, or `None` on other C libraries."""
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _glibc_malloc_trim() if sys.platform.startswith("linux") else None


def release_host_memory() -> None:
    """Give freed heap memory back to the operating system (glibc only).

    Each weight's host slices are freed once its shards are on the devices,
    but glibc keeps freed heap pages and grows the mmap threshold, so without
    this the host's resident memory grew by a third of the model while
    loading (measured: +210 MiB on a 610 MiB preset, +64 MiB with it).
    """
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def numpy_dtype(dtype) -> np.dtype:
    return np.dtype(jnp.dtype(keras.backend.standardize_dtype(dtype)))


def on_cpu(sharding) -> bool:
    return all(device.platform == "cpu" for device in sharding.device_set)


def casts_on_device(stored: np.dtype, wanted: np.dtype, sharding) -> bool:
    """Whether a weight stored as `stored` goes to its devices as it is and
    is cast to `wanted` there: floats widened only (exact, and the device
    never holds more than the final shard plus a narrower one), on
    accelerators only. On CPU the devices are the host: the reading threads
    cast as they read, and each shard is written once."""
    floats = all(jnp.issubdtype(d, jnp.floating) for d in (stored, wanted))
    widened = floats and stored != wanted and stored.itemsize < wanted.itemsize
    return widened and not on_cpu(sharding)


@functools.lru_cache(maxsize=256)
def device_cast(dtype: str, sharding):
    """A compiled cast to `dtype` that keeps `sharding`."""
    return jax.jit(lambda values: values.astype(dtype), out_shardings=sharding)


@functools.lru_cache(maxsize=256)
def device_zeros(shape: tuple, dtype: str, sharding):
    """Zeros made on the devices, laid out as `sharding`."""
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


def aligned_copy(values: np.ndarray) -> np.ndarray:
    copy = aligned_empty(values.shape, values.dtype)
    copy[...] = values
    return copy


def slice_bounds(index: tuple, shape: tuple) -> tuple:
    """`(start, stop)` per dimension of `index` in an array of `shape`: one
    key for the indices of a slice however they are written."""
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def to_devices(shape: tuple, sharding, values: list) -> jax.Array:
    """One array laid out as `sharding` from host arrays, one per device.

    On CPU each aligned buffer becomes its device's memory without a copy,
    so no buffer may be given to two devices.

    Args:
        shape: the global shape.
        sharding: a `jax.sharding.Sharding` over the devices.
        values: one host array per addressable device, in the order of
            `sharding.addressable_devices_indices_map(shape)`.

    Returns:
        The `jax.Array`.

    Example:
    >>> sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    >>> to_devices((2,), sharding, [np.ones(2, "float32")]).tolist()
    [1.0, 1.0]
    """
    shape = tuple(shape)
    indices = sharding.addressable_devices_indices_map(shape)
    if sharding.is_fully_replicated:
        # `make_array_from_callback` would give every device the one value
        # it asks for: one batched `device_put` keeps a buffer per device.
        arrays = jax.device_put(list(values), list(indices))
        return jax.make_array_from_single_device_arrays(shape, sharding, arrays)
    # A fifth of the cost of a `device_put` per device. The callback is
    # asked once per device for its index: each device of an index gets
    # the next of that index's values.
    queues = {}
    for index, value in zip(indices.values(), values):
        bounds = slice_bounds(index, shape)
        queues.setdefault(bounds, collections.deque()).append(value)
    return jax.make_array_from_callback(
        shape, sharding, lambda index: queues[slice_bounds(index, shape)].popleft()
    )


def placeholder(shape, dtype, sharding, buffers=None) -> jax.Array:
    """Zeros laid out as `sharding`: each device allocates only its shard.

    On accelerators they are made on the devices. On CPU each shard is an
    aligned host buffer of zeros the device adopts without a copy (`buffers`,
    one per addressable device, or fresh ones), so its pages are never
    touched before the real values replace it.
    """
    dtype = numpy_dtype(dtype)
    shape = tuple(shape)
    if not on_cpu(sharding):
        return device_zeros(shape, dtype.name, sharding)()
    if buffers is None:
        buffers = [
            aligned_empty(local_shape(index, shape), dtype, zeros=True)
            for index in sharding.addressable_devices_indices_map(shape).values()
        ]
    return to_devices(shape, sharding, buffers)


class _Reservation:
    """The host buffers of one variable's shards: views of one mapping, one
    per addressable device, in the order of `addressable_devices_indices_map`."""

    def __init__(self, shape: tuple, dtype: np.dtype, sharding):
        shapes = [
            local_shape(index, shape)
            for index in sharding.addressable_devices_indices_map(shape).values()
        ]
        sizes = [math.prod(s) * dtype.itemsize for s in shapes]
        padded = [-(-size // BUFFER_ALIGNMENT) * BUFFER_ALIGNMENT for size in sizes]
        self.key = (shape, dtype, sharding)
        self.memory = aligned_empty((sum(padded),), np.uint8, zeros=True)
        self.buffers, start = [], 0
        for local, size, step in zip(shapes, sizes, padded):
            view = self.memory[start : start + size].view(dtype).reshape(local)
            self.buffers.append(view)
            start += step


class ReservedShards:
    """On CPU, each placeholder's host buffers are the ones its variable's
    value will be read into.

    `placeholder` is called as keras-hub builds the model: the devices adopt
    fresh, untouched zero buffers as the placeholder's shards, kept under
    the variable's key. Once the placeholder is deleted, `take` hands them
    to the reads of the real value, whose threads fault the pages in as
    they fill them. So a variable maps its memory once, and no page is
    touched before its bytes arrive. `close` forgets what was not taken (a
    placeholder still alive keeps its own buffers).

    Example:
    ```python
    shards = ReservedShards()
    zeros = shards.placeholder(key, (8, 4), "float32", sharding)
    zeros.delete()
    buffers = shards.take(key, (8, 4), "float32", sharding)  # one per device
    shards.close()
    ```
    """

    def __init__(self):
        self._reserved = {}
        self._lock = threading.Lock()

    def placeholder(self, key, shape, dtype, sharding) -> jax.Array:
        """`placeholder(shape, dtype, sharding)`; on CPU its buffers are kept
        under `key` (e.g. the variable's id) for the value to come."""
        if not on_cpu(sharding):
            return placeholder(shape, dtype, sharding)
        shape, dtype = tuple(shape), numpy_dtype(dtype)
        reservation = _Reservation(shape, dtype, sharding)
        array = placeholder(shape, dtype, sharding, reservation.buffers)
        with self._lock:
            self._reserved[key] = reservation
        return array

    def take(self, key, shape, dtype, sharding) -> list[np.ndarray] | None:
        """The buffers kept under `key` (one per addressable device), once its
        placeholder is deleted; `None` if there are none for a value of this
        shape, dtype and sharding."""
        with self._lock:
            reservation = self._reserved.pop(key, None)
        if reservation is None or reservation.key != (
            tuple(shape),
            numpy_dtype(dtype),
            sharding,
        ):
            return None
        return reservation.buffers

    def close(self) -> None:
        """Forget every reservation not taken."""
        with self._lock:
            self._reserved.clear()
