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
"""

from __future__ import annotations

import jax
import keras
import numpy as np

from keras_hub_autodist import compat


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
