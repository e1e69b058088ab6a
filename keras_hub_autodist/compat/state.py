"""Private Keras touchpoints for the state a traced call carries (its
stateless scope).

As for the rest of this package, nothing else reaches into `keras.src` for
these: `TOUCHPOINTS` lists them, and `compat.check_touchpoints` checks
them with the package's others.

The need that has no public API:

- A wrapped optimizer (`LossScaleOptimizer`) keeps its inner optimizer as
  an attribute, which Keras' weights files store under that attribute's
  name: `optimizer_children` finds them by Keras' own walk.
- A rematerialized block threads its seed generators' state through the
  recomputed call. Inside Keras' own stateless scope (every traced step of
  its JAX trainer), a variable's assignment is that scope's update; outside
  one, the block opens its own, so that no traced value lands in a
  variable.
"""

from __future__ import annotations

import contextlib

# (module, attribute) pairs this module relies on.
TOUCHPOINTS = (
    ("keras.src.backend.common.stateless_scope", "in_stateless_scope"),
    ("keras.src.saving.saving_lib", "_walk_saveable"),
)


def in_stateless_scope() -> bool:
    """Whether a `keras.StatelessScope` is active (Keras' traced steps).

    Example:
    >>> in_stateless_scope()
    False
    """
    from keras.src.backend.common import stateless_scope

    return bool(stateless_scope.in_stateless_scope())


@contextlib.contextmanager
def stateless_state(variables):
    """Within it, assigning one of `variables` updates a stateless scope,
    never the variable: Keras' own scope when one is active, else one opened
    here, whose final values are assigned to the variables on a clean exit.
    Yields the variables' current values.

    Example:
    ```python
    with stateless_state(layer_seed_states) as values:
        ...  # variable.assign(new_value) records new_value in the scope
    ```
    """
    import keras

    variables = list(variables)
    if not variables or in_stateless_scope():
        yield [variable.value for variable in variables]
        return
    current = [variable.value for variable in variables]
    with keras.StatelessScope(state_mapping=list(zip(variables, current))) as scope:
        yield current
    for variable in variables:
        variable.assign(scope.get_current_value(variable))


def optimizer_children(optimizer) -> list[tuple[str, object]]:
    """The optimizers `optimizer` keeps as attributes (a
    `LossScaleOptimizer`'s `inner_optimizer`), with those attributes' names,
    as Keras' weights-file writer walks them (`saving_lib._walk_saveable`).

    Example:
    ```python
    optimizer_children(lm.optimizer)  # [('inner_optimizer', <Adam ...>)]
    ```
    """
    import keras
    from keras.src.saving import saving_lib

    return [
        (name, child)
        for name, child in saving_lib._walk_saveable(optimizer)
        if isinstance(child, keras.optimizers.Optimizer) and child is not optimizer
    ]


def global_seed_generator_or_none():
    """Keras' global `keras.random.SeedGenerator` (a process-wide attribute
    that `keras.random` functions given no seed draw from), or None while
    nothing has drawn from it (reading it does not create one: creating one
    draws its seed from Python's `random`)."""
    from keras.src.backend.common import global_state
    from keras.src.random import seed_generator

    return global_state.get_global_attribute(seed_generator.GLOBAL_SEED_GENERATOR)


def set_global_seed_generator(generator) -> None:
    """Make `generator` Keras' global `keras.random.SeedGenerator`."""
    from keras.src.backend.common import global_state
    from keras.src.random import seed_generator

    global_state.set_global_attribute(seed_generator.GLOBAL_SEED_GENERATOR, generator)
