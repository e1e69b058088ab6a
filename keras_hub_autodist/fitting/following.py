"""The plan a user gets by following a piece of advice: the same model
planned again, as `plan()` plans it, with one option changed.

Advice is named only when the step it proposes fits by the verdict that
said the step asked for doesn't (`advice.shrink_advice`). That step is the
one the user runs after following it, so it is planned again, not
estimated with a shortcut: `strategy="fsdp"` lays every weight out anew
(some stay replicated), a context axis takes devices from the batch axis
(and with them the batch axis' share of an `fsdp` plan), `dtype=
"bfloat16"` halves the weights but not the float32 logits, and
`strategy="auto"` or `device_mesh="auto"` choose again with the new
options.

The plan's own values are the arguments: its weights (the rows, without
their layout), its mesh, its memory per device, its LoRA rank, remat,
dtype and strategy (the one asked for; `"auto"` where planning chose it).
Nothing is read again, so a plan made from a config dict or a model is
followed as one made from a folder.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from keras_hub_autodist.errors import PlanError
from keras_hub_autodist.fitting.planner import auto_mesh
from keras_hub_autodist.fitting.planner import plan_model
from keras_hub_autodist.fitting.policy import AUTO_MESH_REASON
from keras_hub_autodist.planning.mesh import ResolvedMesh
from keras_hub_autodist.planning.mesh import resolve_mesh_axes
from keras_hub_autodist.planning.options import PlanOptions
from keras_hub_autodist.planning.shapes import ModelWeights
from keras_hub_autodist.reading.dtypes import mixed_policy
from keras_hub_autodist.reading.dtypes import variable_dtype

if TYPE_CHECKING:
    from collections.abc import Mapping

    from keras_hub_autodist.fitting.layout_plan import LayoutPlan
    from keras_hub_autodist.planning.plan_record import PlanRecord

# The strategy reason of a strategy the user asked for (`planner.plan_model`).
REQUESTED = "requested"
# The `plan()` options advice changes.
FOLLOWED_OPTIONS = ("strategy", "dtype", "lora_rank", "remat")


def chose_mesh(plan: PlanRecord) -> bool:
    """Whether `device_mesh="auto"` chose the plan's mesh.

    Example:
    ```python
    chose_mesh(keras_hub_autodist.plan(preset, "auto", num_devices=8))  # True
    ```
    """
    return plan.mesh_reason.startswith(AUTO_MESH_REASON)


def planned_weights(plan: PlanRecord, dtype: str | None = None) -> ModelWeights:
    """The weights a plan laid out, as planning takes them: its rows without
    their layout, in the plan's dtype or in `dtype` (a float dtype or a
    mixed policy, as `plan(dtype=...)` takes it).

    Example:
    ```python
    planned_weights(plan, "bfloat16").dtype  # 'bfloat16'
    ```
    """
    weights = tuple(
        dataclasses.replace(row, spec=(), fallbacks=(), shards=1) for row in plan.rows
    )
    return ModelWeights(
        preset=plan.preset,
        backbone_class=plan.backbone_class,
        architecture=plan.architecture,
        config_fields=plan.config_fields,
        sequence_parallel_outputs=plan.sequence_parallel_outputs,
        dtype=plan.dtype if dtype is None else variable_dtype({}, dtype),
        weights=weights,
        final_logit_soft_cap=plan.final_logit_soft_cap,
        mixed_policy=plan.mixed_policy if dtype is None else mixed_policy({}, dtype),
    )


def followed_plan(
    plan: PlanRecord,
    *,
    device_mesh: Mapping[str, int] | None = None,
    context_axis: str | None = None,
    batch_size: int | None = None,
    **changes,
) -> LayoutPlan:
    """The plan `plan()` gives for `plan`'s model with `changes`: what a
    user runs after following advice.

    Args:
        plan: the plan advised on.
        device_mesh: a new mesh, as axis sizes (the advice's
            `device_mesh={...}`); its axes keep the plan's names and roles.
        context_axis: the new mesh's context axis, where the plan has none.
        batch_size: the step's global batch: a mesh `device_mesh="auto"`
            chose is chosen again for it, as the command's `--mesh auto
            --batch` chooses.
        **changes: `plan()` options (`FOLLOWED_OPTIONS`): `strategy`,
            `dtype`, `lora_rank`, `remat`.

    Returns:
        A `LayoutPlan`, for the plan's device (`device_name`).

    Raises:
        AutodistError: where `plan()` would refuse the changed options
            (e.g. a context axis with `sequence_parallel=True`).

    Example:
    ```python
    fsdp = followed_plan(plan, strategy="fsdp")
    step_verdict(fsdp, 8, 1024).answer
    ```
    """
    unknown = sorted(set(changes) - set(FOLLOWED_OPTIONS))
    if unknown:
        raise PlanError(
            f"Advice changes the options {list(FOLLOWED_OPTIONS)} of `plan()`, "
            f"and the mesh and batch; pass those only. Received: {unknown}"
        )
    axes = plan.mesh_axes
    strategy = plan.strategy if plan.strategy_reason == REQUESTED else "auto"
    options = PlanOptions(
        strategy=changes.get("strategy", strategy),
        batch_axis=axes.batch_axis,
        model_axis=axes.model_axis,
        context_axis=axes.context_axis,
        context_parallel_strategy=plan.context_parallel_strategy,
        dtype=changes.get("dtype"),
        device_memory=plan.device_memory_bytes,
        lora_rank=changes.get("lora_rank", plan.lora_rank),
        remat=changes.get("remat", plan.remat),
        sequence_parallel=plan.sequence_parallel,
        strict=False,
    )
    weights = planned_weights(plan, changes.get("dtype"))
    capacity, source = plan.device_memory_bytes, plan.device_memory_source
    reason = plan.mesh_reason
    if device_mesh is not None:
        axes = resolve_mesh_axes(
            device_mesh,
            batch_axis=axes.batch_axis,
            model_axis=axes.model_axis,
            context_axis=axes.context_axis or context_axis,
        )
        options = dataclasses.replace(options, context_axis=axes.context_axis)
        reason = ""
    elif chose_mesh(plan):
        shape, reason = auto_mesh(
            weights, options, axes.num_devices, capacity, source, batch_size
        )
        axes = resolve_mesh_axes(shape)
    mesh = ResolvedMesh(axes, None, capacity, source, reason)
    return plan_model(weights, mesh, options).replace(device_name=plan.device_name)


__all__ = [
    "FOLLOWED_OPTIONS",
    "REQUESTED",
    "chose_mesh",
    "followed_plan",
    "planned_weights",
]
