"""The closed-form estimate of a training step's bytes per device.

What `strategy="auto"` and `device_mesh="auto"` can afford to compute for
every candidate mesh: no model is built and nothing is compiled. Each term
counts the buffers of one kind that are live at the step's peak (the start
of the backward pass), as a number of elements times a factor; the factors
are data (`ACTIVATION_FACTORS`, per platform: XLA's CPU and GPU backends
keep different buffers), calibrated against the compiled check
(`keras_hub_autodist.compiled_memory`) and a device's measured peak.

Per device, for a decoder of `L` blocks with hidden size `d`, `H` query and
`K` key/value heads of size `h`, up-projections of width `F` (times `E`
experts for a mixture of experts), vocabulary `V`, on `b` sequences of `s`
tokens (the batch over the batch axis):

- state: the weights and the optimizer's slots, and one gradient per weight;
- per block: `stream·b·s·d` (residual stream and norm outputs, split by
  the model axis only with sequence parallelism), `attention·b·s·(H+K)·h`
  (query, key, value and context), `scores·b·H·s²` (attention
  probabilities), `mlp·b·s·F·E` per up-projection, `experts·b·s·d·E` for
  each expert's output before the routing sum;
- after the blocks: `final·b·s·d` and the logits, `b·s·V` once in the
  model's dtype and `logits_float32` times in float32 (Keras computes the
  cross-entropy and its gradient in float32).

Every term is divided by the shards the plan gives its dimension on the
model axes, as `LayoutPlan.activation_bytes_per_device` does.
"""

from __future__ import annotations

import dataclasses
import math

from keras_hub_autodist import sharding
from keras_hub_autodist.errors import PlanError

# Buffers of each term live at the step's peak, per platform, in the
# model's dtype. Measured with `python -m bench.estimate_calibration`:
# - "cpu": against XLA's memory analysis of the compiled step on 8 virtual
#   CPU devices (Adam, meshes 1x1, 8x1, 2x4, 1x8): 0.87-1.16x on the bench
#   models (bench/models.py, 8 x 512 tokens, float32 and bfloat16) and on
#   Gemma 2B's shapes (4 x 1024); 1.16-1.40x over on the tests' tiny
#   presets, whose attention scores dominate. XLA's CPU backend keeps about
#   four buffers of the attention scores (scores, mask, softmax, its
#   gradient) and three of the logits, and computes bfloat16 in float32
#   (`FLOAT32_ACTIVATIONS`).
# - "gpu": against the device peak of Gemma 2B's shapes in bfloat16, batch
#   4 x 1024, Adam, on one H200 (../shared/ACCELERATOR.md: 31.3 GB, where
#   the CPU factors would say 57 GB): one point, so the factors are those
#   XLA's GPU fusion is expected to keep (the activation function and gated
#   product fused into the down-projection, one softmax of the scores, the
#   logits once in the model's dtype and once in float32 for the loss),
#   landing 1.10x over that peak. `python -m bench --accelerator` reports
#   the ratio on the machine it runs on; TPUs use these until measured.
ACTIVATION_FACTORS = {
    "cpu": {
        "stream": 4,
        "attention": 2,
        "scores": 4,
        "mlp": 2,
        "experts": 1,
        "final": 2,
        "logits": 3,
        "logits_float32": 0,
    },
    "gpu": {
        "stream": 4,
        "attention": 2,
        "scores": 1,
        "mlp": 1,
        "experts": 1,
        "final": 2,
        "logits": 1,
        "logits_float32": 1,
    },
}
ACTIVATION_FACTORS["tpu"] = ACTIVATION_FACTORS["gpu"]
# Platforms whose XLA backend computes bfloat16 and float16 in float32.
FLOAT32_ACTIVATIONS = {"cpu"}
# Slots per weight kept by each optimizer, besides the weight and its gradient.
OPTIMIZER_SLOTS = {"adam": 2, "sgd": 0, "sgd_momentum": 1}
FLOAT32_BYTES = 4


@dataclasses.dataclass(frozen=True)
class StepEstimate:
    """The closed-form bytes per device of one training step.

    Args:
        weights: parameter bytes on the device.
        optimizer_state: the optimizer's slots.
        gradients: one gradient per weight held.
        activations: activations kept for the backward pass, logits included.

    Example:
    ```python
    estimate = step_estimate(plan, 8, 2048)
    estimate.total_bytes <= plan.device_memory_bytes
    ```
    """

    weights: int
    optimizer_state: int
    gradients: int
    activations: int

    @property
    def total_bytes(self) -> int:
        return self.weights + self.optimizer_state + self.gradients + self.activations


def check_sizes(batch_size, sequence_length, what: str = "memory estimate") -> None:
    """Raise `PlanError` unless both sizes are positive integers."""
    for name, value in (
        ("batch_size", batch_size),
        ("sequence_length", sequence_length),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PlanError(
                f"`{name}` must be a positive integer for the {what}. "
                f"Received: {name}={value!r}"
            )


def activation_terms(plan, batch_size: int, sequence_length: int) -> dict[str, float]:
    """Elements per device of each term of `ACTIVATION_FACTORS`, unweighted.

    Example:
    ```python
    activation_terms(plan, 8, 2048)["scores"]  # b·H·s² / shards of H
    ```
    """
    check_sizes(batch_size, sequence_length)
    axes = plan.mesh_axes
    parallel = {"vocab", "heads", "kv_heads", "head_dim", "mlp", "expert"}

    def dim(row, logical):
        return row.shape[row.logical_axes.index(logical)]

    def shards(row, logicals=parallel):
        return math.prod(
            axes.size(axis)
            for axis, logical in zip(row.spec, row.logical_axes)
            if axis and axis != axes.batch_axis and logical in logicals
        )

    def first(condition):
        return next((r for r in plan.rows if condition(r)), None)

    query = first(lambda r: "query" in r.path and "heads" in r.logical_axes)
    key = first(lambda r: "kv_heads" in r.logical_axes)
    ups = [r for r in plan.rows if r.logical_axes[-2:] == ("embed", "mlp")]
    downs = [r for r in plan.rows if r.logical_axes[-2:] == ("mlp", "embed")]
    vocab = [r for r in plan.rows if "vocab" in r.logical_axes]
    if query is None or not ups or not vocab:
        raise PlanError(
            "The memory estimate needs a decoder's query, MLP and embedding "
            f"weights; the {plan.architecture!r} plan lacks one. Received: "
            f"architecture={plan.architecture!r}"
        )
    output = vocab[-1]
    layers = sum(1 for r in plan.rows if r.pattern == query.pattern)
    b = batch_size / axes.size(axes.batch_axis)
    s = sequence_length
    d = dim(output, "embed")
    h = dim(query, "head_dim")
    heads = dim(query, "heads")
    kv_heads = dim(key, "kv_heads") if key is not None else heads
    q_shards = shards(query)
    kv_shards = shards(key) if key is not None else q_shards
    # The residual stream: split on the sequence with sequence parallelism.
    sequence_parallel = plan.sequence_parallel and sharding.sequence_parallel_spec(axes)
    split = axes.size(axes.model_axis) if sequence_parallel else 1

    def experts(row):
        return dim(row, "expert") if "expert" in row.logical_axes else 1

    logits = b * s * dim(output, "vocab") / shards(output)
    return {
        "stream": layers * b * s * d / split,
        "attention": layers
        * (b * s * heads * h / q_shards + b * s * kv_heads * h / kv_shards),
        "scores": layers * b * heads * s * s / shards(query, {"heads"}),
        "mlp": sum(b * s * dim(r, "mlp") * experts(r) / shards(r) for r in ups),
        "experts": sum(
            b * s * d * experts(r) / shards(r, {"expert"})
            for r in downs
            if "expert" in r.logical_axes
        ),
        "final": b * s * d / split,
        "logits": logits,
        "logits_float32": logits,
    }


def step_estimate(
    plan,
    batch_size: int,
    sequence_length: int,
    optimizer: str = "adam",
    *,
    platform: str = "gpu",
) -> StepEstimate:
    """The calibrated closed-form bytes per device of a training step.

    Args:
        plan: a `LayoutPlan`.
        batch_size: the global batch size, split over the batch axis.
        sequence_length: tokens per sequence.
        optimizer: `"adam"`, `"sgd"` or `"sgd_momentum"`.
        platform: the devices' platform, `"gpu"` (default), `"tpu"` or
            `"cpu"`, whose compiler keeps different buffers
            (`ACTIVATION_FACTORS`).

    Example:
    ```python
    plan = keras_hub_autodist.plan("./gemma_2b", {"batch": 1, "model": 1})
    step_estimate(plan, 4, 1024).total_bytes
    ```
    """
    if optimizer not in OPTIMIZER_SLOTS:
        raise PlanError(
            f"Unknown optimizer for the memory estimate. Use one of "
            f"{sorted(OPTIMIZER_SLOTS)}. Received: optimizer={optimizer!r}"
        )
    if platform not in ACTIVATION_FACTORS:
        raise PlanError(
            f"No memory calibration for platform {platform!r}; use one of "
            f"{sorted(ACTIVATION_FACTORS)}. Received: platform={platform!r}"
        )
    from keras_hub_autodist.dtypes import ITEMSIZES

    itemsize = ITEMSIZES.get(plan.dtype, FLOAT32_BYTES)
    if platform in FLOAT32_ACTIVATIONS:
        itemsize = max(itemsize, FLOAT32_BYTES)
    factors = ACTIVATION_FACTORS[platform]
    terms = activation_terms(plan, batch_size, sequence_length)
    activations = sum(
        factors[name]
        * count
        * (FLOAT32_BYTES if name == "logits_float32" else itemsize)
        for name, count in terms.items()
    )
    weights = plan.max_device_bytes
    return StepEstimate(
        weights=weights,
        optimizer_state=OPTIMIZER_SLOTS[optimizer] * weights,
        gradients=weights,
        activations=int(activations),
    )
