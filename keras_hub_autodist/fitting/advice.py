"""The advice of a verdict: what would make a step that does not fit fit.

Each piece of advice is a change a user makes (LoRA, remat, `fsdp`, a
context axis, a smaller batch or sequence, bfloat16 weights, more devices
on the model axis), and it is given only when the step the user then runs
fits by the very verdict that said the step asked for doesn't: the plan is
made again with the change (`following.followed_plan`) and judged by the
same judge (`closed_form_judge`, or the compile's,
`compiled_answer.compiled_judge`). Advice that would not fit is not given.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

from keras_hub_autodist.errors import AutodistError
from keras_hub_autodist.errors import mesh_example
from keras_hub_autodist.errors import option
from keras_hub_autodist.fitting.device_memory import MEMORY_ASSUMED
from keras_hub_autodist.fitting.following import chose_mesh
from keras_hub_autodist.fitting.following import followed_plan
from keras_hub_autodist.fitting.memory import format_bytes
from keras_hub_autodist.fitting.report import ADVISED_LORA_RANK
from keras_hub_autodist.fitting.report import COMPILED_CHECK
from keras_hub_autodist.fitting.report import SETTLE_ADVICE
from keras_hub_autodist.fitting.report import use_adviser
from keras_hub_autodist.fitting.verdicts import MAYBE
from keras_hub_autodist.fitting.verdicts import NO
from keras_hub_autodist.fitting.verdicts import YES
from keras_hub_autodist.fitting.verdicts import platform_of
from keras_hub_autodist.fitting.verdicts import step_verdict
from keras_hub_autodist.planning import step_shape

if TYPE_CHECKING:
    from keras_hub_autodist.planning.plan_record import PlanRecord

# How many times as many devices on the model axis the advice tries, past
# the share the step is over the memory, before it says nothing fits.
MORE_DEVICES_TRIED = 64


@dataclasses.dataclass(frozen=True)
class Judged:
    """A step's verdict as the advice reads it.

    Args:
        answer: `verdicts.YES`, `MAYBE` or `NO`.
        bytes: the figure per device the answer is read from: the closed
            form's estimate, or the compiled peak.
    """

    answer: str
    bytes: int


# A verdict on `(plan, batch_size, sequence_length)`.
Judge = Callable[["PlanRecord", "int | None", "int | None"], Judged]


def closed_form_judge(optimizer: str = "adam", platform: str = "gpu") -> Judge:
    """The closed form's verdict (`verdicts.step_verdict`) as a `Judge`.

    Example:
    ```python
    closed_form_judge("adam", "v5e")(plan, 8, 1024).answer  # "maybe"
    ```
    """

    def judge(plan, batch_size, sequence_length) -> Judged:
        verdict = step_verdict(plan, batch_size, sequence_length, optimizer, platform)
        return Judged(verdict.answer, verdict.estimate.total_bytes)

    return judge


@dataclasses.dataclass(frozen=True)
class _Step:
    """The step advised on, and its judge."""

    plan: PlanRecord
    batch_size: int | None
    sequence_length: int | None
    judge: Judge

    def follow(
        self,
        batch_size=None,
        sequence_length=None,
        device_mesh=None,
        context_axis=None,
        **changes,
    ) -> Judged:
        """The verdict on the step a user runs after following advice: the
        plan made again with `changes` (`followed_plan`), the step with its
        new batch or sequence length; NO where `plan()` would refuse it."""
        batch = self.batch_size if batch_size is None else batch_size
        sequence = self.sequence_length if sequence_length is None else sequence_length
        plan = self.plan
        if changes or device_mesh is not None or chose_mesh(plan):
            try:
                plan = followed_plan(
                    plan,
                    device_mesh=device_mesh,
                    context_axis=context_axis,
                    batch_size=batch,
                    **changes,
                )
            except AutodistError:
                return Judged(NO, 0)
        return self.judge(plan, batch, sequence)

    def fits(self, **change) -> bool:
        """Whether following `change` gives a step whose verdict is yes."""
        return self.follow(**change).answer == YES


def fit_advice(
    plan: PlanRecord,
    batch_size: int | None = None,
    sequence_length: int | None = None,
    optimizer: str = "adam",
    platform: str | None = None,
) -> list[str]:
    """The advice of the closed form's verdict (`verdicts.step_verdict`):
    none when the step fits; for a step that may fit, how to settle it by
    compiling; for one that does not, what would make it fit
    (`shrink_advice`), the largest smaller batch that may fit, then how to
    check the estimate by compiling.

    Args:
        plan: the plan.
        batch_size: the step's global batch, or None for the state alone.
        sequence_length: the step's tokens per sequence.
        optimizer: a name of `trained_state.OPTIMIZERS`.
        platform: whose compiler's buffers to count (`step_memory.
            calibration_of`); defaults to the plan's named device, else a
            GPU's (`platform_of`).

    Example:
    ```python
    fit_advice(plan, 8, 1024)  # [] when it fits
    ```
    """
    if batch_size is not None or sequence_length is not None:
        # A step the mesh refuses has no advice but the refusal.
        step_shape.runnable_step(plan.mesh_axes, batch_size, sequence_length)
    platform = platform_of(plan, platform)
    verdict = step_verdict(plan, batch_size, sequence_length, optimizer, platform)
    if verdict.answer == YES:
        return []
    if verdict.answer == MAYBE:
        return [SETTLE_ADVICE]
    judge = closed_form_judge(optimizer, platform)
    advice = shrink_advice(
        plan, batch_size, sequence_length, optimizer, platform, judge=judge
    )
    if batch_size is not None and sequence_length is not None:
        larger = _larger_batch_that_may_fit(
            _Step(plan, batch_size, sequence_length, judge)
        )
        if larger:
            advice.append(larger)
    advice.append(f"check this estimate against the compiled step: {COMPILED_CHECK}")
    return advice


def _larger_batch_that_may_fit(step: _Step) -> str:
    """The largest about-halving of the batch whose verdict is maybe,
    larger than any the verdict says fits;
    `""` when there is none (`step_shape.runnable_batches`)."""
    axes = step.plan.mesh_axes
    for batch in step_shape.runnable_batches(axes, step.batch_size):
        answer = step.follow(batch_size=batch).answer
        if answer == YES:
            return ""
        if answer == MAYBE:
            return (
                f"a batch of {batch} sequences may fit "
                f"({option('batch_size', str(batch))}): settle it by compiling "
                f"the step, {COMPILED_CHECK}"
            )
    return ""


def shrink_advice(
    plan: PlanRecord,
    batch_size: int | None = None,
    sequence_length: int | None = None,
    optimizer: str = "adam",
    platform: str | None = None,
    *,
    judge: Judge | None = None,
) -> list[str]:
    """What would make a step that does not fit fit on its devices, in order
    of cost (`SHRINK_RULES`): each piece named only when the step a user
    runs after following it (the plan made again with the change,
    `following.followed_plan`) fits by `judge`. When none does, how many
    devices the model axis needs, found the same way.

    Args:
        plan: the plan.
        batch_size: the step's global batch, or None for the state alone.
        sequence_length: the step's tokens per sequence.
        optimizer: a name of `trained_state.OPTIMIZERS`.
        platform: whose compiler's buffers the closed form counts; defaults
            to the plan's named device, else a GPU's (`platform_of`).
        judge: the verdict the advice is held to; defaults to the closed
            form's (`closed_form_judge`). With a compiled verdict, the
            compile's (`compiled_answer.compiled_judge`).

    Example:
    ```python
    shrink_advice(plan, 8, 4096)  # ["fine-tune with LoRA (...)", ...]
    ```
    """
    platform = platform_of(plan, platform)
    judge = judge or closed_form_judge(optimizer, platform)
    step = _Step(plan, batch_size, sequence_length, judge)
    advice = [text for rule in SHRINK_RULES if (text := rule(step))]
    if not advice:
        advice.append(_more_devices(step))
    if plan.device_memory_source == MEMORY_ASSUMED:
        advice.append(
            f"if your devices have more than "
            f"{format_bytes(plan.device_memory_bytes)}, say so with "
            f"{option('device_memory')}"
        )
    return advice


def _lora(step: _Step) -> str:
    if step.plan.lora_rank is not None or not step.fits(lora_rank=ADVISED_LORA_RANK):
        return ""
    return (
        f"fine-tune with LoRA ({option('lora_rank', str(ADVISED_LORA_RANK))}, "
        f"`backbone.enable_lora({ADVISED_LORA_RANK})`): only its kernels "
        "carry gradients and optimizer state"
    )


def _remat(step: _Step) -> str:
    if step.batch_size is None or step.plan.remat is not None:
        return ""
    if not step.fits(remat="full"):
        return ""
    return (
        f"rematerialize: {option('remat', repr('full'))} recomputes each "
        "block's activations in the backward pass instead of keeping them"
    )


def _fsdp(step: _Step) -> str:
    plan = step.plan
    if plan.strategy == "fsdp" or plan.mesh_axes.size(plan.batch_axis) < 2:
        return ""
    if not step.fits(strategy="fsdp"):
        return ""
    return (
        f"use {option('strategy', repr('fsdp'))} to shard weights and "
        f"optimizer state over '{plan.batch_axis}' too"
    )


def _context_mesh(step: _Step) -> str:
    """The smallest context axis, made of devices of the batch axis, that
    makes the step fit; `""` when none does (or the plan has one already).

    Each device then holds a block of every sequence instead of whole
    sequences: it helps when a batch is too small to fill the batch axis (a
    sequence per device is the least it can hold) and activations dominate.
    A batch axis left with more devices than the batch has sequences would
    hold padded sequences, so those splits are not proposed.
    """
    if step.batch_size is None or step.sequence_length is None:
        return ""
    axes = step.plan.mesh_axes
    if axes.size(axes.context_axis) > 1:
        return ""
    batch_devices = axes.size(axes.batch_axis)
    for context in range(2, batch_devices + 1):
        if batch_devices % context or step.sequence_length % context:
            continue
        if batch_devices // context > step.batch_size:
            continue
        sizes = dict(zip(axes.axis_names, axes.shape))
        sizes[axes.batch_axis] = batch_devices // context
        context_axis = axes.context_axis or "context"
        sizes[context_axis] = context
        if step.fits(device_mesh=sizes, context_axis=context_axis):
            return (
                "split each sequence over a context axis: "
                f"{mesh_example(sizes)} ({context} devices of '{axes.batch_axis}' "
                f"each hold a block of every sequence)"
            )
    return ""


def _smaller_step(step: _Step) -> str:
    """The largest about-halving of the batch, else of the sequence, that
    fits and that the mesh runs: a batch of whole rows per device of the
    batch axis (a smaller one is padded to that), a sequence the context
    axis divides (`step_shape.runnable_batches`, `runnable_lengths`)."""
    if step.batch_size is None or step.sequence_length is None:
        return ""
    axes = step.plan.mesh_axes
    for batch in step_shape.runnable_batches(axes, step.batch_size):
        if step.fits(batch_size=batch):
            return (
                f"a smaller batch: {batch} sequences of {step.sequence_length} "
                f"tokens ({option('batch_size', str(batch))})"
            )
    for sequence in step_shape.runnable_lengths(axes, step.sequence_length):
        if step.fits(sequence_length=sequence):
            return (
                f"shorter sequences: {step.batch_size} x {sequence} tokens "
                f"({option('sequence_length', str(sequence))})"
            )
    return ""


def _bfloat16(step: _Step) -> str:
    """bfloat16 weights, with what the step then needs: the float32 logits
    and the loss's buffers stay float32, so it is rarely half."""
    if step.plan.dtype not in ("float32", "float64"):
        return ""
    followed = step.follow(dtype="bfloat16")
    if followed.answer != YES:
        return ""
    now = step.judge(step.plan, step.batch_size, step.sequence_length).bytes
    return (
        f"load with {option('dtype', repr('bfloat16'))}: "
        f"{format_bytes(followed.bytes)} per device instead of "
        f"{format_bytes(now)}"
    )


def _more_devices(step: _Step) -> str:
    """The fewest times as many devices on the model axis (a model axis
    added where the mesh has none) with which the step fits; tried from
    the share the step is over the memory on, `MORE_DEVICES_TRIED` of
    them."""
    plan = step.plan
    axes = plan.mesh_axes
    model = axes.model_axis or "model"
    now = step.judge(plan, step.batch_size, step.sequence_length).bytes
    first = max(2, now // max(1, plan.device_memory_bytes))
    for times in range(first, first + MORE_DEVICES_TRIED):
        sizes = dict(zip(axes.axis_names, axes.shape))
        sizes[model] = sizes.get(model, 1) * times
        if step.fits(device_mesh=sizes):
            return (
                f"nothing fits on these {axes.num_devices} devices; with {times}x "
                f"as many devices on the '{model}' axis it would: "
                f"{mesh_example(sizes)}"
            )
    return (
        f"nothing fits on these {axes.num_devices} devices, nor with up to "
        f"{first + MORE_DEVICES_TRIED - 1}x as many devices on the '{model}' axis"
    )


# The advice, in order of cost: each rule names its change when the step
# followed fits, else says nothing.
SHRINK_RULES = (_lora, _remat, _fsdp, _context_mesh, _smaller_step, _bfloat16)


__all__ = [
    "Judge",
    "Judged",
    "MORE_DEVICES_TRIED",
    "SHRINK_RULES",
    "closed_form_judge",
    "fit_advice",
    "shrink_advice",
]


# Every verdict's advice is made here (`report.use_adviser`).
use_adviser(fit_advice)
