"""Memory: what each device has, and what a plan needs of it.

- `device_memory_info`: the per-device memory planning assumes, and where it
  comes from (given, the environment, reported by the devices, assumed).
- `training_bytes_per_device`: weights, gradients and optimizer state.
- `activation_bytes_per_device`: the activations a training step saves for
  its backward pass, in closed form.

These are pure functions of a plan's values; `LayoutPlan` offers them as
methods.
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING

from keras_hub_autodist import step_memory
from keras_hub_autodist.dtypes import itemsize
from keras_hub_autodist.errors import MeshError
from keras_hub_autodist.errors import PlanError
from keras_hub_autodist.options import device_memory_bytes

if TYPE_CHECKING:
    from keras_hub_autodist.plan import LayoutPlan

GIB = 1024**3
GB = 1000**3
# The per-device memory in GiB, like the CLI's `--device-memory`.
DEVICE_MEMORY_ENV = "KERAS_HUB_AUTODIST_DEVICE_MEMORY_GIB"
# The same in gigabytes (10^9 bytes), as its name says.
DEVICE_MEMORY_GB_ENV = "KERAS_HUB_AUTODIST_DEVICE_MEMORY_GB"
# Per-device memory assumed when the backend reports none (CPU, or planning
# for a mesh given as a mapping): 16 GiB, as on a T4 or a TPU v3 core.
DEFAULT_DEVICE_MEMORY_BYTES = 16 * GIB
# Where the per-device memory of a plan comes from
# (`LayoutPlan.device_memory_source`).
MEMORY_GIVEN, MEMORY_ENV, MEMORY_REPORTED, MEMORY_ASSUMED = (
    "given",
    "env",
    "reported",
    "assumed",
)
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


def device_memory_info(devices=(), override=None) -> tuple[int, str]:
    """Per-device memory for planning, and where it comes from.

    In order: `override` (`"given"`); `$KERAS_HUB_AUTODIST_DEVICE_MEMORY_GIB`
    (GiB) or `$KERAS_HUB_AUTODIST_DEVICE_MEMORY_GB` (10^9 bytes) (`"env"`):
    what you state wins over what the devices report; the smallest
    `bytes_limit` that `devices` report (`"reported"`); else
    `DEFAULT_DEVICE_MEMORY_BYTES`, 16 GiB (`"assumed"`).

    Args:
        devices: JAX devices to ask (only this process's devices answer).
        override: bytes to use as-is.

    Example:
    >>> device_memory_info([], 8 * 1024**3)
    (8589934592, 'given')
    """
    if override is not None:
        return device_memory_bytes(override), MEMORY_GIVEN
    for name, unit in ((DEVICE_MEMORY_ENV, GIB), (DEVICE_MEMORY_GB_ENV, GB)):
        from_env = os.environ.get(name)
        if from_env:
            return _from_environment(name, from_env, unit), MEMORY_ENV
    limits = []
    for device in devices:
        try:
            # Only this process's devices can report (multi-host meshes).
            if device not in device.client.local_devices():
                continue
            stats = device.memory_stats()
        except Exception:  # backends without memory statistics
            stats = None
        if stats and stats.get("bytes_limit"):
            limits.append(stats["bytes_limit"])
    if limits:
        return min(limits), MEMORY_REPORTED
    return DEFAULT_DEVICE_MEMORY_BYTES, MEMORY_ASSUMED


def _from_environment(name: str, text: str, unit: int) -> int:
    units = "GiB" if unit == GIB else "GB (10^9 bytes)"
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not math.isfinite(value) or value <= 0 or value * unit > 2**50:
        raise MeshError(
            f"${name} must be a number of {units} above 0 and at most a "
            f"PiB, e.g. 16. Received: {name}={text!r}"
        )
    return int(value * unit)


def training_bytes_per_device(plan: LayoutPlan, optimizer: str = "adam") -> int:
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


def activation_bytes_per_device(
    plan: LayoutPlan, batch_size: int, sequence_length: int
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
