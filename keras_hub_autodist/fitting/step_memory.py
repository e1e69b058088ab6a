"""The closed-form estimate of a training step's bytes per device.

What `strategy="auto"` and `device_mesh="auto"` can afford to compute for
every candidate mesh: no model is built and nothing is compiled. Each term
counts the buffers of one kind that are live at the step's peak (the start
of the backward pass), as a number of elements times a factor; the factors
are data (`memory_factors.ACTIVATION_FACTORS`, per platform: XLA's CPU and
GPU backends keep different buffers), calibrated against the compiled check
(`keras_hub_autodist.compiled_memory`) and a device's measured peak.

Per device, for a decoder of `L` blocks with hidden size `d`, `H` query and
`K` key/value heads of size `h`, up-projections of width `F` (times `E`
experts for a mixture of experts), vocabulary `V`, on `b` sequences of `s`
tokens (the batch over the batch axis):

- state: the weights and the optimizer's slots, and one gradient per weight;
- per block: `stream·b·s·d` (residual stream and norm outputs, split by
  the model axis only with sequence parallelism), `attention·b·s·(H+K)·h`
  (query, key, value and context), `scores·b·H·s²` (attention
  probabilities), `masks·b·s²` (the block's attention mask, not split by
  heads), `mlp·b·s·F·E` per up-projection, `experts·b·s·d·E` for each
  expert's output before the routing sum;
- for the one block being differentiated: `scores_one_block·b·H·s²`, the
  gradients of its probabilities and scores, live one block at a time;
- where each device attends one block of keys at a time
  (`per_device_kernel`: on a context mesh, and off one where the kernel
  rule of `attention_blocks` takes splash on a TPU or the blockwise kernel
  on a CPU), the scores and masks of one block of `KEY_BLOCK` keys
  in place of `s` keys, and with splash `kernel_residuals·b·H·s·128` per
  block in float32, each query's log-sum-exp that the kernel keeps for its
  backward pass;
- after the blocks: `final·b·s·d` and the logits, `logits·b·s·V` in the
  model's dtype (`logits_whole·b·s·V` more where the model axis does not
  split the vocabulary) and `logits_float32·b·s·V` in float32 (Keras
  computes the cross-entropy and its gradient in float32), and where the
  model caps its logits (Gemma 2's `final_logit_soft_cap`)
  `logits_soft_cap·b·s·V` in float32, the capped logits' own buffers;
- with `fsdp`: `gathered_weights`, the weights split over the batch (or
  context) axis as gathered whole over it where they are used: XLA keeps
  the gathered copies of the forward pass for the backward pass. When no
  model axis splits the weights (a model axis of one device), XLA gathers
  each weight where it is used and frees it: `gathered_share` counts the
  device's own share of those weights instead. Both in bytes of the
  weights' own dtypes.
- where the compiler computes the model's 16-bit float type in float32
  (`FLOAT32_COMPUTE`: XLA's CPU backend, a T4's bfloat16), every term in
  float32 bytes, and
  `weights_float32`, a float32 copy of the device's 16-bit float weights,
  converted once and kept for the backward pass, and `gathered_float32`,
  the bytes by which one of the two gathered copies grows in float32;
  `experts_relayout`, a copy of each float32 expert up-projection kernel in
  the layout of the experts' batched matmul (a 16-bit one's float32 copy
  is that copy). The experts' kernels are gathered where they are used,
  not kept.

Under a block policy of `remat=` (`"full"`, `"dots"`) each block keeps
what the policy keeps instead (`remat_memory`).

The activations are gone by the time the optimizer applies the gradients;
what the update itself keeps beside the state (`UPDATE_TEMPORARIES`, per
trained byte) counts instead when it is the larger of the two.

Every term is divided by the shards the plan gives its dimension on the
model axes, as `LayoutPlan.activation_bytes_per_device` does.
"""

from __future__ import annotations

import dataclasses
import math

from keras_hub_autodist.attention.attention_blocks import KEY_BLOCK
from keras_hub_autodist.attention.attention_blocks import SPLASH_RESIDUAL_LANES
from keras_hub_autodist.attention.attention_blocks import splash_head_dim
from keras_hub_autodist.errors import PlanError
from keras_hub_autodist.fitting.device_profiles import DEVICE_PROFILES
from keras_hub_autodist.fitting.device_profiles import device_key
from keras_hub_autodist.fitting.memory_factors import ACTIVATION_FACTORS
from keras_hub_autodist.fitting.memory_factors import ACTIVATION_TERMS
from keras_hub_autodist.fitting.memory_factors import CONTEXT_SPLASH_FACTORS
from keras_hub_autodist.fitting.memory_factors import FLOAT16_DTYPES
from keras_hub_autodist.fitting.memory_factors import FLOAT32_BYTES
from keras_hub_autodist.fitting.memory_factors import FLOAT32_COMPUTE
from keras_hub_autodist.fitting.memory_factors import FLOAT32_COPY_TERMS
from keras_hub_autodist.fitting.memory_factors import FLOAT32_SCORES
from keras_hub_autodist.fitting.memory_factors import GRADIENTS_AT_PEAK
from keras_hub_autodist.fitting.memory_factors import SPLASH_FACTORS
from keras_hub_autodist.fitting.memory_factors import UPDATE_TEMPORARIES
from keras_hub_autodist.fitting.memory_factors import WEIGHT_TERMS
from keras_hub_autodist.fitting.remat_memory import rematerialized_bytes
from keras_hub_autodist.fitting.step_kernel import MODEL_PARALLEL
from keras_hub_autodist.fitting.step_kernel import device_shards
from keras_hub_autodist.fitting.step_kernel import gives_head_shape
from keras_hub_autodist.fitting.step_kernel import num_blocks
from keras_hub_autodist.fitting.step_kernel import per_device_kernel
from keras_hub_autodist.fitting.step_kernel import row_dim
from keras_hub_autodist.fitting.trained_state import optimizer_spec
from keras_hub_autodist.fitting.trained_state import trainable_bytes
from keras_hub_autodist.loss.chunks import chunk_count
from keras_hub_autodist.planning import sharding
from keras_hub_autodist.planning.options import check_lora_rank
from keras_hub_autodist.planning.remat_arguments import block_policy
from keras_hub_autodist.planning.step_shape import runnable_step
from keras_hub_autodist.reading.dtypes import ITEMSIZES
from keras_hub_autodist.reading.dtypes import itemsize


@dataclasses.dataclass(frozen=True)
class StepEstimate:
    """The closed-form bytes per device of one training step.

    Args:
        weights: parameter bytes on the device (LoRA kernels included).
        optimizer_state: the optimizer's slots of the trained weights.
        gradients: one gradient per trained weight.
        activations: activations kept for the backward pass, logits
            included; 0 when no batch and sequence length were given.
        update_temporaries: what applying the update keeps beside the
            state (`UPDATE_TEMPORARIES`); the activations are gone by then.
        covers: what the total counts: `STEP` (a training step of a
            batch) or `STATE_ONLY` (weights and optimizer state alone).
        gradients_at_peak: the gradients live beside the activations at
            the backward pass's peak (`GRADIENTS_AT_PEAK`): the backward
            pass frees each block's activations as it makes its gradients.
            `None` for all of them.

    The total is the weights and the optimizer's slots, plus the larger of
    the backward pass's peak (`gradients_at_peak` and the activations) and
    the update's (all gradients and the update's temporaries).

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
    update_temporaries: int = 0
    covers: str = "step"
    gradients_at_peak: int | None = None

    @property
    def state_bytes(self) -> int:
        """The weights, the optimizer's slots and the gradients."""
        return self.weights + self.optimizer_state + self.gradients

    @property
    def live_gradients(self) -> int:
        """The gradients live beside the activations at the backward
        pass's peak."""
        if self.gradients_at_peak is None:
            return self.gradients
        return self.gradients_at_peak

    @property
    def total_bytes(self) -> int:
        return int(self.with_state_split(1))

    def with_state_split(self, ways: int) -> float:
        """The total with the state, and the update that follows it, split
        over `ways` devices (`fsdp` over the batch axis); the activations
        stay whole."""
        backward = self.live_gradients / ways + self.activations
        update = (self.gradients + self.update_temporaries) / ways
        return (self.weights + self.optimizer_state) / ways + max(backward, update)


# What a `StepEstimate` counts.
STEP = "step"
STATE_ONLY = "state only"


def loss_chunks(
    plan, rows: int, sequence_length: int, vocabulary: int, output, trained: bool
) -> int:
    """The chunks of tokens a bound causal LM's step takes its loss in on
    a device holding `rows` sequences and `vocabulary` logits per token
    (`loss.chunks.chunk_count`), its output embedding `output` (a row of
    the plan) `trained` or frozen."""
    axes = plan.mesh_axes
    return chunk_count(
        rows,
        sequence_length,
        int(vocabulary),
        axes.size(axes.context_axis),
        output.device_bytes,
        output.device_bytes if trained else 0,
    )


def activation_terms(
    plan, batch_size: int, sequence_length: int, platform: str = "gpu"
) -> dict[str, float]:
    """Elements per device of each term of `ACTIVATION_FACTORS`, unweighted
    (bytes for the terms of weights: `WEIGHT_TERMS`), on the devices of
    `platform` (a platform or a named device).

    The logits are those of one chunk of tokens (`loss_chunks`): a bound
    causal LM's step never holds more. Where the devices attend one block
    of keys at a time (`per_device_kernel`: on a context mesh, and off one
    with splash on a TPU or the blockwise kernel on a CPU) the scores and
    masks are one block's, `b·H·s·KEY_BLOCK` and `b·s·KEY_BLOCK`, none kept
    for the backward pass; elsewhere XLA's `b·H·s²` per block.

    Example:
    ```python
    activation_terms(plan, 8, 2048)["scores"]  # b·H·s² / shards of H
    activation_terms(plan, 1, 32768, "v5e")["scores"]  # b·H·s·512
    ```
    """
    # The step a bound model runs: refused unless the context axis divides
    # the sequence; the batch padded to a multiple of the batch axis.
    step = runnable_step(plan.mesh_axes, batch_size, sequence_length)
    axes = plan.mesh_axes

    def shards(row, logicals=MODEL_PARALLEL):
        return device_shards(plan, row, logicals)

    def first(condition):
        return next((r for r in plan.rows if condition(r)), None)

    query = first(gives_head_shape)
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
    layers = num_blocks(plan)
    # Each device of the batch axis holds its share of the padded batch.
    b = step.rows // axes.size(axes.batch_axis)
    # With a context axis each device holds its block of every sequence;
    # only the keys and values are gathered whole for attention.
    s = sequence_length / axes.size(axes.context_axis)
    whole = sequence_length
    d = row_dim(output, "embed")
    h = row_dim(query, "head_dim")
    heads = row_dim(query, "heads")
    # Keys and values per token: a flat kernel's `kv_heads` axis carries
    # `kv_heads · head_dim` (SmolLM3's).
    kv_width = _width(key, h) if key is not None else heads * h
    q_shards = shards(query)
    kv_shards = shards(key) if key is not None else q_shards
    # The residual stream: split on the sequence with sequence parallelism.
    sequence_parallel = plan.sequence_parallel and sharding.sequence_parallel_spec(axes)
    split = axes.size(axes.model_axis) if sequence_parallel else 1

    def experts(row):
        return row_dim(row, "expert") if "expert" in row.logical_axes else 1

    vocabulary = row_dim(output, "vocab") / shards(output)
    # The output embedding is trained but under LoRA.
    head_trained = getattr(plan, "lora_rank", None) is None
    chunks = loss_chunks(plan, b, sequence_length, vocabulary, output, head_trained)
    logits = b * s / chunks * vocabulary
    gathering = (axes.batch_axis, axes.context_axis)

    def gathered_over(row):
        return math.prod(
            axes.size(axis) for axis in row.spec if axis and axis in gathering
        )

    gathered = [row for row in plan.rows if gathered_over(row) > 1]
    # A model axis that splits weights keeps the gathered copies, but of the
    # experts' kernels; without one each weight is gathered where it is used
    # (see `gathered_share`).
    split_by_model = axes.size(axes.model_axis) > 1
    kept = (
        [row for row in gathered if "expert" not in row.logical_axes]
        if split_by_model
        else []
    )

    scores = layers * b * heads * s * whole / shards(query, {"heads"})
    keys_held = whole
    kernel = per_device_kernel(plan, whole, platform, rows=b)
    # Splash attends heads of part lanes padded to whole ones (64 to 128):
    # its queries, keys and values, and what it keeps of them, grow so.
    lanes = splash_head_dim(h) / h if kernel == "splash" else 1
    if kernel is not None:
        # Attention per device holds one block of keys' scores at a time and
        # keeps none for the backward pass.
        keys_held = min(whole, KEY_BLOCK)
        scores = b * heads * s * keys_held / shards(query, {"heads"})
    # Splash keeps each query's log-sum-exp for its backward pass, in float32
    # over a lane of values.
    kernel_residuals = 0
    if kernel == "splash":
        kernel_residuals = layers * b * heads * s * SPLASH_RESIDUAL_LANES
        kernel_residuals /= shards(query, {"heads"})
    # The device's shares of the 16-bit float weights, and their float32 copies.
    upcast = [row for row in plan.rows if row.dtype in FLOAT16_DTYPES]

    def float32_bytes(row):
        return row.device_bytes // itemsize(row.dtype) * FLOAT32_BYTES

    return {
        "stream": layers * b * s * d / split,
        "attention": layers
        * lanes
        * (b * s * heads * h / q_shards + b * whole * kv_width / kv_shards),
        "scores": scores,
        "scores_one_block": scores / layers if keys_held == whole else scores,
        "kernel_residuals": kernel_residuals,
        "masks": layers * b * s * keys_held,
        "mlp": sum(b * s * row_dim(r, "mlp") * experts(r) / shards(r) for r in ups),
        "experts": sum(
            b * s * d * experts(r) / shards(r, {"expert"})
            for r in downs
            if "expert" in r.logical_axes
        ),
        "final": b * s * d / split,
        "logits": logits,
        "logits_whole": logits if shards(output) == 1 else 0,
        "logits_float32": logits,
        "logits_soft_cap": logits
        if getattr(plan, "final_logit_soft_cap", None) and shards(output) == 1
        else 0,
        "gathered_weights": sum(
            row.device_bytes * (gathered_over(row) - 1) for row in kept
        ),
        "gathered_share": 0
        if split_by_model
        else sum(row.device_bytes for row in gathered),
        "weights_float32": sum(float32_bytes(row) for row in upcast),
        "gathered_float32": sum(
            (float32_bytes(row) - row.device_bytes) * (gathered_over(row) - 1)
            for row in kept
            if row.dtype in FLOAT16_DTYPES
        ),
        "experts_relayout": sum(
            row.device_bytes
            for row in ups
            if "expert" in row.logical_axes and row.dtype == "float32"
        ),
        # A chunked loss sums a trained head's gradient over its chunks in
        # float32, beside each chunk's own (`loss.chunked_cross_entropy`).
        "chunked_head_gradient": float32_bytes(output)
        if chunks > 1 and head_trained
        else 0,
        # What a chunked step holds beyond the terms above, as many bytes
        # as the output embedding (`memory_factors`: fitted on a TPU, not
        # attributed to a buffer).
        "chunked_unattributed": output.device_bytes if chunks > 1 else 0,
    }


def step_estimate(
    plan,
    batch_size: int | None,
    sequence_length: int | None,
    optimizer: str = "adam",
    *,
    platform: str = "gpu",
    lora_rank: int | None = None,
) -> StepEstimate:
    """The calibrated closed-form bytes per device of a training step: the
    one memory answer every verdict comes from.

    Frozen weights (all but the LoRA kernels under LoRA; quantized kernels
    always) carry no gradient and no optimizer slot.

    Args:
        plan: a `LayoutPlan`.
        batch_size: the global batch size, split over the batch axis; with
            `sequence_length` `None`, the answer is for the weights,
            gradients and optimizer state alone (`covers == STATE_ONLY`).
        sequence_length: tokens per sequence.
        optimizer: a name of `trained_state.OPTIMIZERS`.
        platform: the devices' platform, `"gpu"` (default), `"tpu"` or
            `"cpu"`, whose compiler keeps different buffers
            (`ACTIVATION_FACTORS`), or a named device (`"t4"`, of
            `device_profiles.DEVICE_PROFILES`): its platform's factors and
            its own arithmetic (`FLOAT32_COMPUTE`).
        lora_rank: the rank of a LoRA fine-tune; defaults to the plan's
            (`plan.lora_rank`), `None` for full fine-tuning.

    Example:
    ```python
    plan = keras_hub_autodist.plan("./gemma_2b", {"batch": 1, "model": 1})
    step_estimate(plan, 4, 1024).total_bytes
    step_estimate(plan, None, None, lora_rank=4).covers  # "state only"
    ```
    """
    slots = optimizer_spec(optimizer).slots
    factors, _ = calibration_of(platform)
    if lora_rank is None:
        lora_rank = getattr(plan, "lora_rank", None)
    check_lora_rank(lora_rank)
    trained = trainable_bytes(
        plan.rows, plan.dtype, lora_rank, lambda row: row.device_bytes, plan.mesh_axes
    )
    weights = plan.max_device_bytes + (trained if lora_rank is not None else 0)
    state = StepEstimate(
        weights=weights,
        optimizer_state=slots * trained,
        gradients=trained,
        activations=0,
        covers=STATE_ONLY,
    )
    if batch_size is None and sequence_length is None:
        return state
    return dataclasses.replace(
        state,
        gradients_at_peak=int(GRADIENTS_AT_PEAK[factors] * trained),
        activations=activation_bytes(plan, batch_size, sequence_length, platform),
        update_temporaries=int(UPDATE_TEMPORARIES[factors] * trained),
        covers=STEP,
    )


def calibration_of(platform: str) -> tuple[str, tuple[str, ...]]:
    """The factors (a key of `ACTIVATION_FACTORS`) of a platform or a named
    device (its own where it has them, else its platform's), and the 16-bit
    float types its compiler computes in float32 (`FLOAT32_COMPUTE`: the
    device's own rule, else its platform's).

    Raises:
        PlanError: for a name that is neither.

    Example:
    >>> calibration_of("t4"), calibration_of("H100"), calibration_of("v5e")
    (('t4', ('bfloat16',)), ('gpu', ()), ('tpu', ()))
    """
    key = device_key(platform)
    if key in ACTIVATION_FACTORS:
        factors = key
    elif key in DEVICE_PROFILES:
        factors = DEVICE_PROFILES[key].platform
    else:
        raise PlanError(
            f"No memory calibration for {platform!r}; use a platform, one of "
            f"{sorted(ACTIVATION_FACTORS)}, or a named device, one of "
            f"{sorted(DEVICE_PROFILES)}. Received: platform={platform!r}"
        )
    return factors, FLOAT32_COMPUTE.get(key, FLOAT32_COMPUTE.get(factors, ()))


def _width(row, head_dim: int) -> int:
    """Elements per token of a key or value projection `row`: its
    `kv_heads` axis, times `head_dim` unless that axis carries it."""
    width = row.shape[row.logical_axes.index("kv_heads")]
    return width * head_dim if "head_dim" in row.logical_axes else width


def term_sizes(plan, platform: str = "gpu") -> dict[str, int]:
    """Bytes per element of each term of `activation_terms` (1 for the
    terms of weights, already in bytes) on `platform` or a named device
    (`calibration_of`): the model's dtype, or float32 where the compiler
    computes it so (`FLOAT32_COMPUTE`); the loss's logits in float32; the
    attention scores with float32 logits beside them for the architectures
    whose attention keeps both (`FLOAT32_SCORES`). The float32 copies of
    weights are 0 where the model's dtype is computed as such.

    Example:
    ```python
    term_sizes(plan, "t4")["stream"]  # 4 for a bfloat16 plan
    ```
    """
    factors, computed_in_float32 = calibration_of(platform)
    size = ITEMSIZES.get(plan.dtype, FLOAT32_BYTES)
    in_float32 = plan.dtype in computed_in_float32
    if in_float32:
        size = max(size, FLOAT32_BYTES)
    scores = size
    if plan.architecture in FLOAT32_SCORES.get(factors, ()):
        scores += FLOAT32_BYTES
    return {
        **dict.fromkeys(ACTIVATION_TERMS, size),
        "scores": scores,
        "scores_one_block": scores,
        "logits_float32": FLOAT32_BYTES,
        "logits_soft_cap": FLOAT32_BYTES,
        "kernel_residuals": FLOAT32_BYTES,
        **dict.fromkeys(WEIGHT_TERMS, 1),
        # No float32 copies of 16-bit weights where they are computed as such.
        **({} if in_float32 else dict.fromkeys(FLOAT32_COPY_TERMS, 0)),
    }


# The factors that differ from a calibration's where each device attends
# with splash, by where the sequence lies: whole on each device, or split
# on a context mesh (`kernel_factor_set`). `None`: the calibration's own.
KERNEL_FACTORS = {
    None: {},
    "splash": SPLASH_FACTORS,
    "context_splash": CONTEXT_SPLASH_FACTORS,
}


def kernel_factor_set(
    plan, batch_size: int, sequence_length: int, platform: str = "gpu"
) -> str | None:
    """Which of `KERNEL_FACTORS` weighs a step's activations: `"splash"`
    where each device attends a whole sequence with splash,
    `"context_splash"` where it attends its block of a context mesh's
    sequence with it, else `None`.

    Example:
    ```python
    kernel_factor_set(plan, 1, 32768, "v5e")  # 'splash'
    ```
    """
    axes = plan.mesh_axes
    rows = runnable_step(axes, batch_size, sequence_length).rows
    rows //= axes.size(axes.batch_axis)
    if per_device_kernel(plan, sequence_length, platform, rows=rows) != "splash":
        return None
    return "context_splash" if axes.size(axes.context_axis) > 1 else "splash"


def activation_bytes(
    plan, batch_size: int, sequence_length: int, platform: str = "gpu"
) -> int:
    """The activations a training step keeps for its backward pass, per
    device, with the factors of `platform` or a named device
    (`calibration_of`): each term's elements (`activation_terms`) times its
    bytes per element (`term_sizes`) times its factor.

    Example:
    ```python
    activation_bytes(plan, 8, 2048, "cpu")
    activation_bytes(plan, 1, 1024, "t4")
    ```
    """
    calibration = calibration_of(platform)[0]
    axes = plan.mesh_axes
    on_context_mesh = axes.size(axes.context_axis) > 1
    kernel_factors = KERNEL_FACTORS[
        kernel_factor_set(plan, batch_size, sequence_length, platform)
    ]
    factors = {**ACTIVATION_FACTORS[calibration], **kernel_factors.get(calibration, {})}
    terms = activation_terms(plan, batch_size, sequence_length, platform)
    sizes = term_sizes(plan, platform)
    weighted = {
        name: factors[name] * count * sizes[name] for name, count in terms.items()
    }
    if block_policy(getattr(plan, "remat", None)) is not None:
        return int(
            rematerialized_bytes(
                plan,
                terms,
                sizes,
                weighted,
                calibration,
                on_context_mesh,
                batch_size,
                sequence_length,
            )
        )
    return int(sum(weighted.values()))
