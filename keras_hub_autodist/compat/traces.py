"""The constants of a traced JAX function, where a value of a finished
trace (a leaked tracer) would sit.

A traced step's closed-over constants are hoisted into the arguments of its
program (`jax.stages.Traced._consts`); `Traced.jaxpr.consts` holds those
left in the jaxpr. A leaked tracer among them lowers and compiles as any
argument, and only the step's first call refuses it (JAX's
`UnexpectedTracerError` from `core.check_eval_args`): a compile that never
runs the step can't see it any other way.
"""

from __future__ import annotations

# (module, attribute) pairs this module relies on (`compat.TOUCHPOINTS`).
TOUCHPOINTS = (("jax._src.stages", "Traced"),)


def leaked_tracers(traced) -> list:
    """The tracers among `traced`'s constants (a `jax.stages.Traced`):
    values of traces that had ended when they were captured.

    Example:
    ```python
    traced = jax.jit(step).trace(*arguments)
    assert leaked_tracers(traced) == []
    ```
    """
    import jax

    hoisted = getattr(traced, "_consts", None) or ()
    constants = [*hoisted, *traced.jaxpr.consts]
    return [value for value in constants if isinstance(value, jax.core.Tracer)]
