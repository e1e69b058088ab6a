"""A plan as text: the weight table, the per-device summary and the fit
verdict as a line, with its advice when training does not fit (made by
`advice`, which plans each change again). Pure functions of a plan's values
(`PlanRecord`)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from keras_hub_autodist.errors import option
from keras_hub_autodist.fitting import memory
from keras_hub_autodist.fitting import step_memory
from keras_hub_autodist.fitting.device_memory import DEVICE_MEMORY_ENV
from keras_hub_autodist.fitting.device_memory import DEVICE_MEMORY_GB_ENV
from keras_hub_autodist.fitting.device_memory import MEMORY_ASSUMED
from keras_hub_autodist.fitting.device_memory import MEMORY_ENV
from keras_hub_autodist.fitting.device_memory import MEMORY_REPORTED
from keras_hub_autodist.fitting.device_profiles import device_profile
from keras_hub_autodist.fitting.device_profiles import usable_memory
from keras_hub_autodist.fitting.memory import format_bytes
from keras_hub_autodist.fitting.policy import AUTO_TP_MEMORY_SHARE
from keras_hub_autodist.fitting.verdicts import MAYBE
from keras_hub_autodist.fitting.verdicts import YES
from keras_hub_autodist.fitting.verdicts import platform_of
from keras_hub_autodist.fitting.verdicts import rematerializes
from keras_hub_autodist.fitting.verdicts import step_verdict
from keras_hub_autodist.planning import sharding
from keras_hub_autodist.planning import step_shape
from keras_hub_autodist.planning.remat_arguments import remat_mode
from keras_hub_autodist.words import counted

if TYPE_CHECKING:
    from keras_hub_autodist.architectures.weight import Weight
    from keras_hub_autodist.planning.plan_record import PlanRecord


def memory_note(plan: PlanRecord) -> str:
    """Where the per-device memory of this plan comes from."""
    if plan.device_memory_source == MEMORY_REPORTED:
        return "reported by the devices"
    if plan.device_memory_source == MEMORY_ENV:
        return f"from ${DEVICE_MEMORY_ENV} or ${DEVICE_MEMORY_GB_ENV}"
    if plan.device_memory_source == MEMORY_ASSUMED:
        return (
            "assumed: no device reported its memory; give yours with "
            f"{option('device_memory')}"
        )
    if plan.device_name:
        # What JAX can allocate on the named device, and why that much.
        profile = device_profile(plan.device_name)
        if profile.platform == "tpu":
            return "the HBM the TPU compiler gives one program there"
        return usable_memory(profile)[1].split(": ", 1)[-1].split("; ")[0]
    return "given"


# How the advice names the compiled check (the CLI names its flag instead).
COMPILED_CHECK = (
    "`keras_hub_autodist.compiled_memory(plan, batch_size, sequence_length)`"
)
# The LoRA rank the advice proposes (keras-hub's examples use 4).
ADVISED_LORA_RANK = 4


# The advice of a step that may fit: the compile settles it.
SETTLE_ADVICE = (
    "settle it by compiling the step for the device with its own compiler: "
    f"{COMPILED_CHECK}"
)


# What makes the advice of a verdict: `advice.fit_advice`, which plans each
# step again with the planner, and the planner imports this module (a
# plan's text is made here). So `advice` hands its function over when it
# is imported (`use_adviser`), and the package imports it first
# (keras_hub_autodist/__init__.py): no module imports the other in a loop.
_adviser = None


def use_adviser(adviser) -> None:
    """Make `adviser` (`advice.fit_advice`) give every verdict's advice."""
    global _adviser
    _adviser = adviser


def fit_advice(plan: PlanRecord, *step, **options) -> list[str]:
    """The advice of the closed form's verdict: `advice.fit_advice`, whose
    arguments it takes (`batch_size`, `sequence_length`, `optimizer`,
    `platform`). None when the step fits, how to settle a maybe, and for
    a step that does not fit what would make it fit, each piece checked by
    planning the step again as a user would follow it.

    Example:
    ```python
    plan.fit_advice(8, 1024)  # [] when it fits
    ```
    """
    return _adviser(plan, *step, **options)


def memory_verdict(
    plan: PlanRecord,
    batch_size: int | None = None,
    sequence_length: int | None = None,
    optimizer: str = "adam",
    platform: str | None = None,
) -> tuple[bool | None, step_memory.StepEstimate, str]:
    """The one fit verdict of the closed form (`verdicts.step_verdict`),
    with the estimate and the verdict as a line.

    `fits` is `True` (yes: the estimate fits `plan.device_memory_bytes`),
    `False` (NO) or `None` (maybe: between the least the step could need
    and its estimate with the estimate's measured shortfall, the capacity
    lies; the line gives the range and how to settle it:
    `verdicts.step_verdict`).

    Without `batch_size` and `sequence_length` the estimate counts weights,
    gradients and optimizer state alone, and the line says so. With them it
    is the step a bound `fit` runs (`step_shape.runnable_step`): a batch
    the batch axis doesn't divide counts padded, and the line says so; a
    sequence the context axis doesn't divide raises `SequenceLengthError`.

    Args:
        platform: whose compiler's buffers to count; defaults to the plan's
            named device, else a GPU's (`platform_of`).

    Example:
    ```python
    fits, estimate, line = memory_verdict(plan, 1, 256)
    ```
    """
    platform = platform_of(plan, platform)
    verdict = step_verdict(plan, batch_size, sequence_length, optimizer, platform)
    estimate = verdict.estimate
    capacity = plan.device_memory_bytes
    training = f"LoRA rank {plan.lora_rank} fine-tune" if plan.lora_rank else "training"
    what = (
        f"{training} step of {_step_text(plan, batch_size, sequence_length)} "
        f"with {optimizer}"
        if estimate.covers == step_memory.STEP
        else f"{training} with {optimizer}, weights+grads+optimizer state only "
        "(no activations: give a batch and sequence length to count them)"
    )
    share = estimate.total_bytes / max(1, capacity)
    device = f" {plan.device_name}" if plan.device_name else ""
    if verdict.answer == YES:
        line = (
            f"fits: yes, {what} takes {format_bytes(estimate.total_bytes)}, "
            f"{share:.0%} of each{device} device's {format_bytes(capacity)}"
        )
    elif verdict.answer == MAYBE:
        remat = (
            ", and the TPU compiler rematerializes activations when memory is short"
            if rematerializes(platform)
            else ""
        )
        most = estimate.total_bytes * (1 + verdict.margin)
        line = (
            f"fits: maybe, {what} needs between "
            f"{format_bytes(verdict.least_bytes)} and {format_bytes(most)} per "
            f"device, of each{device} device's {format_bytes(capacity)}: the "
            f"estimate, {format_bytes(estimate.total_bytes)}, has been up to "
            f"{verdict.margin:.0%} under and {verdict.over_margin:.0%} over the "
            f"compiled peak on families it was not fitted to{remat}; "
            f"{SETTLE_ADVICE}"
        )
    else:
        where = (
            "even the parameters alone do not fit; "
            if plan.max_device_bytes > capacity
            else ""
        )
        least = (
            f" (at least {format_bytes(verdict.least_bytes)}, allowing for the "
            f"estimate's {verdict.over_margin:.0%} over the compiled peak and the "
            "compiler's rematerialization)"
            if verdict.least_bytes < estimate.total_bytes
            else ""
        )
        line = (
            f"fits: NO, {what} needs {format_bytes(estimate.total_bytes)} per "
            f"device{least}, {share:.1f}x the {format_bytes(capacity)} of "
            f"each{device} device; {where}to fit: "
            + "; or ".join(
                fit_advice(plan, batch_size, sequence_length, optimizer, platform)
            )
        )
    return verdict.fits, estimate, line


def _step_text(plan: PlanRecord, batch_size: int, sequence_length: int) -> str:
    """`"8 x 2048 tokens"`, and the padded batch a bound model runs when the
    batch axis doesn't divide the batch."""
    step = step_shape.runnable_step(plan.mesh_axes, batch_size, sequence_length)
    padded = (
        f" (padded to {step.rows} sequences, a multiple of the "
        f"{plan.mesh_axes.size(plan.batch_axis)} devices of the batch axis)"
        if step.padded
        else ""
    )
    return f"{batch_size} x {sequence_length} tokens{padded}"


def summary(plan: PlanRecord) -> str:
    """Per-device totals, one line each, and whether the plan fits."""
    lines = summary_lines(plan)
    share = memory.training_bytes_per_device(plan) / max(1, plan.device_memory_bytes)
    _, _, verdict = memory_verdict(plan)
    if share > AUTO_TP_MEMORY_SHARE and memory.fits(plan):
        verdict += ", which leaves little room for activations"
    return "\n".join([*lines, verdict])


def summary_lines(plan: PlanRecord) -> list[str]:
    """The summary's lines before its verdict: the mesh, the strategy and
    the per-device totals (an answer about a step gives its own verdict
    after them)."""
    size = format_bytes
    axes = plan.mesh_axes
    mesh_reason = f"; {plan.mesh_reason}" if plan.mesh_reason else ""
    training = memory.training_bytes_per_device(plan)
    device = f" per {plan.device_name}" if plan.device_name else ""
    lines = [
        f"preset: {plan.preset} ({plan.backbone_class}, {plan.architecture})",
        f"mesh: {axes.describe()} (batch axis: {axes.batch_axis}, model "
        f"axis: {axes.model_axis}, hidden axis: {axes.hidden_axis}"
        + (f", expert axis: {axes.expert_axis}" if axes.expert_axis else "")
        + (f", context axis: {axes.context_axis}" if axes.context_axis else "")
        + f"{mesh_reason})",
        f"strategy: {plan.strategy} ({plan.strategy_reason})",
        f"context parallel: {context_parallel_note(plan)}",
        f"sequence parallel: {sequence_parallel_note(plan)}",
        "fine-tuning: "
        + (f"LoRA rank {plan.lora_rank}" if plan.lora_rank else "full")
        + f", rematerialization: {remat_mode(plan.remat) or 'off'}",
        f"parameters: {plan.num_parameters:,} ({plan.dtype}), "
        f"{size(plan.total_bytes)} in all",
        f"per device: {size(plan.max_device_bytes)} of parameters (ideal "
        f"{size(plan.ideal_device_bytes)}), about {size(training)} to "
        f"train with Adam, of {size(plan.device_memory_bytes)}{device} "
        f"({memory_note(plan)})",
        fallback_line(plan),
    ]
    return lines


# How attention reaches the other blocks' keys and values, by
# `context_parallel_strategy`.
CONTEXT_PARALLEL_NOTES = {
    "all_gather": "attention gathers each layer's keys and values (all_gather)",
    "ring": "keys and values pass around the context axis block by block (ring)",
}


def context_parallel_note(plan: PlanRecord) -> str:
    """Whether the plan splits each sequence over a context axis, and how."""
    axes = plan.mesh_axes
    if axes.context_axis is None:
        return "off (no context axis)"
    size = axes.size(axes.context_axis)
    if size == 1:
        return f"off: the context axis ({axes.context_axis}) has one device"
    return (
        f"on: each sequence split over '{axes.context_axis}' into {size} "
        "blocks (tokens, activations, queries, keys, values and logits); "
        + CONTEXT_PARALLEL_NOTES[plan.context_parallel_strategy]
    )


def sequence_parallel_note(plan: PlanRecord) -> str:
    """Whether the plan shards the residual stream on the sequence, and how."""
    if not plan.sequence_parallel:
        return "off"
    spec = sharding.sequence_parallel_spec(plan.mesh_axes)
    if spec is None:
        return (
            f"on, but the model axis ({plan.mesh_axes.model_axis}) has one "
            "device: activations stay as they are"
        )
    return (
        f"on: {len(plan.sequence_parallel_outputs)} residual-stream layer "
        f"outputs sharded {spec} on [batch, sequence, hidden]"
    )


def fallback_line(plan: PlanRecord) -> str:
    """The summary's count of fallbacks, in the rows the table shows (the
    same weight of every layer is one row) and the weights they cover.

    Example: `fallbacks: 3 table rows (5 weights), noted in the table`.
    """
    rows = [key for key in table_groups(plan) if key[3]]
    if not rows:
        return "fallbacks: none"
    return (
        f"fallbacks: {counted(len(rows), 'table row')} "
        f"({counted(len(plan.fallbacks), 'weight')}), noted in the table"
    )


def table_groups(plan: PlanRecord) -> dict[tuple, list[Weight]]:
    """The rows as `table()` shows them: the same weight of every layer
    (`decoder_block_*/...`) with one shape, spec and note in one group.
    Keyed by `(name, shape, spec, note)`."""
    groups: dict[tuple, list[Weight]] = {}
    for row in plan.rows:
        name = re.sub(r"_\d+(?=/)", "_*", row.path)
        groups.setdefault((name, row.shape, row.spec, row.note), []).append(row)
    return groups


def table(plan: PlanRecord) -> str:
    """The weights grouped across layers (`decoder_block_*/...`), with
    shape, spec, bytes and notes."""
    groups = table_groups(plan)
    header = ("weight", "count", "shape", "spec", "per device", "note")
    body = []
    for (name, *_), rows in groups.items():
        row = rows[0]
        body.append(
            (
                name,
                str(len(rows)),
                str(row.shape),
                str(row.spec),
                format_bytes(row.device_bytes),
                row.note,
            )
        )
    widths = [max(len(r[i]) for r in [header] + body) for i in range(5)]
    lines = []
    for r in [header] + body:
        cells = [r[i].ljust(widths[i]) for i in range(5)] + [r[5]]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)
