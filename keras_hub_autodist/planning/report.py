"""A plan as text: the weight table, the per-device summary and the advice
when training does not fit. Pure functions of a plan's values (`PlanRecord`)."""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING

from keras_hub_autodist.errors import option
from keras_hub_autodist.planning import memory
from keras_hub_autodist.planning import sharding
from keras_hub_autodist.planning.device_memory import DEVICE_MEMORY_ENV
from keras_hub_autodist.planning.device_memory import DEVICE_MEMORY_GB_ENV
from keras_hub_autodist.planning.device_memory import MEMORY_ASSUMED
from keras_hub_autodist.planning.device_memory import MEMORY_ENV
from keras_hub_autodist.planning.device_memory import MEMORY_REPORTED
from keras_hub_autodist.planning.policy import AUTO_TP_MEMORY_SHARE
from keras_hub_autodist.words import counted

if TYPE_CHECKING:
    from keras_hub_autodist.architectures.weight import Weight
    from keras_hub_autodist.planning.plan_record import PlanRecord


def format_bytes(n: float) -> str:
    """`n` bytes as text, e.g. `"1.50 GiB"`.

    Example:
    >>> format_bytes(1536)
    '1.50 KiB'
    """
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024


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
    return "given"


def fit_advice(plan: PlanRecord) -> list[str]:
    """What would make a plan that does not fit fit, most useful first."""
    need = memory.training_bytes_per_device(plan, "adam")
    ratio = need / max(1, plan.device_memory_bytes)
    model = plan.mesh_axes.model_axis or "model"
    advice = [f"put about {math.ceil(ratio)}x as many devices on the '{model}' axis"]
    if plan.strategy != "fsdp" and plan.mesh_axes.size(plan.batch_axis) > 1:
        advice.append(
            f"use {option('strategy', repr('fsdp'))} to shard weights and "
            f"optimizer state over '{plan.batch_axis}' too"
        )
    if plan.dtype in ("float32", "float64"):
        advice.append(
            f"load with {option('dtype', repr('bfloat16'))} to halve every byte"
        )
    if plan.device_memory_source == MEMORY_ASSUMED:
        advice.append(
            f"if your devices have more than "
            f"{format_bytes(plan.device_memory_bytes)}, say so with "
            f"{option('device_memory')}"
        )
    advice.append(
        "check this estimate against the compiled step: "
        "`keras_hub_autodist.compiled_memory(plan, batch_size, sequence_length)` "
        "(`plan ... "
        "--batch B --seq S --compiled` on the command line)"
    )
    return advice


def summary(plan: PlanRecord) -> str:
    """Per-device totals, one line each, and whether the plan fits."""
    size = format_bytes
    axes = plan.mesh_axes
    mesh_reason = f"; {plan.mesh_reason}" if plan.mesh_reason else ""
    training = memory.training_bytes_per_device(plan)
    lines = [
        f"preset: {plan.preset} ({plan.backbone_class}, {plan.architecture})",
        f"mesh: {axes.describe()} (batch axis: {axes.batch_axis}, model "
        f"axis: {axes.model_axis}, hidden axis: {axes.hidden_axis}"
        + (f", expert axis: {axes.expert_axis}" if axes.expert_axis else "")
        + f"{mesh_reason})",
        f"strategy: {plan.strategy} ({plan.strategy_reason})",
        f"sequence parallel: {sequence_parallel_note(plan)}",
        f"parameters: {plan.num_parameters:,} ({plan.dtype}), "
        f"{size(plan.total_bytes)} in all",
        f"per device: {size(plan.max_device_bytes)} of parameters (ideal "
        f"{size(plan.ideal_device_bytes)}), about {size(training)} to "
        f"train with Adam, of {size(plan.device_memory_bytes)} "
        f"({memory_note(plan)})",
        fallback_line(plan),
    ]
    share = training / max(1, plan.device_memory_bytes)
    if memory.fits(plan):
        tight = (
            ", which leaves little room for activations"
            if share > AUTO_TP_MEMORY_SHARE
            else ", before activations"
        )
        lines.append(
            f"fits: yes, weights+grads+Adam take {share:.0%} of each "
            f"device's memory{tight}"
        )
    else:
        where = (
            "even the parameters alone do not fit; "
            if plan.max_device_bytes > plan.device_memory_bytes
            else "the parameters alone fit (inference), training does not; "
        )
        lines.append(
            f"fits: NO, training with Adam needs {size(training)} per "
            f"device, {share:.1f}x "
            f"the {size(plan.device_memory_bytes)} available; {where}to "
            "fit: " + "; or ".join(fit_advice(plan))
        )
    return "\n".join(lines)


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
