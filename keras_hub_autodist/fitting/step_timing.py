"""A compiled training step timed on the devices it was compiled for, when
they are this machine's: what the layout search ranks a step by where the
device is attached (`searching.step_cost.compiled_cost`), instead of a
model of it.

The step runs on zero-filled weights, optimizer state and tokens of the
compiled shapes and shardings: a step's time doesn't depend on the values
(an XLA program's shapes and work are fixed when it is compiled), and
zeros are finite everywhere (a norm of zeros is zero, the loss is that of
uniform logits). One untimed run first (the program is loaded, its buffers
allocated); then the median of the timed runs, each to the last output
ready, the state one returns fed to the next, as `fit` does.
"""

from __future__ import annotations

import statistics
import time

# Timed runs of a step, after one untimed run.
TIMED_STEPS = 5


def zero_filled(specs):
    """Arrays of zeros of the shapes, dtypes and shardings of `specs` (a
    tree of `jax.ShapeDtypeStruct`s), made on their devices in one program.

    Example:
    ```python
    zero_filled(jax.ShapeDtypeStruct((8, 128), "int32", sharding=sharding))
    ```
    """
    import jax
    import jax.numpy as jnp

    shardings = jax.tree.map(lambda spec: spec.sharding, specs)
    return jax.jit(
        lambda: jax.tree.map(lambda spec: jnp.zeros(spec.shape, spec.dtype), specs),
        out_shardings=shardings,
    )()


def timed_step_seconds(compiled, state, data, steps: int = TIMED_STEPS) -> float:
    """The median seconds of `steps` runs of a compiled training step.

    Args:
        compiled: `(state, data) -> (logs, state)`, compiled with its state
            donated (`model.train_step` jitted as Keras jits it).
        state: the state's `jax.ShapeDtypeStruct`s, with shardings.
        data: the batch's, as the step takes it.
        steps: how many runs are timed, after one untimed run.

    Returns:
        The median of the timed runs' seconds.

    Raises:
        Whatever running the step raises; a device that can't hold it
        raises XLA's `RESOURCE_EXHAUSTED` error.

    Example:
    ```python
    timed_step_seconds(jax.jit(step, donate_argnums=0).lower(s, d).compile(), s, d)
    ```
    """
    import jax

    state, data = zero_filled(state), zero_filled(data)
    seconds = []
    for run in range(steps + 1):
        start = time.perf_counter()
        logs, state = compiled(state, data)
        jax.block_until_ready((logs, state))
        if run:
            seconds.append(time.perf_counter() - start)
    del state, data
    return statistics.median(seconds)


__all__ = ["TIMED_STEPS", "timed_step_seconds", "zero_filled"]
