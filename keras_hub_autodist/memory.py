"""Memory: what a plan needs of each device (what each device has is
`device_memory.py`).

- `training_bytes_per_device`: weights, gradients and optimizer state.
- `activation_bytes_per_device`: the activations a training step saves for
  its backward pass, in closed form.

These are pure functions of a plan's values; `LayoutPlan` offers them as
methods.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from keras_hub_autodist import step_memory
from keras_hub_autodist.dtypes import itemsize
from keras_hub_autodist.errors import PlanError

if TYPE_CHECKING:
    from keras_hub_autodist.plan_record import PlanRecord

# Bytes per parameter byte while training: the weight, its gradient and the
# optimizer's state, all in the variable dtype.
OPTIMIZER_STATE_FACTORS = {"adam": 4, "sgd": 2, "sgd_momentum": 3}
ADAM_STATE_FACTOR = OPTIMIZER_STATE_FACTORS["adam"]
# How many tensors of each of `step_memory.activation_terms` a training step
# saves for its backward pass, by the model's own graph (no compiler's
# fusion or copies: `step_memory.ACTIVATION_FACTORS` has those, per
# platform).
SAVED_ACTIVATIONS = {
    "stream": 4,
    "attention": 2,
    "scores": 2,
    "mlp": 2,
    "experts": 1,
    "final": 2,
    "logits": 3,
    "logits_float32": 0,
}


def training_bytes_per_device(plan: PlanRecord, optimizer: str = "adam") -> int:
    """Estimated per-device bytes of weights + gradients + optimizer state.

    Activations are not included.

    Args:
        plan: the `LayoutPlan`.
        optimizer: `"adam"` (two moments), `"sgd"` (none) or
            `"sgd_momentum"` (one).
    """
    if optimizer not in OPTIMIZER_STATE_FACTORS:
        raise PlanError(
            f"Unknown optimizer for the memory estimate. Use one of "
            f"{sorted(OPTIMIZER_STATE_FACTORS)}. Received: optimizer={optimizer!r}"
        )
    return OPTIMIZER_STATE_FACTORS[optimizer] * plan.max_device_bytes


def fits(plan: PlanRecord) -> bool:
    """Whether weights, gradients and Adam state fit each device."""
    return training_bytes_per_device(plan, "adam") <= plan.device_memory_bytes


def activation_bytes_per_device(
    plan: PlanRecord, batch_size: int, sequence_length: int
) -> int:
    """Estimated per-device bytes of the activations a training step
    saves for its backward pass.

    Counted in the plan's dtype, for a decoder of `L` blocks with hidden
    size `d`, `H` query and `K` key/value heads of size `h`, gated MLP
    width `F`, vocabulary `V`, on
    `b = batch_size / size of the batch axis` sequences of `s` tokens:

    - per block: `4·b·s·d` (block input, attention-norm output, residual
      after attention, MLP-norm output), `b·s·(2H + 2K)·h` (query, key,
      value, attention context), `2·b·H·s²` (attention scores and their
      softmax), `2·b·s·F` per up-projection of width `F` (its output,
      and the activation or gated product), times `E` for a mixture of
      `E` experts (keras-hub runs every expert on every token), plus
      `E·b·s·d` for the experts' outputs before the weighted sum;
    - after the blocks: `2·b·s·d` (final norm in and out) and `3·b·s·V`
      (logits, their softmax and their gradient).

    Each term is divided by the shards the plan gives it on the model
    axes: head terms by those of the query (or key/value) kernel's head
    dimensions, MLP terms by those of each up-projection's `mlp` and
    `expert` dimensions, logits by those of the output embedding's vocabulary;
    the residual stream is replicated over the model axis, or split over
    it with `sequence_parallel`. Gradients
    and optimizer state are not included (`training_bytes_per_device`).

    Args:
        batch_size: the global batch size, split over the batch axis.
        sequence_length: tokens per sequence.

    Example:
    ```python
    plan = keras_hub_autodist.plan("./gemma_2b", {"batch": 2, "model": 4})
    activation_bytes_per_device(plan, batch_size=8, sequence_length=2048)
    ```
    """
    terms = step_memory.activation_terms(plan, batch_size, sequence_length)
    saved = sum(SAVED_ACTIVATIONS[name] * count for name, count in terms.items())
    return int(saved * itemsize(plan.dtype))
