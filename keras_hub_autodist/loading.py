"""Sharded loading: every weight goes straight into its shards.

Keras builds each variable whole on one device (random initial values), and
`Variable.assign` turns a loaded weight into a full array on the default
device before resharding it, so a model that fits once sharded can still run
out of memory while it loads (keras-team/keras#21634). Inside
`sharded_loading(...)`, while keras-hub's own loaders run:

- a laid-out variable gets a cheap placeholder of its final shards instead of
  its random initial value (skipped work: the checkpoint overwrites it); any
  variable that loading does not overwrite gets its real initial value
  afterwards, computed sharded;
- a Keras preset's HDF5 dataset is handed to `assign` unread, and each device
  reads only its own slice of it (`jax.make_array_from_callback`), so no full
  array exists on any device and the host holds at most one weight's slices;
  in a multi-process run each process reads only its devices' slices;
- a Hugging Face tensor that keras-hub's converter passes on unconverted
  (`port_weight` without a hook) is read from the safetensors file slice by
  slice, like an HDF5 dataset (`LazySafetensor`); a tensor its hooks convert
  arrives whole on the host, is sliced there and each device receives only
  its part. Either way the file is mapped only while one tensor is read
  (`SafetensorsFile`), so the host holds at most one tensor of it.

Outside the context, Keras behaves exactly as without this package: the hooks
are installed on entry and removed on exit, and act only in the thread that
entered.

Example:
```python
with distribution.scope(), sharded_loading(distribution) as stats:
    model = keras_hub.models.GemmaCausalLM.from_preset("./gemma_2b")
print(stats.bytes_read, stats.weights_loaded)
```
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import os
import sys
import threading
import time
import weakref

import h5py
import jax
import jax.numpy as jnp
import keras
import ml_dtypes
import numpy as np

from keras_hub_autodist import compat
from keras_hub_autodist.errors import LayoutMismatchError

PROGRESS_ENV = "KERAS_HUB_AUTODIST_PROGRESS"
# A progress bar appears once a load has run this long.
PROGRESS_DELAY_SECONDS = 2.0
PROGRESS_INTERVAL_SECONDS = 0.2
_LOAD_STATS_ATTR = "_keras_hub_autodist_load_stats"
# A large safetensors tensor is read in blocks of rows of about this size.
SAFETENSORS_CHUNK_BYTES = 16 * 1024**2


@dataclasses.dataclass
class LoadStats:
    """What a sharded load did.

    Args:
        weights_loaded: variables that received a value from the checkpoint.
        bytes_read: bytes read slice by slice from weight files: HDF5
            datasets of Keras presets, and safetensors tensors that a Hugging
            Face converter passes on unconverted. With a mesh spread over
            several processes, only this process's slices.
        bytes_received: bytes of host tensors received whole from a
            converter (Hugging Face presets, weights its hooks convert),
            before slicing.
        initializers_skipped: random initial values never computed because
            the checkpoint overwrote them.
        initialized_after_load: variables the checkpoint did not cover, given
            their initial values (sharded) after loading.
        seconds: wall time of the load.
    """

    weights_loaded: int = 0
    bytes_read: int = 0
    bytes_received: int = 0
    initializers_skipped: int = 0
    initialized_after_load: int = 0
    seconds: float = 0.0


class LazyH5Dataset:
    """An HDF5 dataset of a weight file, read slice by slice on demand.

    Keras' weight store returns one of these instead of a full numpy array
    while `sharded_loading` is active. `np.asarray(dataset)` still reads it
    whole, for code paths that need the full value.

    Args:
        session: the loading session that owns the open files.
        filename: the HDF5 file.
        name: the dataset's path inside the file.
        shape: the dataset's shape.
        dtype: the numpy dtype of its values (`bfloat16` for Keras'
            bfloat16 datasets, stored as 2-byte opaque values).
    """

    def __init__(self, session, filename: str, name: str, shape, dtype):
        self._session = session
        self.filename = filename
        self.name = name
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def read(self, index=()) -> np.ndarray:
        """Read `index` (a tuple of slices) of the dataset."""
        dataset = self._session.open_dataset(self.filename, self.name)
        values = dataset[index] if index else dataset[()]
        values = np.asarray(values)
        if values.dtype != self.dtype:  # Keras' bfloat16: opaque 2-byte values
            values = values.view(self.dtype)
        self._session.stats.bytes_read += values.nbytes
        return values

    def __array__(self, dtype=None, copy=None):
        values = self.read(tuple(slice(None) for _ in self.shape))
        return values if dtype is None else values.astype(dtype)

    def __repr__(self):
        return f"<LazyH5Dataset {self.filename}:{self.name} shape={self.shape}>"


class SafetensorsFile:
    """A safetensors file mapped only while one tensor is read from it.

    `safetensors.safe_open` maps the whole file for as long as it is open, and
    every page a read touches stays in the process's resident memory until
    the file is closed. keras-hub's `SafetensorLoader` keeps each file open
    for the whole load, so host RSS grew by the whole checkpoint (measured:
    +381 MiB on a 381 MiB file, over the final device bytes). While
    `sharded_loading` is active, keras-hub's loader gets one of these
    instead: each `get_tensor` opens the file, copies that tensor out and
    closes it again.

    Args:
        path: the `*.safetensors` file.
        framework: the framework of the tensors returned (keras-hub: `"np"`).
        **kwargs: passed on to `safetensors.safe_open`.

    Example:
    ```python
    with SafetensorsFile("model.safetensors") as file:
        tensor = file.get_tensor(file.keys()[0])
    ```
    """

    def __init__(self, path, framework: str = "np", **kwargs):
        import safetensors

        self._open = safetensors.safe_open
        self.path = path
        self._arguments = dict(framework=framework, **kwargs)
        with self._open(path, **self._arguments) as file:
            self._keys = list(file.keys())
            self._metadata = file.metadata()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        return False

    def keys(self) -> list:
        """The tensor names in the file."""
        return list(self._keys)

    def metadata(self):
        """The file's metadata."""
        return self._metadata

    def get_tensor(self, name: str):
        """Tensor `name`, read whole; the file is unmapped again on return.

        Inside keras-hub's `port_weight` without a conversion hook, a
        `LazySafetensor` instead: `assign` reads each device's slice.
        """
        session = _active_session()
        if session is not None and session.lazy_safetensors:
            lazy = self._lazy(name, session)
            if lazy is not None:
                return lazy
        return self.read(name)

    def read(self, name: str, index: tuple | None = None) -> np.ndarray:
        """Read `index` (a tuple of slices; `None`: all) of tensor `name`.

        A read spanning more than `SAFETENSORS_CHUNK_BYTES` of the file goes
        in blocks of rows, the file mapped for one block at a time, so the
        host holds the values plus one block of the file's pages rather
        than twice the values.
        """
        with self._open(self.path, **self._arguments) as file:
            part = file.get_slice(name)
            shape = tuple(part.get_shape())
            if index is None:
                index = tuple(slice(None) for _ in shape)
            if not shape or 0 in shape:
                return _read_index(file, name, index)
            start, stop, step = index[0].indices(shape[0])
            dtype = part[tuple(slice(0, 1) for _ in shape)].dtype
            row_bytes = dtype.itemsize * math.prod(shape[1:])
            rows = max(1, SAFETENSORS_CHUNK_BYTES // row_bytes)
            if step != 1 or stop - start <= rows:
                return _read_index(file, name, index)
        rest = tuple(index[1:])
        local = (stop - start,) + tuple(
            len(range(*s.indices(size))) for s, size in zip(rest, shape[1:])
        )
        values = np.empty(local, dtype)
        for begin in range(start, stop, rows):
            end = min(begin + rows, stop)
            with self._open(self.path, **self._arguments) as file:
                block = file.get_slice(name)[(slice(begin, end),) + rest]
                values[begin - start : end - start] = block
                del block
        return values

    def _lazy(self, name: str, session) -> LazySafetensor | None:
        with self._open(self.path, **self._arguments) as file:
            part = file.get_slice(name)
            shape = tuple(part.get_shape())
            if not shape or 0 in shape:
                return None
            dtype = part[tuple(slice(0, 1) for _ in shape)].dtype
        return LazySafetensor(self, name, shape, dtype, session.stats)


def _read_index(file, name: str, index: tuple) -> np.ndarray:
    """`index` of tensor `name` of an open safetensors file."""
    if all(s == slice(None) for s in index):
        return file.get_tensor(name)
    return file.get_slice(name)[index]


class LazySafetensor:
    """A tensor of a safetensors file, read slice by slice on demand.

    keras-hub's `port_weight` hands one of these to `assign` when it
    converts nothing (no hook) while `sharded_loading` is active, so each
    device's slice is read straight from the file (after the variable's
    placeholder is freed) and no whole copy exists on the host.
    `np.asarray(tensor)` still reads it whole.

    Args:
        file: the `SafetensorsFile` holding it.
        name: the tensor's name in the file.
        shape: its shape.
        dtype: the numpy dtype `safetensors` reads it as.
        stats: the `LoadStats` whose `bytes_read` counts what is read.
    """

    def __init__(self, file: SafetensorsFile, name: str, shape, dtype, stats):
        self.file = file
        self.name = name
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)
        self._stats = stats

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def read(self, index=()) -> np.ndarray:
        """Read `index` (a tuple of slices) of the tensor."""
        values = self.file.read(self.name, tuple(index) if index else None)
        self._stats.bytes_read += values.nbytes
        return values

    def __array__(self, dtype=None, copy=None):
        values = self.read()
        return values if dtype is None else values.astype(dtype)

    def __repr__(self):
        return f"<LazySafetensor {self.file.path}:{self.name} shape={self.shape}>"


class _SafetensorsModule:
    """The `safetensors` module keras-hub's loader sees during a load: its
    `safe_open` gives a `SafetensorsFile` in the loading thread, and the
    real `safe_open` anywhere else."""

    def __init__(self, module):
        self._module = module

    def safe_open(self, path, framework="np", **kwargs):
        if _active_session() is None:
            return self._module.safe_open(path, framework=framework, **kwargs)
        return SafetensorsFile(path, framework=framework, **kwargs)

    def __getattr__(self, name):
        return getattr(self._module, name)


class _Progress:
    """A one-line progress bar on a terminal; silent otherwise."""

    def __init__(self, total_weights: int, total_bytes: int, enabled: bool):
        self.total_weights = total_weights
        self.total_bytes = total_bytes
        self.enabled = enabled
        self.start = time.perf_counter()
        self.last = 0.0
        self.shown = False

    def update(self, weights: int, nbytes: int, final: bool = False) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        elapsed = now - self.start
        if elapsed < PROGRESS_DELAY_SECONDS and not self.shown:
            return
        if not final and now - self.last < PROGRESS_INTERVAL_SECONDS:
            return
        self.last, self.shown = now, True
        total = max(self.total_weights, weights)
        width = 24
        filled = int(width * weights / total) if total else width
        rate = nbytes / elapsed if elapsed > 0 else 0.0
        line = (
            f"\rLoading weights [{'#' * filled}{'.' * (width - filled)}] "
            f"{weights}/{total} weights, {_mib(nbytes)}/{_mib(self.total_bytes)}"
            f", {_mib(rate)}/s"
        )
        sys.stderr.write(line + ("\n" if final else ""))
        sys.stderr.flush()


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


def _mib(n: float) -> str:
    return f"{n / 1024**2:.1f} MiB"


def progress_enabled(progress: bool | None) -> bool:
    """Whether to show a progress bar: `progress` if given, else on a
    terminal unless `$KERAS_HUB_AUTODIST_PROGRESS` is `0`/`false`/`off`/`no`.

    Example:
    >>> progress_enabled(False)
    False
    """
    if progress is not None:
        return bool(progress)
    setting = os.environ.get(PROGRESS_ENV, "").strip().lower()
    if setting in ("0", "false", "off", "no"):
        return False
    return sys.stderr.isatty()


def _backend_sharding(layout):
    return getattr(layout, "backend_layout", layout)


def _numpy_dtype(dtype) -> np.dtype:
    return np.dtype(jnp.dtype(keras.backend.standardize_dtype(dtype)))


class _Session:
    """The state of one sharded load (one thread, one `from_preset`)."""

    def __init__(
        self, *, skip_initializers: bool, progress: _Progress, check_variable=None
    ):
        self.thread = threading.get_ident()
        self.skip_initializers = skip_initializers
        self.check_variable = check_variable
        self.progress = progress
        self.stats = LoadStats()
        self.pending = {}  # id(variable) -> (weakref to variable, initializer)
        self.placeholders = set()  # ids of variables holding a placeholder
        self.files = {}
        # True inside keras-hub's `port_weight` without a hook: safetensors
        # reads give a `LazySafetensor`.
        self.lazy_safetensors = False

    def open_dataset(self, filename: str, name: str):
        file = self.files.get(filename)
        if file is None:
            file = self.files[filename] = h5py.File(filename, "r")
        return file[name]

    def close(self):
        for file in self.files.values():
            file.close()
        self.files.clear()

    def put(self, source, variable) -> jax.Array:
        """Build `variable`'s sharded value from `source`, slice by slice."""
        sharding = _backend_sharding(variable._layout)
        dtype = _numpy_dtype(variable._dtype)
        shape = tuple(variable.shape)
        slices = {}

        def read_slice(index):
            key = tuple((s.start, s.stop, s.step) for s in index)
            values = slices.get(key)
            if values is None:
                if isinstance(source, _LAZY):
                    values = source.read(index)
                else:
                    values = np.asarray(source[index])
                values = values.astype(dtype, copy=False)
                slices[key] = values
            return values

        try:
            return jax.make_array_from_callback(shape, sharding, read_slice)
        finally:
            slices.clear()

    def count(self, variable) -> None:
        self.stats.weights_loaded += 1
        self.progress.update(
            self.stats.weights_loaded,
            self.stats.bytes_read + self.stats.bytes_received,
        )


_sessions: list[_Session] = []


def _active_session() -> _Session | None:
    if not _sessions:
        return None
    session = _sessions[-1]
    return session if session.thread == threading.get_ident() else None


def _placeholder(shape, dtype, sharding) -> jax.Array:
    """Zeros laid out as `sharding`: each device allocates only its shard."""
    dtype = _numpy_dtype(dtype)

    def zeros(index):
        local = tuple(len(range(*s.indices(size))) for s, size in zip(index, shape))
        return np.zeros(local, dtype)

    return jax.make_array_from_callback(tuple(shape), sharding, zeros)


# The hooks go on the class Keras instantiates (`keras.Variable`, the JAX
# backend's variable) and on Keras' HDF5 weight store, for the duration of
# a load only.
_VARIABLE = keras.Variable
_original_assign = _VARIABLE.assign
_original_initialize = _VARIABLE._initialize_with_initializer
_H5_IO_STORE = compat.h5_io_store()
_original_getitem = _H5_IO_STORE.__getitem__
_MISSING = object()
_LAZY = (LazyH5Dataset, LazySafetensor)


def _assign(variable, value):
    session = _active_session()
    layout = getattr(variable, "_layout", None)
    if session is None or layout is None:
        return _original_assign(variable, _whole(value))
    if not isinstance(value, (*_LAZY, np.ndarray, np.generic)):
        return _original_assign(variable, value)
    if tuple(value.shape) != tuple(variable.shape):
        # Keras' own message and error type for a shape mismatch.
        return _original_assign(variable, np.asarray(value))
    if isinstance(value, np.ndarray):
        session.stats.bytes_received += value.nbytes
    if id(variable) in session.placeholders:
        # The placeholder's shards are freed before the real ones arrive.
        session.placeholders.discard(id(variable))
        variable._value.delete()
        variable._value = None
    variable._value = session.put(value, variable)
    release_host_memory()
    session.pending.pop(id(variable), None)
    session.count(variable)
    return variable._value


def _whole(value):
    """`value`, read whole if it is a lazy tensor."""
    return np.asarray(value) if isinstance(value, _LAZY) else value


def _port_weight_hook(original):
    """keras-hub's `SafetensorLoader.port_weight`, handing `assign` a
    `LazySafetensor` when no hook converts the tensor."""
    signature = inspect.signature(original)

    def port_weight(loader, *args, **kwargs):
        session = _active_session()
        try:
            hook_fn = signature.bind(loader, *args, **kwargs).arguments.get("hook_fn")
        except TypeError:
            hook_fn = None  # keras-hub raises its own error below
            session = None
        if session is None or hook_fn is not None or session.lazy_safetensors:
            return original(loader, *args, **kwargs)
        session.lazy_safetensors = True
        try:
            return original(loader, *args, **kwargs)
        finally:
            session.lazy_safetensors = False

    return port_weight


def _initialize_with_initializer(variable, initializer):
    session = _active_session()
    if session is not None and session.check_variable is not None:
        # Before Keras lays the variable out: a wrong shape is reported
        # here rather than as JAX's error for an indivisible dimension.
        session.check_variable(variable.path, variable._shape)
    if session is None or not session.skip_initializers:
        return _original_initialize(variable, initializer)
    variable._initialize_layout()
    if variable._layout is None:
        return _original_initialize(variable, initializer)
    sharding = _backend_sharding(variable._layout)
    variable._value = _placeholder(variable._shape, variable._dtype, sharding)
    session.placeholders.add(id(variable))
    session.stats.initializers_skipped += 1
    session.pending[id(variable)] = (weakref.ref(variable), initializer)


def _getitem(store, key):
    session = _active_session()
    if session is None or getattr(store, "archive", None) is not None:
        return _original_getitem(store, key)
    dataset = compat.h5_dataset(store, key)
    filename = getattr(getattr(dataset, "file", None), "filename", None)
    if not isinstance(dataset, h5py.Dataset) or not filename:
        return _original_getitem(store, key)
    if not os.path.isfile(filename):
        return _original_getitem(store, key)
    if dataset.attrs.get("dtype") == "bfloat16":
        dtype = ml_dtypes.bfloat16
    else:
        dtype = dataset.dtype
    return LazyH5Dataset(session, filename, dataset.name, dataset.shape, dtype)


@contextlib.contextmanager
def _hooks_installed():
    hooks = [
        (_VARIABLE, "assign", _assign),
        (_VARIABLE, "_initialize_with_initializer", _initialize_with_initializer),
        (_H5_IO_STORE, "__getitem__", _getitem),
    ]
    safetensor_utils = compat.safetensor_utils_module()
    module = getattr(safetensor_utils, "safetensors", None)
    if module is not None and not isinstance(module, _SafetensorsModule):
        hooks.append((safetensor_utils, "safetensors", _SafetensorsModule(module)))
        loader = safetensor_utils.SafetensorLoader
        hooks.append((loader, "port_weight", _port_weight_hook(loader.port_weight)))
    saved = [(cls, name, vars(cls).get(name, _MISSING)) for cls, name, _ in hooks]
    for cls, name, hook in hooks:
        setattr(cls, name, hook)
    try:
        yield
    finally:
        for cls, name, previous in saved:
            if previous is _MISSING:
                delattr(cls, name)
            else:
                setattr(cls, name, previous)


def _initialize_pending(session: _Session) -> None:
    """Give variables the checkpoint did not cover their real initial value."""
    for reference, initializer in list(session.pending.values()):
        variable = reference()
        if variable is None:
            continue
        if id(variable) in session.placeholders:
            variable._value.delete()
            variable._value = None
        _original_initialize(variable, initializer)
        session.stats.initialized_after_load += 1
    session.stats.initializers_skipped -= session.stats.initialized_after_load
    session.pending.clear()
    session.placeholders.clear()


@contextlib.contextmanager
def sharded_loading(
    *,
    load_weights: bool = True,
    total_weights: int = 0,
    total_bytes: int = 0,
    progress: bool | None = None,
    check_variable=None,
):
    """Load weights straight into their shards while the context is active.

    Use it inside the distribution's scope, around keras-hub's `from_preset`.

    Args:
        load_weights: whether the checkpoint will overwrite the variables. When
            False, initial values are computed as usual.
        total_weights: the number of weights expected, for the progress bar.
        total_bytes: their bytes, for the progress bar.
        progress: show a progress bar (`None`: on a terminal, unless
            `$KERAS_HUB_AUTODIST_PROGRESS=0`).
        check_variable: called with the path and shape of each variable
            created with an initializer, before it is laid out or
            allocated; it may raise (e.g. `WeightCheck.created`).

    Yields:
        The `LoadStats` of the load, filled in as it goes.

    Example:
    ```python
    with distribution.scope(), sharded_loading() as stats:
        backbone = keras_hub.models.Backbone.from_preset("./gemma_2b")
    ```
    """
    bar = _Progress(total_weights, total_bytes, progress_enabled(progress))
    session = _Session(
        skip_initializers=load_weights, progress=bar, check_variable=check_variable
    )
    start = time.perf_counter()
    _sessions.append(session)
    try:
        with _hooks_installed():
            yield session.stats
        _initialize_pending(session)
    finally:
        _sessions.remove(session)
        session.close()
        session.stats.seconds = time.perf_counter() - start
    loaded = session.stats
    bar.update(loaded.weights_loaded, loaded.bytes_read + loaded.bytes_received, True)


def verify_layouts(model) -> None:
    """Raise `LayoutMismatchError` if a variable is not laid out as planned.

    Args:
        model: a model whose variables were created under a distribution.

    Example:
    ```python
    verify_layouts(lm)  # after from_preset(..., device_mesh=mesh)
    ```
    """
    wrong = []
    for variable in model.variables:
        layout = getattr(variable, "_layout", None)
        if layout is None:
            continue
        expected = _backend_sharding(layout)
        actual = getattr(variable.value, "sharding", None)
        ndim = len(variable.shape)
        if actual is None or not actual.is_equivalent_to(expected, ndim):
            wrong.append(f"{variable.path}: {actual} (planned {expected})")
    if wrong:
        raise LayoutMismatchError(
            f"{len(wrong)} variables are not laid out as planned; this is a "
            "keras_hub_autodist bug, please report it with the preset's "
            f"config.json. Received: {'; '.join(wrong[:5])}"
        )


def attach_load_stats(model, stats: LoadStats) -> None:
    """Remember `stats` on `model` for `load_stats(model)`."""
    object.__setattr__(model, _LOAD_STATS_ATTR, stats)


def load_stats(model) -> LoadStats | None:
    """What the sharded load of `model` did, or `None` if it had none.

    Args:
        model: a model returned by `from_preset(..., device_mesh=...)`.

    Example:
    ```python
    lm = keras_hub.models.GemmaCausalLM.from_preset(path, device_mesh=mesh)
    print(keras_hub_autodist.load_stats(lm).bytes_read)
    ```
    """
    return getattr(model, _LOAD_STATS_ATTR, None)


def per_device_bytes(arrays=None) -> dict:
    """Bytes held on each device by live arrays, each buffer counted once.

    `jax.live_arrays()` lists an assembled array and the per-device arrays it
    was built from; they share buffers, so they are counted by buffer.

    Example:
    >>> isinstance(per_device_bytes([]), dict)
    True
    """
    arrays = jax.live_arrays() if arrays is None else arrays
    seen, totals = set(), {}
    for array in arrays:
        try:
            shards = array.addressable_shards
        except Exception:  # deleted arrays
            continue
        for shard in shards:
            data = shard.data
            try:
                pointer = data.unsafe_buffer_pointer()
            except Exception:
                continue
            key = (shard.device, pointer)
            if key in seen:
                continue
            seen.add(key)
            totals[shard.device] = totals.get(shard.device, 0) + (
                math.prod(data.shape) * data.dtype.itemsize
            )
    return totals
