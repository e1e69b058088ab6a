"""What a training step costs in time on a named device: the model the
layout search (`search`) ranks layouts by.

Two answers, each per device and as a `StepCost`:

- `compiled_cost`: from a step compiled for the target
  (`compiled_step.compiled_memory`): its measured time where it ran on the
  attached device, else XLA's own time estimate where the
  backend gives one (the TPU compiler's `optimal_seconds`), else a roofline
  of the program's flops, HBM bytes and link bytes (counted from its HLO
  text where XLA gives no cost analysis: `hlo_cost`); never faster than
  the device's peak on the flops the step must compute (`model_flops`).
- `closed_form_cost`: the same roofline from the plan alone, with the
  collectives each layout implies counted by hand, to rank layouts before
  any is compiled.

The roofline: compute takes `flops / peak_flops`, memory traffic `bytes /
HBM bandwidth`, the collectives `link bytes / link bandwidth` of the
device's profile (`device_profiles.DEVICE_SPEEDS`). Compute and memory
traffic overlap (a step takes the longer of the two); of the collectives,
the share `COLLECTIVE_OVERLAP` of the link says is hidden behind them, the
rest adds to the step.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from keras_hub_autodist.fitting.device_profiles import DeviceSpeed
from keras_hub_autodist.planning.remat_arguments import block_policy

if TYPE_CHECKING:
    from keras_hub_autodist.fitting.compiled_step import CompiledMemory
    from keras_hub_autodist.fitting.step_memory import StepEstimate
    from keras_hub_autodist.planning.plan_record import PlanRecord

# The assumed share of the collectives' time the schedule hides behind
# compute, by link: XLA's TPU and NVLink schedules start collectives
# asynchronously and overlap them with the matmuls that don't depend on
# them (about half, as a round assumption); over PCIe the GPUs' collectives
# go through host memory and are taken as not hidden at all.
COLLECTIVE_OVERLAP = {"ici": 0.5, "nvlink": 0.5, "pcie": 0.0}

# Passes over the weights' matmuls per step, in units of a forward pass
# (2 flops per parameter per token): forward 1, backward 2 (the gradients
# of the activations and of the weights); a LoRA step's frozen weights get
# no gradient (backward 1); full rematerialization runs the forward again
# (`passes`: not the matmuls' under a policy that keeps their outputs).
FULL_PASSES = 3
LORA_PASSES = 2
REMAT_PASSES = 1


@dataclasses.dataclass(frozen=True)
class StepCost:
    """The modelled time of one training step on one device.

    Args:
        seconds: the modelled step time.
        compute_seconds: flops / peak flops.
        memory_seconds: HBM bytes / HBM bandwidth.
        link_seconds: link bytes / link bandwidth, before any overlap.
        flops: flops per device.
        hbm_bytes: bytes read and written in HBM per device.
        link_bytes: bytes each device sends over its links.
        source: where `seconds` comes from: `"measured"` (the step run on
            the device), `"xla"` (the compiler's own
            estimate), `"roofline"`, `"model flops"` (the device's peak on
            the flops the step must compute, where the compiled estimate
            is less: `compiled_cost`) or `"closed form"`.
    """

    seconds: float
    compute_seconds: float
    memory_seconds: float
    link_seconds: float
    flops: float
    hbm_bytes: float
    link_bytes: float
    source: str

    def terms(self) -> dict[str, float]:
        """`{"compute", "memory", "link"}` seconds."""
        return {
            "compute": self.compute_seconds,
            "memory": self.memory_seconds,
            "link": self.link_seconds,
        }


def roofline(
    flops: float,
    hbm_bytes: float,
    link_bytes: float,
    speed: DeviceSpeed,
    source: str = "roofline",
) -> StepCost:
    """A step's time from its per-device flops and bytes on `speed`'s device.

    Example:
    >>> speed = DeviceSpeed(1e12, 1e11, 1e10, "pcie", "")
    >>> roofline(2e12, 1e11, 1e10, speed).seconds  # 2 s compute + 1 s link
    3.0
    """
    compute = flops / speed.peak_flops
    memory = hbm_bytes / speed.hbm_bytes_per_second
    link = link_bytes / speed.link_bytes_per_second
    hidden = COLLECTIVE_OVERLAP[speed.link]
    seconds = max(compute, memory, hidden * link) + (1 - hidden) * link
    return StepCost(
        seconds, compute, memory, link, flops, hbm_bytes, link_bytes, source
    )


def compiled_cost(
    memory: CompiledMemory, speed: DeviceSpeed, least_flops: float = 0.0
) -> StepCost:
    """The time of a compiled step: the seconds measured on the device
    where it was run there (`compiled_memory(..., timed_steps=...)`); else
    modelled: the TPU compiler's `optimal_seconds` where it gives one, else
    the roofline of the program's cost (`memory.cost`: XLA's, or counted
    from its HLO), never less than the roofline of `least_flops`, the flops
    per device the step must compute (`model_flops`).

    The floor: XLA's cost analysis counts no flops inside a custom call
    (the splash kernel's attention), and the TPU compiler's estimate for a
    Llama 3.2 1B step of 16 x 1,024 tokens with remat "dots" on a v5e was
    0.62 s, 124% of the chip's peak for the flops it must compute. An
    estimate past the peak ranks what it underestimates first.

    Example:
    ```python
    compiled_cost(compiled_memory(plan, 8, 2048, device="v5e"),
                  device_speed("v5e"), model_flops(plan, 8, 2048)).seconds
    ```
    """
    cost = memory.cost
    measured = cost.get("measured_seconds")
    figures = roofline(
        cost.get("flops", 0.0),
        cost.get("bytes_accessed", 0.0),
        cost.get("link_bytes", 0.0),
        speed,
    )
    if measured:  # the step run on the device: no model of it is needed
        return dataclasses.replace(figures, seconds=measured, source="measured")
    estimate = cost.get("optimal_seconds")
    seconds, source = (estimate, "xla") if estimate else (figures.seconds, "roofline")
    least_seconds = least_flops / speed.peak_flops
    if least_seconds > seconds:
        seconds, source = least_seconds, "model flops"
    return dataclasses.replace(figures, seconds=seconds, source=source)


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder the flop and collective counts need, read from
    a plan's weights."""

    parameters: int
    layers: int
    hidden: int
    attention_width: int
    key_value_width: int


def model_shape(plan: PlanRecord) -> ModelShape:
    """A plan's `ModelShape`: its parameters, blocks, hidden size, query
    heads x head size and key/value heads x head size."""
    query = next(
        (r for r in plan.rows if "query" in r.path and "heads" in r.logical_axes),
        None,
    )
    key = next(
        (r for r in plan.rows if "/key" in r.path and "head_dim" in r.logical_axes),
        None,
    )

    def width(row, heads):
        if row is None:
            return 0
        sizes = dict(zip(row.logical_axes, row.shape))
        return sizes.get(heads, 1) * sizes.get("head_dim", 1)

    embed = next((r for r in plan.rows if "embed" in r.logical_axes), None)
    hidden = dict(zip(embed.logical_axes, embed.shape))["embed"] if embed else 0
    layers = sum(1 for r in plan.rows if query and r.pattern == query.pattern) or 1
    return ModelShape(
        plan.num_parameters,
        layers,
        hidden,
        width(query, "heads"),
        width(key, "kv_heads"),
    )


def passes(lora_rank: int | None, remat) -> int:
    """Forward-pass equivalents of a step's weight matmuls (`FULL_PASSES`,
    `LORA_PASSES`, `REMAT_PASSES`): a block policy that keeps its weight
    matmuls' outputs (`BlockPolicy.recomputes_matmuls`) computes none of
    them again."""
    policy = block_policy(remat)
    again = remat is not None and (policy is None or policy.recomputes_matmuls)
    return (LORA_PASSES if lora_rank else FULL_PASSES) + (REMAT_PASSES if again else 0)


def model_flops(
    plan: PlanRecord,
    batch_size: int,
    sequence_length: int,
    lora_rank: int | None = None,
    remat=None,
) -> float:
    """The flops of a whole training step, all devices together: `2 x`
    parameters `x` tokens per pass (`passes`: 6·N·tokens for a full
    fine-tune without rematerialization) and attention's scores and
    weighted sums over the causal half of the square (`2 x` tokens `x`
    sequence `x` query width per block and pass: what must be computed;
    XLA's own attention computes the whole square, the context axis'
    blockwise attention skips the masked blocks).

    Example:
    ```python
    model_flops(plan, 8, 2048) / 8  # flops per device of a v5e-8 step
    ```
    """
    shape = model_shape(plan)
    tokens = batch_size * sequence_length
    dense = 2 * shape.parameters * tokens
    attention = 2 * tokens * sequence_length * shape.attention_width * shape.layers
    # Every rematerialization computes attention again.
    again = REMAT_PASSES if remat is not None else 0
    return dense * passes(lora_rank, remat) + attention * (
        passes(lora_rank, None) + again
    )


def closed_form_cost(
    plan: PlanRecord,
    batch_size: int,
    sequence_length: int,
    estimate: StepEstimate,
    speed: DeviceSpeed,
) -> StepCost:
    """The roofline of a plan's step before compiling it: `model_flops`
    split over the devices, HBM traffic of the weights per pass and of the
    state and activations, and the collectives its layout implies
    (`layout_link_bytes`).

    Args:
        plan: a `LayoutPlan` (its mesh, strategy, LoRA rank and remat).
        batch_size: the global batch.
        sequence_length: tokens per sequence.
        estimate: the plan's closed-form memory (`step_memory.step_estimate`).
        speed: the device's `DeviceSpeed`.
    """
    axes = plan.mesh_axes
    steps = passes(plan.lora_rank, plan.remat)
    flops = (
        model_flops(plan, batch_size, sequence_length, plan.lora_rank, plan.remat)
        / axes.num_devices
    )
    hbm = (
        steps * estimate.weights
        + 2 * (estimate.optimizer_state + estimate.gradients)
        + 2 * estimate.activations
    )
    link = layout_link_bytes(plan, batch_size, sequence_length, estimate)
    return dataclasses.replace(roofline(flops, hbm, link, speed), source="closed form")


def _ring(n: int) -> float:
    return (n - 1) / n if n > 1 else 0.0


def layout_link_bytes(
    plan: PlanRecord, batch_size: int, sequence_length: int, estimate: StepEstimate
) -> float:
    """Bytes each device sends per step for its layout's collectives:

    - a model axis of `m`: each block's two partial sums (attention out,
      MLP out) all-reduced, forward and backward (and again when
      rematerialized): `2 (m-1)/m` of the block's activation each;
    - `"fsdp"` over a batch axis of `b`: the weights all-gathered once per
      pass, the gradients reduce-scattered;
    - `"tp"` over a batch and context axes of `k` devices: the gradients
      all-reduced over them;
    - a context axis of `c`: each block's keys and values all-gathered,
      forward and backward.
    """
    axes = plan.mesh_axes
    shape = model_shape(plan)
    model = axes.size(axes.model_axis) if axes.model_axis else 1
    batch = axes.size(axes.batch_axis)
    context = axes.size(axes.context_axis) if axes.context_axis else 1
    item = 4 if plan.dtype in ("float32", "float64") else 2
    rows = -(-batch_size // batch)
    local_tokens = rows * sequence_length / context
    steps = passes(plan.lora_rank, plan.remat)
    tensor = 2 * steps * shape.layers * local_tokens * shape.hidden * item
    link = tensor * 2 * _ring(model)
    trained = estimate.gradients
    replicas = batch * context
    if plan.strategy == "fsdp" and batch > 1:
        link += steps * estimate.weights * (batch - 1)
        link += trained * (batch - 1)
        link += 2 * trained * _ring(context)
    else:
        link += 2 * trained * _ring(replicas)
    key_values = 2 * rows * sequence_length * shape.key_value_width * item
    link += 2 * shape.layers * key_values / max(model, 1) * _ring(context)
    return link


# Modelled times that agree to this many significant digits are the same
# time (`rounded_time`): a step costed at the device's peak on its model
# flops (`compiled_cost`) costs the same per token at every batch, up to
# rounding.
TIE_DIGITS = 6


def rounded_time(seconds: float) -> float:
    """`seconds` to `TIE_DIGITS` significant digits, so that equal modelled
    times compare equal.

    Example:
    >>> rounded_time(0.2265 / 4096) == rounded_time(0.453 / 8192)
    True
    """
    return float(f"{seconds:.{TIE_DIGITS - 1}e}")


def tokens_per_second(batch_size: int, sequence_length: int, seconds: float) -> float:
    """Tokens a step of `seconds` trains per second."""
    return batch_size * sequence_length / seconds if seconds > 0 else 0.0


def modelled_mfu(
    plan: PlanRecord,
    batch_size: int,
    sequence_length: int,
    seconds: float,
    speed: DeviceSpeed,
) -> float:
    """Model flops utilization of a modelled step: `model_flops` without
    rematerialization's recomputation, over the devices' peak for
    `seconds`."""
    useful = model_flops(plan, batch_size, sequence_length, plan.lora_rank, None)
    peak = plan.mesh_axes.num_devices * speed.peak_flops * seconds
    return useful / peak if peak > 0 else 0.0


__all__ = [
    "COLLECTIVE_OVERLAP",
    "TIE_DIGITS",
    "ModelShape",
    "StepCost",
    "closed_form_cost",
    "compiled_cost",
    "layout_link_bytes",
    "model_flops",
    "model_shape",
    "modelled_mfu",
    "passes",
    "roofline",
    "rounded_time",
    "tokens_per_second",
]
