"""The arguments of `search.search()`, checked before anything is planned
or compiled: each of the wrong kind is refused with the package's error,
naming the argument, what it takes and what it received.

Imports neither Keras nor JAX.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from keras_hub_autodist.errors import PlanError
from keras_hub_autodist.fitting.trained_state import OPTIMIZERS
from keras_hub_autodist.planning.options import CONTEXT_PARALLEL_STRATEGIES
from keras_hub_autodist.planning.options import check_lora_rank
from keras_hub_autodist.planning.remat_arguments import check_remat
from keras_hub_autodist.planning.sharding import STRATEGIES


@dataclasses.dataclass(frozen=True)
class SearchedStep:
    """The training step a search lays out: what every candidate is
    planned, costed and compiled with, whatever its mesh, strategy, remat
    and batch.

    Args:
        preset: as for `search()`.
        device: the named device the step is laid out for.
        sequence_length: tokens per sequence.
        optimizer: the optimizer's name (`trained_state.OPTIMIZERS`).
        lora_rank: the LoRA rank trained, or `None`.
        dtype: the dtype (policy) planned, or `None` for the preset's.
        context_parallel_strategy: how the candidates with a context axis
            pass keys and values.

    Example:
    >>> SearchedStep("./gemma_2b", "v5e", 2048, "adam", None, None,
    ...     "all_gather").device
    'v5e'
    """

    preset: str | os.PathLike | Mapping
    device: str
    sequence_length: int
    optimizer: str
    lora_rank: int | None
    dtype: str | None
    context_parallel_strategy: str

    def plan_options(self) -> dict:
        """The options of `plan()` that every candidate is planned with."""
        return {
            "device_memory": self.device,
            "lora_rank": self.lora_rank,
            "dtype": self.dtype,
            "context_parallel_strategy": self.context_parallel_strategy,
        }


def _is_count(value, least: int) -> bool:
    """Whether `value` is an `int` (not a `bool`) of at least `least`."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def positive_int(name: str, value, example: str) -> int:
    """`value` when it is a positive `int`, else a `PlanError` naming `name`.

    Example:
    >>> positive_int("devices", 8, "8")
    8
    """
    if not _is_count(value, 1):
        raise PlanError(
            f"search() takes `{name}` as a positive integer, e.g. {name}={example}. "
            f"Received: {name}={value!r} ({type(value).__name__})"
        )
    return value


def choices(name: str, values, allowed, example: str) -> tuple:
    """`values` as a non-empty tuple of members of `allowed`, else a
    `PlanError` naming `name`.

    Example:
    >>> choices("strategies", ["fsdp"], ("tp", "fsdp"), '("tp",)')
    ('fsdp',)
    """
    if isinstance(values, (str, bytes, Mapping)) or not hasattr(values, "__iter__"):
        found = None
    else:
        found = tuple(values)
    if not found or any(v not in allowed for v in found):
        raise PlanError(
            f"search() takes `{name}` as a non-empty sequence of "
            f"{', '.join(map(repr, allowed))}, e.g. {name}={example}. "
            f"Received: {name}={values!r}"
        )
    return found


def check_search_inputs(
    *,
    preset,
    device,
    devices,
    batch_size,
    sequence_length,
    lora_rank,
    dtype,
    optimizer,
    strategies,
    per_device_batch=None,
    gradient_accumulation=True,
    remats,
    max_compiles,
    cache_dir,
    context_parallel_strategy,
) -> tuple[tuple, tuple]:
    """Check every argument of `search()` for its kind.

    Returns:
        `(strategies, remats, per_device)`: the first two as tuples, each
        remat checked as `remat=` is; the per-device range as `(low,
        high)`, or `None` with a global batch (`check_batches`).

    Raises:
        PlanError: naming the first argument of the wrong kind.
    """
    if not isinstance(preset, (str, os.PathLike, Mapping)):
        raise PlanError(
            "search() takes `preset` as a folder, an hf:// or kaggle:// handle, "
            "a preset name or a config dict. Received: "
            f"preset={preset!r} ({type(preset).__name__})"
        )
    if not isinstance(device, str):
        raise PlanError(
            "search() takes `device` as a device's name, e.g. device='v5e'. "
            f"Received: device={device!r} ({type(device).__name__})"
        )
    positive_int("devices", devices, "8")
    per_device = check_batches(batch_size, per_device_batch)
    if not isinstance(gradient_accumulation, bool):
        raise PlanError(
            "search() takes `gradient_accumulation` as True (a global batch "
            "is also tried as micro-steps whose gradients accumulate) or "
            f"False. Received: gradient_accumulation={gradient_accumulation!r}"
        )
    positive_int("sequence_length", sequence_length, "2048")
    check_lora_rank(lora_rank)
    if dtype is not None and not isinstance(dtype, str):
        raise PlanError(
            "search() takes `dtype` as a dtype's name (e.g. 'bfloat16') or "
            f"None for the preset's. Received: dtype={dtype!r}"
        )
    if not isinstance(optimizer, str) or optimizer not in OPTIMIZERS:
        raise PlanError(
            f"search() takes `optimizer` as one of {sorted(OPTIMIZERS)}. "
            f"Received: optimizer={optimizer!r}"
        )
    strategies = choices("strategies", strategies, STRATEGIES, '("tp", "fsdp")')
    given = remats
    if isinstance(given, (str, bytes, Mapping)) or not hasattr(given, "__iter__"):
        remats = None
    else:
        remats = tuple(given)
    if not remats:
        raise PlanError(
            "search() takes `remats` as a non-empty sequence of remat settings "
            '(None: off, "dots", "full"), e.g. remats=(None, "full"). Received: '
            f"remats={given!r}"
        )
    for remat in remats:
        check_remat(remat)
    if not _is_count(max_compiles, 0):
        raise PlanError(
            "search() takes `max_compiles` as an integer of 0 or more. "
            f"Received: max_compiles={max_compiles!r}"
        )
    if cache_dir is not None and not isinstance(cache_dir, (str, os.PathLike)):
        raise PlanError(
            "search() takes `cache_dir` as a folder's path, or None for the "
            f"default. Received: cache_dir={cache_dir!r}"
        )
    if context_parallel_strategy not in CONTEXT_PARALLEL_STRATEGIES:
        raise PlanError(
            "search() takes `context_parallel_strategy` as one of "
            f"{list(CONTEXT_PARALLEL_STRATEGIES)}. Received: "
            f"context_parallel_strategy={context_parallel_strategy!r}"
        )
    return strategies, remats, per_device


def check_batches(batch_size, per_device_batch) -> tuple[int, int] | None:
    """`batch_size` and `per_device_batch` checked together: one of them,
    a global batch (a positive integer or `"auto"`) or a per-device range;
    the range as `(low, high)` (`None` with a global batch).

    Example:
    >>> check_batches(None, (1, 16)), check_batches(None, 4)
    ((1, 16), (4, 4))
    >>> check_batches(8, None) is None
    True
    """
    if per_device_batch is None:
        if batch_size is None:
            raise PlanError(
                "search() takes a global batch (batch_size=8, or 'auto' for "
                "the largest that fits) or a range of batches per device "
                "(per_device_batch=(1, 16)). Received: batch_size=None, "
                "per_device_batch=None"
            )
        if batch_size != "auto" and not _is_count(batch_size, 1):
            raise PlanError(
                "search() takes a positive batch size, or 'auto' for the "
                f"largest that fits. Received: batch_size={batch_size!r}"
            )
        return None
    if batch_size is not None:
        raise PlanError(
            "search() takes a global batch or a range of batches per device, "
            "not both: drop batch_size= or per_device_batch=. Received: "
            f"batch_size={batch_size!r}, per_device_batch={per_device_batch!r}"
        )
    value = per_device_batch
    if _is_count(value, 1):
        return (value, value)
    if (
        isinstance(value, (tuple, list))
        and len(value) == 2
        and all(_is_count(v, 1) for v in value)
        and value[0] <= value[1]
    ):
        return (value[0], value[1])
    raise PlanError(
        "search() takes `per_device_batch` as a positive integer or a range "
        "(low, high) of them, low <= high, e.g. per_device_batch=(1, 16). "
        f"Received: per_device_batch={value!r}"
    )


__all__ = [
    "SearchedStep",
    "check_batches",
    "check_search_inputs",
    "choices",
    "positive_int",
]
