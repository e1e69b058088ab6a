"""Save a model whose arrays span several processes: one writes, all gather.

With several JAX processes (`keras.distribution.initialize(...)`), each
process holds only its own shards of a sharded array, and Keras' HDF5 writer
(`save_weights`, `save`, keras-hub's `save_to_preset`) fails to fetch the
others. A bound model's save methods run here instead, in every process:

- Every process runs the same save, so Keras walks the same variables in the
  same order in each of them. Each value Keras would write is gathered by a
  collective that all processes take part in (`host_array`): one array at a
  time, replicated for the moment it is written, then dropped. A whole model
  is never gathered on one host.
- Process 0 writes the files, at the path it was given (a preset folder is
  still swapped in whole, as `saving.save_atomically` does).
- The other processes write no weights anywhere: their weight stores open no
  file (`weight_stores.weight_stores_writing(write=False)`). What Keras and
  keras-hub write besides the weights (configs, tokenizer assets, the
  `.keras` archive's config) goes into a temporary folder, deleted at once.
- Before each weight file is opened and at the end, the processes agree that
  all of them are still saving: a process that failed before the first
  weight file was opened (a path process 0 can't write, say) makes the
  others raise `MultiprocessSaveError` instead of waiting for it. The
  agreement at the end is the barrier: no process returns before the files
  are complete.

A process that fails once weights are being gathered can't tell the others:
they wait in the next collective until JAX's coordination service ends the
job (when the failed process exits).
"""

from __future__ import annotations

import contextvars
import functools
import os
import tempfile
from collections.abc import Callable
from typing import Any

import jax
import keras
import numpy as np
from jax.experimental import multihost_utils

from keras_hub_autodist.errors import MultiprocessSaveError
from keras_hub_autodist.errors import SaveTargetError
from keras_hub_autodist.saving import save_atomically
from keras_hub_autodist.weight_stores import weight_stores_writing

# The process that writes the files.
WRITER = 0
# The save running in this thread or task, if any: a save inside a save (a
# Task saving its backbone) runs inside the outer save's stores.
_RUNNING = contextvars.ContextVar("keras_hub_autodist_gathered_save", default=None)


def several_processes() -> bool:
    """Whether this JAX job runs in more than one process.

    Example:
    >>> several_processes()
    False
    """
    return jax.process_count() > 1


def _writes_here() -> bool:
    return jax.process_index() == WRITER


def _identity(x):
    return x


def host_array(value, keep: bool = True):
    """`value` gathered whole onto this host, one collective for one array.

    When `value` (a `keras.Variable` or `jax.Array`) spans devices of other
    processes, every process must call this for the same arrays in the same
    order. The array is copied to a replicated layout on the same devices,
    read on this host, and the replicated copy dropped.

    Args:
        value: what Keras would write: a variable, an array or a number.
        keep: False on a process that takes part but writes nothing: the
            gather completes and nothing is copied to the host.

    Returns:
        A NumPy array when `value` spans other processes (None when `keep`
        is False); otherwise `value` itself, for Keras to convert as usual.

    Example:
    ```python
    kernel = host_array(lm.backbone.token_embedding.embeddings)
    ```
    """
    array = value.value if isinstance(value, keras.Variable) else value
    if not isinstance(array, jax.Array) or array.is_fully_addressable:
        return value
    sharding = array.sharding
    if not isinstance(sharding, jax.sharding.NamedSharding):
        gathered = multihost_utils.process_allgather(array, tiled=True)
        return gathered if keep else None
    replicated = sharding.update(spec=jax.sharding.PartitionSpec())
    whole = jax.jit(_identity, out_shardings=replicated)(array)
    if not keep:
        # Wait, so that at most one gathered array exists at any time.
        whole.block_until_ready()
        return None
    return np.asarray(whole.addressable_data(0))


class _Agreement:
    """The points where all processes confirm they are still saving."""

    def __init__(self):
        # A weight file was opened: gathers may be under way, and a failing
        # process can no longer meet the others at an agreement.
        self.gathering = False
        self.settled = False  # the processes already agreed that one failed

    def confirm(self, ok: bool) -> None:
        """Tell the others whether this process is still saving; raise
        `MultiprocessSaveError` when another one is not."""
        flags = multihost_utils.process_allgather(np.array(ok, dtype=np.int32))
        failed = [index for index, flag in enumerate(np.ravel(flags)) if not flag]
        if failed:
            self.settled = True
        if failed and ok:
            raise MultiprocessSaveError(
                f"Process(es) {failed} of {jax.process_count()} failed while "
                "saving, so this process stopped too; nothing was written "
                "by it. The error is in the log of the process(es) that "
                f"failed. Received: process {jax.process_index()} ready to "
                "save"
            )

    def opened(self, open_file: Callable[[], Any]) -> None:
        """Open a weight file (process 0) once every process is ready."""
        try:
            open_file()
        except BaseException:
            self.confirm(False)
            raise
        self.confirm(True)
        self.gathering = True


def _stand_in(target: str, scratch: str, folder: bool) -> str:
    """Where a process that writes nothing sends its save."""
    if folder:
        return scratch
    return os.path.join(scratch, os.path.basename(target.rstrip("/")))


def save_from_every_process(
    save: Callable[..., Any],
    target: str | os.PathLike,
    *args,
    whole_folder: bool = False,
    **kwargs,
) -> Any:
    """Run `save(target, *args, **kwargs)` in every process; process 0 writes.

    Every process calls this at the same point, with the same arguments (the
    SPMD convention of multi-process JAX). See the module docstring for who
    writes what.

    Args:
        save: a save method of a model: Keras' `save_weights` or `save`, or
            keras-hub's `save_to_preset` (a bound model's own, which calls
            this).
        target: the path it saves to; one shared path for all processes.
        *args: passed to `save` after the path.
        whole_folder: whether `target` is a preset folder (`save_to_preset`):
            then process 0 swaps it in whole (`saving.save_atomically`).
        **kwargs: passed to `save`.

    Returns:
        What `save` returned in this process.

    Example:
    ```python
    # In each of 2 processes, with `model`'s variables on a mesh over both:
    save_from_every_process(model.save_weights, "./model.weights.h5")
    ```
    """
    if _RUNNING.get() is not None:
        return save(target, *args, **kwargs)
    path = os.fspath(target)
    if path.startswith("hf://"):
        raise SaveTargetError(
            "Saving from several processes writes to a local or remote file "
            "path, not to the Hugging Face Hub: save to a local path, then "
            f"upload it from one process. Received: {path!r}"
        )
    writer = _writes_here()
    agreement = _Agreement()
    running = _RUNNING.set(agreement)
    try:
        with weight_stores_writing(
            functools.partial(host_array, keep=writer), agreement.opened, writer
        ):
            if writer and whole_folder:
                result = save_atomically(save, target, *args, **kwargs)
            elif writer:
                result = save(target, *args, **kwargs)
            else:
                with tempfile.TemporaryDirectory(prefix="autodist-save-") as scratch:
                    result = save(
                        _stand_in(path, scratch, whole_folder), *args, **kwargs
                    )
    except BaseException:
        if not (agreement.gathering or agreement.settled):
            agreement.confirm(False)
        raise
    finally:
        _RUNNING.reset(running)
    agreement.confirm(True)
    return result
