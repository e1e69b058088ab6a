"""Sharded loading: every weight goes straight into its shards.

Keras builds each variable whole on one device (random initial values), and
`Variable.assign` turns a loaded weight into a full array on the default
device before resharding it, so a model that fits once sharded can still run
out of memory while it loads (keras-team/keras#21634). Inside
`sharded_loading(...)`, while keras-hub's own loaders run:

- a laid-out variable gets a placeholder of its final shards instead of its
  random initial value (skipped work: the checkpoint overwrites it): zeros
  made on the devices, or on CPU untouched host pages the devices adopt
  without a copy. Any variable that loading does not overwrite gets its
  real initial value afterwards, computed sharded;
- a Keras preset's HDF5 dataset is handed to `assign` unread
  (`LazyH5Dataset`), and only the slices this process's devices hold are
  read, by file offset, from a pool of threads (`lazy_tensors.py`); no full
  array exists on any device and the host holds at most one weight's
  slices (two on an accelerator, where the next weight is read while the
  last one is transferred);
- a Hugging Face tensor that keras-hub's converter passes on unconverted
  (`port_weight` without a hook) is read slice by slice from the
  safetensors file the same way (`LazySafetensor`), and so is one whose
  hook only reshapes and transposes it (`HookView`: each slice is a box of
  the file's tensor, moved into place by the reading thread); a tensor
  another hook converts arrives whole on the host, is sliced there and
  each device receives only its part. Nothing is memory-mapped
  (`SafetensorsFile`);
- on accelerators, each slice crosses to its device in the file's dtype
  and is cast there when the model's dtype is wider (a bfloat16 checkpoint
  into a float32 model moves half the bytes), one weight at a time; on
  CPU, where the devices are the host, the reading threads cast as they
  read;
- each weight file is read through one descriptor held for the whole load,
  so a file replaced or deleted meanwhile still loads as the version first
  opened, and one modified in place raises `WeightFileChangedError`.

Outside the context, Keras behaves exactly as without this package. The hooks
are process-wide patches (`compat.PATCHES`), installed when the first load of
the process starts and removed when the last one ends, by an exception too;
each acts only in a thread running a load of its own, so loads in several
threads at once each load their own weights.

Example:
```python
with distribution.scope(), sharded_loading() as stats:
    model = keras_hub.models.GemmaCausalLM.from_preset("./gemma_2b")
print(stats.bytes_read, stats.weights_loaded, stats.read_seconds)
```
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import inspect
import os
import threading
import time
import weakref

import h5py
import jax
import keras
import ml_dtypes
import numpy as np

from keras_hub_autodist import compat
from keras_hub_autodist.errors import WeightFileChangedError
from keras_hub_autodist.loading import transfer
from keras_hub_autodist.loading.file_reads import HeldFile
from keras_hub_autodist.loading.file_reads import convert
from keras_hub_autodist.loading.file_reads import copy_slices
from keras_hub_autodist.loading.file_reads import read_threads
from keras_hub_autodist.loading.hook_views import apply_hook
from keras_hub_autodist.loading.hook_views import release_scratch
from keras_hub_autodist.loading.lazy_tensors import LAZY_TENSORS
from keras_hub_autodist.loading.lazy_tensors import LazyH5Dataset
from keras_hub_autodist.loading.lazy_tensors import LazySafetensor
from keras_hub_autodist.loading.lazy_tensors import SafetensorsFile
from keras_hub_autodist.loading.progress import Progress
from keras_hub_autodist.loading.progress import progress_enabled

__all__ = [
    "LazyH5Dataset",
    "LazySafetensor",
    "LoadStats",
    "SafetensorsFile",
    "attach_load_stats",
    "load_stats",
    "sharded_loading",
]

_LOAD_STATS_ATTR = "_keras_hub_autodist_load_stats"


@dataclasses.dataclass
class LoadStats:
    """What a sharded load did, and where its time went.

    Args:
        weights_loaded: variables that received a value from the checkpoint.
        bytes_read: bytes read slice by slice from weight files: HDF5
            datasets of Keras presets, and safetensors tensors that a Hugging
            Face converter passes on unconverted or only reshaped and
            transposed. With a mesh spread over several processes, only this
            process's slices.
        bytes_received: bytes of host tensors received whole from a
            converter (Hugging Face presets, weights its hooks compute),
            before slicing.
        initializers_skipped: random initial values never computed because
            the checkpoint overwrote them.
        initialized_after_load: variables the checkpoint did not cover, given
            their initial values (sharded) after loading.
        seconds: wall time of the load (`sharded_loading`'s context: the
            model's build and keras-hub's loader included).
        read_seconds: of `seconds`, the time the loading thread waited for
            weight files to be read (reads run on a pool of threads).
        transfer_seconds: of `seconds`, the time the loading thread spent
            handing slices to the devices, casting them there and waiting
            for the previous weight's transfer. A transfer that proceeds
            while the next weight is read is not counted.
        build_seconds: set by the caller: building the model, loading
            excluded (`seconds - read_seconds - transfer_seconds` is
            keras-hub's own work, building included). 0.0 when not set.
        plan_seconds: set by the caller: computing the layout plan before
            the load. 0.0 when not set.
        verify_seconds: set by the caller: checking the loaded model
            against its plan. 0.0 when not set.
    """

    weights_loaded: int = 0
    bytes_read: int = 0
    bytes_received: int = 0
    initializers_skipped: int = 0
    initialized_after_load: int = 0
    seconds: float = 0.0
    read_seconds: float = 0.0
    transfer_seconds: float = 0.0
    build_seconds: float = 0.0
    plan_seconds: float = 0.0
    verify_seconds: float = 0.0


class _SafetensorsModule:
    """The `safetensors` module keras-hub's loader sees during a load: its
    `safe_open` gives the session's `SafetensorsFile` in the loading thread,
    and the real `safe_open` anywhere else."""

    def __init__(self, module):
        self._module = module

    def safe_open(self, path, framework="np", **kwargs):
        session = _active_session()
        if session is None or kwargs:
            return self._module.safe_open(path, framework=framework, **kwargs)
        return session.safetensors_file(path, framework)

    def __getattr__(self, name):
        return getattr(self._module, name)


def _backend_sharding(layout):
    return getattr(layout, "backend_layout", layout)


class _Session:
    """The state of one sharded load (one thread, one `from_preset`)."""

    def __init__(
        self, *, skip_initializers: bool, progress: Progress, check_variable=None
    ):
        self.skip_initializers = skip_initializers
        self.check_variable = check_variable
        self.progress = progress
        self.stats = LoadStats()
        self.pending = {}  # id(variable) -> (weakref to variable, initializer)
        self.placeholders = set()  # ids of variables holding a placeholder
        self.files = {}  # path -> HeldFile, one per weight file for the load
        # id(variable) -> the error its last read raised, while not retried.
        self.failures = {}
        self._executor = None
        # The last weight put on the devices: its array, and the array in
        # the file's dtype it was cast from (freed once the cast is done).
        self._in_flight = None
        # True inside keras-hub's `port_weight`, until its hook runs:
        # safetensors reads give a `LazySafetensor`.
        self.lazy_safetensors = False
        # On CPU, the placeholders' host buffers, which their values are
        # read into.
        self.reserved_shards = transfer.ReservedShards()

    def executor(self) -> concurrent.futures.Executor:
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                read_threads(), thread_name_prefix="keras_hub_autodist_read"
            )
        return self._executor

    def held_h5_file(self, dataset) -> HeldFile | None:
        """The held descriptor of the file Keras opened `dataset` from, or
        `None` when it is not a plain file on disk."""
        h5_file = dataset.file
        if h5_file.driver != "sec2":
            return None
        fd = h5_file.id.get_vfd_handle()
        held = self.files.get(h5_file.filename)
        if held is None:
            held = HeldFile(h5_file.filename, fd=os.dup(fd))
            self.files[h5_file.filename] = held
        elif not held.same_file(fd):
            raise WeightFileChangedError(
                f"{h5_file.filename} was replaced while a model was loaded "
                "from it, and Keras reopened the new file: the loaded weights "
                "would mix two versions of it. Load again once the new file "
                f"is complete. Received: dataset {dataset.name}"
            )
        return held

    def safetensors_file(self, path, framework: str) -> SafetensorsFile:
        """keras-hub's view of safetensors file `path`: read from the
        descriptor held for the whole load, lazy inside `port_weight`."""
        key = os.path.abspath(os.fspath(path))
        held = self.files.get(key)
        if held is None:
            held = self.files[key] = HeldFile(key)
        file = SafetensorsFile(key, framework=framework, file=held)
        file.executor = self.executor()
        file.get_lazy = self._lazy_safetensor
        return file

    def _lazy_safetensor(self, file, name) -> LazySafetensor | None:
        if not self.lazy_safetensors or _active_session() is not self:
            return None
        lazy = LazySafetensor(file, name)
        return lazy if lazy.shape and 0 not in lazy.shape else None

    def close(self, check: bool = False) -> None:
        """Wait for the last transfer and close the files; with `check`,
        raise `WeightFileChangedError` if one changed during the load."""
        try:
            self._finish_transfer()
            if check:
                for file in self.files.values():
                    file.check_unchanged()
        finally:
            for file in self.files.values():
                file.close()
            self.files.clear()
            self.reserved_shards.close()
            # The reading threads' buffers go with them, at shutdown.
            release_scratch()
            if self._executor is not None:
                self._executor.shutdown(wait=True, cancel_futures=True)
                self._executor = None

    def _finish_transfer(self) -> None:
        if self._in_flight is None:
            return
        array, stored = self._in_flight
        self._in_flight = None
        array.block_until_ready()
        if stored is not None:
            stored.delete()

    def put(self, source, variable) -> jax.Array:
        """Build `variable`'s sharded value from `source`, slice by slice."""
        sharding = _backend_sharding(compat.variable_layout(variable))
        wanted = transfer.numpy_dtype(compat.variable_dtype(variable))
        shape = tuple(variable.shape)
        indices = sharding.addressable_devices_indices_map(shape)
        keys = [transfer.slice_bounds(index, shape) for index in indices.values()]
        unique, first = {}, {}  # slice key -> index, its first device's position
        for position, (key, index) in enumerate(zip(keys, indices.values())):
            unique.setdefault(key, index)
            first.setdefault(key, position)
        stored = np.dtype(source.dtype)
        on_device = transfer.casts_on_device(stored, wanted, sharding)
        moved = stored if on_device else wanted
        on_cpu = transfer.on_cpu(sharding)
        # On CPU: the buffers of its deleted placeholder.
        buffers = (
            self.reserved_shards.take(id(variable), shape, moved, sharding)
            if on_cpu
            else None
        )
        outputs = None if buffers is None else [buffers[p] for p in first.values()]

        start = time.perf_counter()
        wanted_indices = list(unique.values())
        if isinstance(source, LAZY_TENSORS):
            # Cast by the reading threads, when the devices don't.
            values = source.read_slices(
                wanted_indices, self.executor(), dtype=moved, outputs=outputs
            )
            self.stats.bytes_read += sum(v.size * stored.itemsize for v in values)
        elif outputs is not None:
            values = copy_slices(source, wanted_indices, outputs, self.executor())
        else:
            values = [np.asarray(source[index]) for index in wanted_indices]
            values = [v.astype(moved, copy=False) for v in values]
        slices = dict(zip(unique, values))
        del values
        read = time.perf_counter()
        self.stats.read_seconds += read - start

        # The next weight was read while this one crossed to the devices.
        self._finish_transfer()
        arrays = []
        for position, key in enumerate(keys):
            values = slices[key]
            if on_cpu and position != first[key]:
                # The CPU backend adopts an aligned buffer as device memory:
                # each device gets a buffer of its own.
                if buffers is None:
                    values = transfer.aligned_copy(values)
                else:
                    convert(values, buffers[position])
                    values = buffers[position]
            arrays.append(values)
        slices.clear()
        array = transfer.to_devices(shape, sharding, arrays)
        del arrays
        if on_device:
            cast = transfer.device_cast(wanted.name, sharding)(array)
            self._in_flight = (cast, array)
            array = cast
        else:
            self._in_flight = (array, None)
        if on_cpu:
            self._finish_transfer()
        self.stats.transfer_seconds += time.perf_counter() - read
        return array

    def count(self, variable) -> None:
        self.stats.weights_loaded += 1
        self.progress.update(
            self.stats.weights_loaded,
            self.stats.bytes_read + self.stats.bytes_received,
        )


# The loads running in each thread, innermost last.
_threads = threading.local()


def _thread_sessions() -> list[_Session]:
    sessions = getattr(_threads, "sessions", None)
    if sessions is None:
        sessions = _threads.sessions = []
    return sessions


def _active_session() -> _Session | None:
    """The innermost load running in this thread, if any."""
    sessions = _thread_sessions()
    return sessions[-1] if sessions else None


def active_sessions() -> int:
    """How many sharded loads run in this thread (0 outside any).

    Example:
    >>> active_sessions()
    0
    """
    return len(_thread_sessions())


# The hooks replace methods of the class Keras instantiates (`keras.Variable`,
# the JAX backend's variable) and of Keras' HDF5 weight store, and keras-hub's
# safetensors entry points, while any load runs (`compat.PATCHES`). Every
# thread sees them; they act only in a thread with a load of its own.
_VARIABLE = keras.Variable
_original_assign = _VARIABLE.assign
_original_initialize = getattr(_VARIABLE, compat.VARIABLE_INITIALIZE_METHOD)
_original_getitem = compat.h5_io_store().__getitem__


def _assign(variable, value):
    session = _active_session()
    layout = compat.variable_layout(variable)
    if session is None or layout is None:
        return _original_assign(variable, _whole(value))
    if not isinstance(value, (*LAZY_TENSORS, np.ndarray, np.generic)):
        return _original_assign(variable, value)
    if tuple(value.shape) != tuple(variable.shape):
        # Keras' own message and error type for a shape mismatch.
        return _original_assign(variable, np.asarray(value))
    if isinstance(value, np.ndarray):
        session.stats.bytes_received += value.nbytes
    if id(variable) in session.placeholders:
        # The placeholder's shards are freed before the real ones arrive.
        session.placeholders.discard(id(variable))
        compat.variable_array(variable).delete()
        compat.set_variable_array(variable, None)
    try:
        array = session.put(value, variable)
    except Exception as error:
        # Keras catches it and may retry the layer; if the load fails, it is
        # reported instead of Keras' "objects could not be loaded".
        session.failures[id(variable)] = error
        raise
    session.failures.pop(id(variable), None)
    compat.set_variable_array(variable, array)
    transfer.release_host_memory()
    session.pending.pop(id(variable), None)
    session.count(variable)
    return compat.variable_array(variable)


def _whole(value):
    """`value`, read whole if it is a lazy tensor."""
    return np.asarray(value) if isinstance(value, LAZY_TENSORS) else value


def _port_weight_hook(original):
    """keras-hub's `SafetensorLoader.port_weight`, handing `assign` a lazy
    tensor (`LazySafetensor`, or `HookView` through its hook)."""
    signature = inspect.signature(original)

    def port_weight(loader, *args, **kwargs):
        session = _active_session()
        try:
            bound = signature.bind(loader, *args, **kwargs)
        except TypeError:
            session = None  # keras-hub raises its own error below
        if session is None or session.lazy_safetensors:
            return original(loader, *args, **kwargs)
        hook_fn = bound.arguments.get("hook_fn")
        if hook_fn is not None:
            bound.arguments["hook_fn"] = _lazy_hook(hook_fn, session)
        session.lazy_safetensors = True
        try:
            return original(*bound.args, **bound.kwargs)
        finally:
            session.lazy_safetensors = False

    return port_weight


def _lazy_hook(hook_fn, session: _Session):
    """`hook_fn`, through `hook_views.apply_hook` (lazy where it can be)."""

    def hook(tensor, keras_shape):
        session.lazy_safetensors = False  # what the hook reads, it reads whole
        return apply_hook(hook_fn, tensor, keras_shape)

    return hook


def _initialize_with_initializer(variable, initializer):
    session = _active_session()
    if session is not None and session.check_variable is not None:
        # Before Keras lays the variable out: a wrong shape is reported
        # here rather than as JAX's error for an indivisible dimension.
        session.check_variable(variable.path, compat.variable_declared_shape(variable))
    if session is None or not session.skip_initializers:
        return _original_initialize(variable, initializer)
    compat.initialize_variable_layout(variable)
    layout = compat.variable_layout(variable)
    if layout is None:
        return _original_initialize(variable, initializer)
    placeholder = session.reserved_shards.placeholder(
        id(variable),
        compat.variable_declared_shape(variable),
        compat.variable_dtype(variable),
        _backend_sharding(layout),
    )
    compat.set_variable_array(variable, placeholder)
    session.placeholders.add(id(variable))
    session.stats.initializers_skipped += 1
    session.pending[id(variable)] = (weakref.ref(variable), initializer)


def _getitem(store, key):
    session = _active_session()
    if session is None or compat.h5_store_archive(store) is not None:
        return _original_getitem(store, key)
    dataset = compat.h5_dataset(store, key)
    if not isinstance(dataset, h5py.Dataset):
        return _original_getitem(store, key)
    if dataset.attrs.get("dtype") == "bfloat16":
        dtype = ml_dtypes.bfloat16
    else:
        dtype = dataset.dtype
    return LazyH5Dataset(dataset, dtype, session.held_h5_file(dataset))


# Patch name -> its replacement, made from the attribute it replaces.
_HOOKS = {
    "variable_assign": lambda original: _assign,
    "variable_initializer": lambda original: _initialize_with_initializer,
    "h5_store_read": lambda original: _getitem,
    "safetensors_open": _SafetensorsModule,
    "safetensors_port_weight": _port_weight_hook,
}


def _initialize_pending(session: _Session) -> None:
    """Give variables the checkpoint did not cover their real initial value."""
    session.reserved_shards.close()  # their values are made by Keras
    for reference, initializer in list(session.pending.values()):
        variable = reference()
        if variable is None:
            continue
        if id(variable) in session.placeholders:
            compat.variable_array(variable).delete()
            compat.set_variable_array(variable, None)
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

    Raises:
        WeightFileChangedError: a weight file was modified in place during
            the load (one replaced or deleted still loads, as the version
            first opened).

    Example:
    ```python
    with distribution.scope(), sharded_loading() as stats:
        backbone = keras_hub.models.Backbone.from_preset("./gemma_2b")
    ```
    """
    bar = Progress(total_weights, total_bytes, progress_enabled(progress))
    session = _Session(
        skip_initializers=load_weights, progress=bar, check_variable=check_variable
    )
    start = time.perf_counter()
    sessions = _thread_sessions()
    sessions.append(session)
    completed = False
    try:
        with compat.patched(_HOOKS):
            try:
                yield session.stats
            except Exception:
                if session.failures:
                    raise next(iter(session.failures.values())) from None
                raise
        _initialize_pending(session)
        completed = True
    finally:
        sessions.remove(session)
        try:
            session.close(check=completed)
        finally:
            session.stats.seconds = time.perf_counter() - start
    loaded = session.stats
    bar.update(loaded.weights_loaded, loaded.bytes_read + loaded.bytes_received, True)


def attach_load_stats(model, stats: LoadStats) -> None:
    """Remember `stats` on `model` for `load_stats(model)`."""
    object.__setattr__(model, _LOAD_STATS_ATTR, stats)


def load_stats(model: keras.Model) -> LoadStats | None:
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
