"""The compiled check as an answer: does the compiled step fit the memory
JAX can allocate on the device, and what was compiled (the fields of
`plan ... --compiled --json`, and their lines of text).

The closed-form estimate answers first and needs nothing; the compiled
step is the compiler's own figure for the same step and, with `--compiled`,
the one `fits` is read from.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from keras_hub_autodist.fitting.compiled_step import CompiledMemory
    from keras_hub_autodist.planning.plan_record import PlanRecord

GIB = 1024**3


def compiled_fits(memory: CompiledMemory, capacity: int) -> bool:
    """Whether the compiled step fits `capacity` bytes per device: the one
    rule of every compiled verdict (the command's text and `--json`,
    `CompiledMemory.fits`, the layout search's ranking).

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


def compiled_fields(memory: CompiledMemory, capacity: int) -> dict:
    """The `--compiled --json` fields of a compiled step, per device, with
    `fits`: whether it fits `capacity` bytes per device (`compiled_fits`).

    Example:
    ```python
    compiled_fields(memory, plan.device_memory_bytes)["compiled_for"]
    # {'platform': 'tpu', 'device_kind': 'TPU v5 lite', 'devices': 8}
    ```
    """
    fields = {
        "fits": compiled_fits(memory, capacity),
        "compiled_for": memory.compiled_for(),
        "compiled_peak_bytes_per_device": memory.peak_bytes,
        "compiled_argument_bytes_per_device": memory.argument_bytes,
        "compiled_temp_bytes_per_device": memory.temp_bytes,
        "compiled_attention": memory.attention or None,
        "compiled_collectives": [
            {
                "kind": collective.kind,
                "count": collective.count,
                "bytes_per_device": collective.bytes,
            }
            for collective in memory.collectives
        ],
    }
    for name, value in memory.cost.items():
        key = "optimal_seconds" if name == "optimal_seconds" else f"{name}_per_device"
        fields[f"compiled_{key}"] = value
    if memory.out_of_memory:
        fields["compiled_out_of_memory"] = memory.out_of_memory.splitlines()[0]
        fields["compiler_limit_bytes_per_device"] = memory.compiler_limit_bytes
    return fields


def compiled_advice(
    plan: PlanRecord,
    memory: CompiledMemory,
    estimate,
    batch_size: int,
    sequence_length: int,
    optimizer: str = "adam",
    platform: str | None = None,
) -> list[str]:
    """The advice of the compiled verdict: none when the compiled step
    fits; otherwise what would make it fit (`report.shrink_advice`), with
    every estimate scaled by the compiled peak over the closed-form
    `estimate` of the same step, so that the advice starts from the
    compiler's figure, not from the closed form's.

    Example:
    ```python
    compiled_advice(plan, memory, step_estimate(plan, 8, 2048), 8, 2048)
    ```
    """
    from keras_hub_autodist.fitting.report import shrink_advice

    if compiled_fits(memory, plan.device_memory_bytes):
        return []
    calibration = memory.peak_bytes / max(1, estimate.total_bytes)
    return shrink_advice(
        plan,
        batch_size,
        sequence_length,
        optimizer,
        platform,
        calibration=calibration,
    )


def compiled_verdict(
    plan: PlanRecord, memory: CompiledMemory, assumption: str | None
) -> str:
    """The compiled check's fit verdict as one line.

    Args:
        plan: the plan, whose `device_memory_bytes` the peak is held to.
        memory: the compiled step.
        assumption: what the device memory is, in words, or None.
    """
    capacity = plan.device_memory_bytes
    what = f"{memory.device_kind or memory.platform} x {memory.devices}"
    share = memory.peak_bytes / max(1, capacity)
    usable = f" ({assumption})" if assumption else ""
    if memory.out_of_memory:
        return (
            f"fits (compiled for {what}): NO, the compiler refuses the step: "
            f"it needs {memory.peak_bytes / GIB:.2f} GiB per device of "
            f"{memory.compiler_limit_bytes / GIB:.2f} GiB"
        )
    answer = "yes" if compiled_fits(memory, capacity) else "NO"
    return (
        f"fits (compiled for {what}): {answer}, the compiled peak is "
        f"{memory.peak_bytes / GIB:.2f} GiB per device, {share:.0%} of "
        f"{capacity / GIB:.2f} GiB{usable}"
    )


__all__ = ["compiled_advice", "compiled_fields", "compiled_fits", "compiled_verdict"]
