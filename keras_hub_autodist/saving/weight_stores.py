"""Keras' HDF5 weight writers, made to write what a save of this package
needs: the values a save from several processes gathers, and datasets of
its own at the root of each file.

Keras' `save_weights`, `save` and keras-hub's `save_to_preset` create their
weight stores by the module-level names `saving_lib.H5IOStore` and
`saving_lib.ShardedH5IOStore`, and optimizers hand the store each value
fetched to NumPy (`BaseOptimizer.save_own_variables`), which fails for an
array spanning other processes. Inside `weight_stores_writing(...)` those
three are replaced, and inside `root_datasets_written(...)` the two stores
(`compat.PATCHES`: `h5_store_class`, `sharded_h5_store_class`,
`optimizer_save_variables`); both install the same store subclasses, so the
two scopes nest. The replacements are process-wide but act only for the
thread (or task) inside the context: anywhere else they are Keras' own, so
a save running in another thread at the same time writes as Keras writes.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable
from typing import Any

from keras_hub_autodist import compat


@dataclasses.dataclass(frozen=True)
class _Writing:
    """What the stores created in one context do with each value."""

    convert: Callable[[Any], Any]
    opened: Callable[[Callable[[], Any]], None]
    write: bool


# The writing context of this thread or task, if any.
_WRITING = contextvars.ContextVar("keras_hub_autodist_weight_stores", default=None)
# The datasets (name -> text) each HDF5 file opened for writing in this thread
# or task gets at its root, if any.
_ROOT_DATASETS = contextvars.ContextVar(
    "keras_hub_autodist_root_datasets", default=None
)


def _add_root_datasets(h5_file) -> None:
    for name, text in (_ROOT_DATASETS.get() or {}).items():
        if name not in h5_file:
            h5_file.create_dataset(name, data=text)


def _scoped_store(base):
    """A subclass of Keras' weight store `base` that, created inside
    `weight_stores_writing`, writes `convert(value)` (or, with
    `write=False`, opens no file and only calls `convert`), and, created for
    writing inside `root_datasets_written`, adds its datasets to its file
    (the first shard of a sharded store)."""

    class ScopedStore(base):
        def __init__(self, path_or_io, *args, mode="r", **kwargs):
            self._writing = _WRITING.get()

            def open_file():
                base.__init__(self, path_or_io, *args, mode=mode, **kwargs)
                if mode == "w":
                    _add_root_datasets(self.h5_file)

            if self._writing is None:
                open_file()
            elif self._writing.write:
                self._writing.opened(open_file)
            else:
                self.path_or_io = path_or_io
                self.mode = mode
                self.archive = None
                self.io_file = None
                self._writing.opened(lambda: None)

        def _discards(self):
            return self._writing is not None and not self._writing.write

        def __bool__(self):
            return True

        def make(self, path, metadata=None):
            if self._discards():
                return self
            return base.make(self, path, metadata)

        def __setitem__(self, key, value):
            if self._writing is None:
                base.__setitem__(self, key, value)
            elif self._writing.write:
                base.__setitem__(self, key, self._writing.convert(value))
            else:
                self._writing.convert(value)

        def close(self):
            if not self._discards():
                base.close(self)

    ScopedStore.__name__ = ScopedStore.__qualname__ = base.__name__
    return ScopedStore


def _saving_variables(original):
    """`BaseOptimizer.save_own_variables` that, inside
    `weight_stores_writing`, hands the store each variable instead of its
    NumPy value, as layers do."""

    def save_own_variables(optimizer, store):
        if _WRITING.get() is None:
            return original(optimizer, store)
        for index, variable in enumerate(optimizer.variables):
            store[str(index)] = variable

    return save_own_variables


_STORES = {"h5_store_class": _scoped_store, "sharded_h5_store_class": _scoped_store}
_REPLACEMENTS = {**_STORES, "optimizer_save_variables": _saving_variables}


@contextlib.contextmanager
def weight_stores_writing(convert, opened, write: bool = True):
    """A scope where Keras' HDF5 weight writers pass each value through
    `convert`, in this thread (or task) only.

    With `write=True`, each store writes `convert(value)` (a NumPy array, or
    the value for Keras to convert as usual). With `write=False`, each store
    opens no file and writes nothing: it calls `convert(value)` for every
    value Keras would write, in the same order, and drops the result.
    `opened(open_file)` is called when a store is created, with a function
    that opens its file.

    Example:
    ```python
    with weight_stores_writing(np.asarray, lambda open_file: open_file()):
        model.save_weights("model.weights.h5")
    ```
    """
    token = _WRITING.set(_Writing(convert, opened, write))
    try:
        with compat.patched(_REPLACEMENTS):
            yield
    finally:
        _WRITING.reset(token)


@contextlib.contextmanager
def root_datasets_written(datasets: dict[str, str]):
    """A scope where each HDF5 weights file Keras opens for writing in this
    thread (or task) gets a dataset at its root for each `name -> text` of
    `datasets`: a `.weights.h5`, the first shard of a `.weights.json`, the
    `model.weights.h5` inside a `.keras`. Keras' loaders read only the groups
    they know, so they ignore them. Scopes nest; the innermost's datasets
    are written.

    Example:
    ```python
    with root_datasets_written({"notes": "{}"}):
        model.save_weights("model.weights.h5")
    ```
    """
    token = _ROOT_DATASETS.set(dict(datasets))
    try:
        with compat.patched(_STORES):
            yield
    finally:
        _ROOT_DATASETS.reset(token)
