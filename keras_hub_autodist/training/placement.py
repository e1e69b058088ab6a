"""Every variable of a bound model lives on its mesh, optimizer and metrics too.

Keras compiles a training step whose state shardings are those of the
variables when the step is made. Two kinds of variables fall off the mesh:

- Variables created outside the model's distribution (an optimizer built
  before `compile`: its `iteration` and `learning_rate`) have no layout, so
  every later `assign` (a `load_weights`, a restore) puts their value back on
  one device, and the next step fails with "incompatible devices".
- On a mesh of one device, Keras skips moving a value whose single-device
  sharding is equivalent to the mesh's, so freshly built optimizer slots and
  metrics keep a `SingleDeviceSharding` beside mesh-aware weights, and Keras
  warns about "a mix of local and distributed variables".

`place_state` gives each such variable a lasting layout (replicated over the
mesh when it had none) and a mesh-aware value.

The same skip recurs on every `assign` between steps: Keras resets the
metrics before each epoch of `fit` or `evaluate` and before each
`*_on_batch` call, so their first step gets single-device values, while the
next step gets the mesh-aware values the first returned. The step's cache
keys differ, so a one-device mesh traced and compiled the step twice in the
first epoch of at least two batches. While a bound model's method runs,
`keeping_values_on_mesh` makes such an `assign` hold the same buffer as an
array of the variable's own sharding.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator

import jax
import keras
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import SingleDeviceSharding

from keras_hub_autodist import compat

# Whether this thread runs a bound model's method on a one-device mesh.
_KEEPING = contextvars.ContextVar("keras_hub_autodist_keeping_mesh", default=False)


def state_variables(model) -> list:
    """The model's, its optimizer's and its metrics' variables, in that order."""
    found = list(model.variables)
    optimizer = getattr(model, "optimizer", None)
    if isinstance(optimizer, keras.optimizers.Optimizer):
        found += list(optimizer.variables)
    found += list(getattr(model, "metrics_variables", []))
    return found


def place_variable(variable, distribution) -> None:
    """Give `variable` a lasting layout on the distribution's mesh and move
    its value there, unless it is already laid out so.

    A variable without a layout is replicated over the mesh.

    Args:
        variable: a Keras variable.
        distribution: the model's `keras.distribution.Distribution`.

    Example:
    ```python
    optimizer = keras.optimizers.Adam()
    place_variable(optimizer.iterations, distribution)
    ```
    """
    layout = compat.variable_layout(variable)
    if layout is None:
        layout = keras.distribution.TensorLayout(
            [None] * len(variable.shape), distribution.device_mesh
        )
        compat.set_variable_layout(variable, layout)
    value = compat.variable_value_or_none(variable)
    if value is None:
        return  # held by a running `fit`; its step keeps the layout
    target = layout.backend_layout
    sharding = getattr(value, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding) and (
        sharding.is_equivalent_to(target, len(variable.shape))
    ):
        return
    if not target.is_fully_addressable and not isinstance(value, np.ndarray):
        # Every process holds the same local value: place it from the host.
        value = np.asarray(value)
    variable.assign(jax.device_put(value, target))


def place_state(model, distribution) -> None:
    """Place every variable of `model`, its optimizer and its metrics on the
    distribution's mesh (see the module docstring).

    Args:
        model: a Keras model.
        distribution: the `keras.distribution.Distribution` it is bound to.

    Example:
    ```python
    distribution, _ = keras_hub_autodist.distribution_of(lm)
    place_state(lm, distribution)
    ```
    """
    for variable in state_variables(model):
        place_variable(variable, distribution)


def build_optimizer(model) -> None:
    """Build a compiled model's optimizer (its slots), if not built yet.

    Run inside the model's distribution, each slot takes its weight's layout.
    """
    optimizer = getattr(model, "optimizer", None)
    if isinstance(optimizer, keras.optimizers.Optimizer) and not optimizer.built:
        optimizer.build(model.trainable_variables)


def on_mesh(value, sharding):
    """`value` as an array of `sharding` where `value` is one device's
    array equivalent to it (a mesh of that one device), holding the same
    buffer; else `value` itself.

    Args:
        value: an array, or anything else (returned as it is).
        sharding: a `jax.sharding.Sharding`, or a Keras `TensorLayout`.

    Example:
    >>> import jax, jax.numpy as jnp, numpy as np
    >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("batch",))
    >>> sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    >>> type(on_mesh(jnp.zeros(()), sharding).sharding).__name__
    'NamedSharding'
    """
    sharding = getattr(sharding, "backend_layout", sharding)
    if not (
        isinstance(sharding, NamedSharding)
        and sharding.mesh.size == 1
        and isinstance(value, jax.Array)
        and not isinstance(value, jax.core.Tracer)
        and isinstance(value.sharding, SingleDeviceSharding)
        and value.sharding.is_equivalent_to(sharding, value.ndim)
    ):
        return value
    return jax.make_array_from_single_device_arrays(value.shape, sharding, [value])


def _keeping_on_mesh(distribute):
    @functools.wraps(distribute)
    def call(tensor, layout, *args, **kwargs):
        value = distribute(tensor, layout, *args, **kwargs)
        return on_mesh(value, layout) if _KEEPING.get() else value

    return call


@contextlib.contextmanager
def keeping_values_on_mesh(distribution, method: str) -> Iterator[None]:
    """For the block's duration in this thread, on a one-device mesh, every
    value Keras lays out for a variable (`assign`) stays an array of the
    variable's sharding (`on_mesh`), as the values a step returns are.

    Nothing changes on a larger mesh, nor for a `*_on_batch` call: Keras
    resets the metrics before each such call's only step, so that step is
    always called with the values of a reset, and keeping them costs host
    time on every call.

    Args:
        distribution: the bound model's `keras.distribution.Distribution`.
        method: the bound method running (`"fit"`, `"train_on_batch"`, ...).
    """
    mesh_size = distribution.device_mesh.backend_mesh.size
    if mesh_size != 1 or method.endswith("_on_batch"):
        yield
        return
    token = _KEEPING.set(True)
    try:
        with compat.patched({"values_kept_on_mesh": _keeping_on_mesh}):
            yield
    finally:
        _KEEPING.reset(token)
