"""The compiled check as an answer: does the compiled step fit the memory
JAX can allocate on the device, and what was compiled (the fields of
`plan ... --compiled --json`, and their lines of text).

The closed-form estimate answers first and needs nothing; the compiled
step is the compiler's own figure for the same step and, with `--compiled`,
the one `fits` is read from.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from keras_hub_autodist.fitting.compiled_fit import compiled_fits

if TYPE_CHECKING:
    from keras_hub_autodist.fitting.compiled_step import CompiledMemory
    from keras_hub_autodist.planning.plan_record import PlanRecord

GIB = 1024**3


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


# The most steps the advice of a compiled verdict compiles, each one a
# piece of advice followed (a real model's step takes 10 to 100 s to
# compile for a target); past them, no more advice is checked, and none
# unchecked is given.
MAX_ADVICE_COMPILES = 6
# A followed step is compiled only when the closed form, scaled by what the
# compile said of the step asked for, is within this share of the memory:
# the others would not fit, and compiling them would only cost time.
ADVICE_SCREEN = 1.25


def compiled_judge(
    plan: PlanRecord,
    memory: CompiledMemory,
    estimate,
    optimizer: str = "adam",
    platform: str | None = None,
    *,
    device: str | None = None,
    preset=None,
):
    """The compiled verdict as the advice's judge (`advice.Judge`): each
    step a piece of advice proposes is compiled as the step asked for was
    (`compiled_memory`, on `device`) and held to the same rule
    (`compiled_fits`). The step asked for answers from `memory`; a step the
    closed form (`estimate`'s step, scaled to `memory`'s peak) puts past
    `ADVICE_SCREEN` of the memory, one that fails to compile, and any past
    `MAX_ADVICE_COMPILES` are NO.

    Example:
    ```python
    judge = compiled_judge(plan, memory, step_estimate(plan, 8, 2048), "adam")
    judge(plan, 4, 2048).answer
    ```
    """
    from keras_hub_autodist.fitting.advice import Judged
    from keras_hub_autodist.fitting.compiled_step import compiled_memory
    from keras_hub_autodist.fitting.step_memory import step_estimate
    from keras_hub_autodist.fitting.verdicts import NO
    from keras_hub_autodist.fitting.verdicts import YES
    from keras_hub_autodist.fitting.verdicts import platform_of

    platform = platform_of(plan, platform)
    scale = memory.peak_bytes / max(1, estimate.total_bytes)
    compiles = 0

    def judge(followed, batch_size, sequence_length) -> Judged:
        nonlocal compiles
        if followed is plan and (batch_size, sequence_length) == (
            memory.batch_size,
            memory.sequence_length,
        ):
            fits = compiled_fits(memory, plan.device_memory_bytes)
            return Judged(YES if fits else NO, memory.peak_bytes)
        closed = step_estimate(
            followed, batch_size, sequence_length, optimizer, platform=platform
        )
        screened = int(scale * closed.total_bytes)
        capacity = followed.device_memory_bytes
        if screened > ADVICE_SCREEN * capacity or compiles >= MAX_ADVICE_COMPILES:
            return Judged(NO, screened)
        compiles += 1
        try:
            step = compiled_memory(
                followed,
                batch_size,
                sequence_length,
                optimizer,
                device=device,
                preset=preset,
            )
        except Exception:  # a step that doesn't compile is not advised
            return Judged(NO, screened)
        return Judged(YES if compiled_fits(step, capacity) else NO, step.peak_bytes)

    return judge


def compiled_advice(
    plan: PlanRecord,
    memory: CompiledMemory,
    estimate,
    batch_size: int,
    sequence_length: int,
    optimizer: str = "adam",
    platform: str | None = None,
    *,
    device: str | None = None,
    preset=None,
) -> list[str]:
    """The advice of the compiled verdict: none when the compiled step
    fits; otherwise what would make it fit (`advice.shrink_advice`), each
    piece compiled as the user would run it after following it and given
    only when that compile fits (`compiled_judge`).

    Args:
        plan: the plan compiled.
        memory: its compiled step.
        estimate: the closed form's estimate of the same step, which picks
            the steps worth compiling.
        batch_size: the step's global batch.
        sequence_length: its tokens per sequence.
        optimizer: the optimizer's name.
        platform: whose compiler's buffers the closed form counts.
        device: the named device compiled for (`compiled_memory`'s
            `device=`), or None for the plan's or this machine's.
        preset: what the plan was made from, when `plan.preset` can't be
            read again.

    Example:
    ```python
    compiled_advice(plan, memory, step_estimate(plan, 8, 2048), 8, 2048)
    ```
    """
    from keras_hub_autodist.fitting.advice import shrink_advice

    if compiled_fits(memory, plan.device_memory_bytes):
        return []
    judge = compiled_judge(
        plan, memory, estimate, optimizer, platform, device=device, preset=preset
    )
    return shrink_advice(
        plan, batch_size, sequence_length, optimizer, platform, judge=judge
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


__all__ = [
    "ADVICE_SCREEN",
    "MAX_ADVICE_COMPILES",
    "compiled_advice",
    "compiled_fields",
    "compiled_fits",
    "compiled_judge",
    "compiled_verdict",
]
