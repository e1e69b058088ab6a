"""The one rule of every compiled verdict: does a compiled step
(`compiled_step.CompiledMemory`) fit a device's memory. The command's text
and `--json`, `CompiledMemory.fits` and the layout search's ranking all ask
it."""

from __future__ import annotations


def compiled_fits(memory, capacity: int) -> bool:
    """Whether the compiled step `memory` (a `CompiledMemory`) fits
    `capacity` bytes per device.

    - A step the compiler refused as too large does not fit.
    - On a TPU the compiler refuses, when it compiles, any program whose
      peak is over the HBM it gives a program (`compiler_limit_bytes`):
      a step it accepted fits any `capacity` at least that large.
    - Otherwise the program's own peak (`peak_bytes`, XLA's
      `peak_memory_in_bytes`) is held to `capacity`. XLA's GPU compiler
      refuses no program for its size (a T4's accepts one of 25 GB), so
      on a GPU `capacity` is what JAX's allocator gives a program there:
      its pool, 75% of the memory by default or the client's memory
      fraction (`device_profiles.usable_memory`).

    Example:
    ```python
    compiled_fits(compiled_memory(plan, 8, 2048), plan.device_memory_bytes)
    ```
    """
    if memory.out_of_memory:
        return False
    limit = memory.compiler_limit_bytes
    if memory.platform == "tpu" and 0 < limit <= capacity:
        return True
    return memory.peak_bytes <= capacity
