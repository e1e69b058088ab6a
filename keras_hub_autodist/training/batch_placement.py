"""A drawn batch placed on the mesh, as Keras' `distribute_data_input`
places it, with less host time per step.

- In one process a batch is the whole batch, and
  `jax.make_array_from_process_local_data` places it with `jax.device_put`
  after working out each process's share; here it goes to `jax.device_put`
  directly.
- Keras lays out each array on a sharding of its own making; placed on
  the first equal one seen, it is placed in less time.
- `train_on_batch` and `test_on_batch` place their batch twice, once to
  build the model and once for the step: inside one such call
  (`placing_each_array_once`), the second placement of an array returns the
  first's. Within that call no code of the caller's runs between the two, so
  the array can't have changed.

Both run on the host before the step is dispatched, where each
microsecond adds to a `train_on_batch` step.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable
from collections.abc import Iterator

import jax
import numpy as np

# The arrays this thread's `*_on_batch` call placed: (id, sharding) ->
# (the array, kept so that its id stays its own, and what it was placed as).
_PLACED = contextvars.ContextVar("keras_hub_autodist_placed_arrays", default=None)


def place(per_process_batch, layout, distribute: Callable):
    """`per_process_batch` (one array of a drawn batch) placed as `layout`
    says, as `distribute` (Keras' `distribute_data_input`) would place it.

    Args:
        per_process_batch: this process's rows of one array of the batch.
        layout: a Keras `TensorLayout` or a `jax.sharding.Sharding`.
        distribute: Keras' own placement, for what isn't placed here (a
            batch of several processes, or of another type than an array).
    """
    if per_process_batch is None:
        return None  # an absent part of the batch (no sample weights)
    sharding = getattr(layout, "backend_layout", layout)
    if isinstance(sharding, jax.sharding.Sharding):
        sharding = _first_equal(sharding)
    placed = _PLACED.get()
    key = (id(per_process_batch), sharding)
    if placed is not None and key in placed:
        return placed[key][1]
    if jax.process_count() == 1 and isinstance(
        per_process_batch, np.ndarray | jax.Array
    ):
        value = jax.device_put(per_process_batch, sharding)
    else:
        value = distribute(per_process_batch, layout)
    if placed is not None:
        placed[key] = (per_process_batch, value)
    return value


@functools.lru_cache(maxsize=256)
def _first_equal(sharding):
    """The first sharding seen equal to `sharding`: Keras makes a new one for
    each array, and JAX places an array faster on a sharding it has seen."""
    return sharding


@contextlib.contextmanager
def placing_each_array_once() -> Iterator[None]:
    """Within the block, in this thread, an array placed again on the same
    sharding is the first placement's (see the module docstring): for one
    `train_on_batch` or `test_on_batch` call, never for a loop that draws
    its batches (a generator may refill one array in place)."""
    token = _PLACED.set({})
    try:
        yield
    finally:
        _PLACED.reset(token)
