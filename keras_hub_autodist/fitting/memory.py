"""Memory: what a plan needs of each device (what each device has is
`device_memory.py`), answered by the one memory model, `step_memory`.

- `training_bytes_per_device`: weights, gradients and optimizer state (of
  the trained weights only: the LoRA kernels under LoRA).
- `activation_bytes_per_device`: the activations a training step saves for
  its backward pass, in closed form, for a platform.
- `fits`: whether that state fits each device.

These are pure functions of a plan's values; `LayoutPlan` offers them as
methods.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from keras_hub_autodist.fitting import step_memory

if TYPE_CHECKING:
    from keras_hub_autodist.planning.plan_record import PlanRecord


def training_bytes_per_device(plan: PlanRecord, optimizer: str = "adam") -> int:
    """Estimated per-device bytes of weights + gradients + optimizer state.

    Activations are not included. Frozen weights (all but the LoRA kernels
    of a plan with `lora_rank`; quantized kernels) carry no gradient and no
    optimizer state.

    Args:
        plan: the `LayoutPlan`.
        optimizer: a name of `trained_state.OPTIMIZERS`: `"adam"` (two
            moments), `"sgd"` (none) or `"sgd_momentum"` (one).
    """
    return step_memory.step_estimate(plan, None, None, optimizer).total_bytes


def fits(plan: PlanRecord) -> bool:
    """Whether weights, gradients and Adam state fit each device (no
    batch: activations are not counted)."""
    return training_bytes_per_device(plan, "adam") <= plan.device_memory_bytes


def activation_bytes_per_device(
    plan: PlanRecord, batch_size: int, sequence_length: int, platform: str = "cpu"
) -> int:
    """Estimated per-device bytes of the activations a training step
    saves for its backward pass (`step_memory.activation_bytes`).

    Counted for a decoder of `L` blocks with hidden size `d`, `H` query and
    `K` key/value heads of size `h`, gated MLP width `F`, vocabulary `V`, on
    `b = batch_size / size of the batch axis` sequences (rounded up: a batch
    is padded to the batch axis) of `s` tokens, each
    term times its factor for `platform` (`memory_factors.ACTIVATION_FACTORS`;
    on CPU):

    - per block: `4·b·s·d` (block input, attention-norm output, residual
      after attention, MLP-norm output), `b·s·(2H + 2K)·h` (query, key,
      value, attention context), `4·b·H·s²` (attention scores, mask,
      softmax and its gradient), `2·b·s·F` per up-projection of width `F`
      (its output, and the activation or gated product), times `E` for a
      mixture of `E` experts (keras-hub runs every expert on every token),
      plus `E·b·s·d` for the experts' outputs before the weighted sum;
    - after the blocks: `2·b·s·d` (final norm in and out) and `3·b·s·V`
      (logits, their softmax and their gradient).

    Each term is divided by the shards the plan gives it on the model
    axes: head terms by those of the query (or key/value) kernel's head
    dimensions, MLP terms by those of each up-projection's `mlp` and
    `expert` dimensions, logits by those of the output embedding's vocabulary;
    the residual stream is replicated over the model axis, or split over
    it with `sequence_parallel`. A context axis of `c` devices divides `s`
    by `c` in every term but the keys and values, which attention gathers
    whole (the scores are `b·H·(s/c)·s`). Gradients
    and optimizer state are not included (`training_bytes_per_device`).

    Args:
        batch_size: the global batch size, split over the batch axis.
        sequence_length: tokens per sequence; a length the context axis
            doesn't divide raises `SequenceLengthError`, as `fit` does.
        platform: `"cpu"` (default), `"gpu"` or `"tpu"`.

    Example:
    ```python
    plan = keras_hub_autodist.plan("./gemma_2b", {"batch": 2, "model": 4})
    activation_bytes_per_device(plan, batch_size=8, sequence_length=2048)
    ```
    """
    return step_memory.activation_bytes(plan, batch_size, sequence_length, platform)


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
