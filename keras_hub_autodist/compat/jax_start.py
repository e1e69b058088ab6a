"""JAX's start of its TPU backend, quiet on a machine without a TPU chip.

With libtpu installed (the `tpu-compile` extra, which compiles a step for a
TPU on any machine), JAX tries its TPU backend whenever it starts its
backends. Off a TPU VM libtpu then writes its start-up notices to stderr
(`Failed to find host bounds for accelerator type`, an `INVALID_ARGUMENT`
about the TPU workers' hostnames and its source trace) before JAX goes on
without it. `quiet_tpu_backend_start` runs that attempt inside the context
it is given (`quiet.jax_start_filtered`, which drops those notices at the
default log level and writes every other line back, unless the user asked
JAX for a TPU) where JAX sees no TPU chip. On a TPU VM nothing changes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from contextlib import AbstractContextManager

XLA_BRIDGE = "jax._src.xla_bridge"
# (module, attribute) pairs this module relies on (`compat.TOUCHPOINTS`).
TOUCHPOINTS = (
    (XLA_BRIDGE, "_backend_factories"),
    ("jax._src.hardware_utils", "num_available_tpu_chips_and_device_id"),
)


def quiet_tpu_backend_start(filtered: Callable[[], AbstractContextManager]) -> None:
    """Run JAX's attempt at a TPU backend inside `filtered()` where this
    machine has no TPU chip (once; nothing without libtpu's registration,
    or on a TPU VM).

    Example:
    ```python
    quiet_tpu_backend_start(quiet.jax_start_filtered)
    jax.devices()  # on a CPU machine with libtpu: no libtpu notices
    ```
    """
    from jax._src import hardware_utils
    from jax._src import xla_bridge

    registration = xla_bridge._backend_factories.get("tpu")
    if registration is None or getattr(registration.factory, "quiet", False):
        return
    chips, _ = hardware_utils.num_available_tpu_chips_and_device_id()
    if chips:
        return
    start = registration.factory

    def factory(*args, **kwargs):
        with filtered():
            return start(*args, **kwargs)

    factory.quiet = True
    xla_bridge._backend_factories["tpu"] = dataclasses.replace(
        registration, factory=factory
    )
