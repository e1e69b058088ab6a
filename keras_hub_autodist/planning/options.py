"""`PlanOptions`: the planning options, declared and validated in one place.

`plan()`, `get_layout_map()`, `from_preset(device_mesh=...)` and the CLI take
explicit keyword arguments and turn them into one frozen `PlanOptions`; every
later step of the data path reads that value, never a module-level mode.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

from keras_hub_autodist.errors import ArgumentError
from keras_hub_autodist.errors import MeshError
from keras_hub_autodist.errors import PlanError
from keras_hub_autodist.errors import StrategyError
from keras_hub_autodist.errors import option
from keras_hub_autodist.planning.remat_arguments import check_remat
from keras_hub_autodist.planning.sharding import STRATEGIES
from keras_hub_autodist.reading.dtypes import check_dtype

STRATEGY_CHOICES = ("auto",) + STRATEGIES

# How keys and values reach each device's queries on a context mesh:
# gathered whole over the context axis before attending (the default: one
# collective per layer), or passed around it block by block (a device holds
# its own block and the one arriving, not the whole sequence's). The
# attention stage (`keras_hub_autodist.attention`) runs each.
CONTEXT_PARALLEL_STRATEGIES = ("all_gather", "ring")


@dataclasses.dataclass(frozen=True)
class Option:
    """One option of the distribution API, declared once.

    Args:
        name: the keyword.
        default: its default everywhere it is taken.
        doc: what it does, for the documentation `from_preset` gains.
        planning: whether it is a field of `PlanOptions` (and a keyword of
            `plan()`).
        from_preset: whether `from_preset(device_mesh=...)` takes it (the
            plugin passes every other keyword on to keras-hub).
        instead: for an option of `plan()` alone that keras-hub's
            `from_preset` does not take either: what a load does instead
            (`from_preset` refuses it with this).
    """

    name: str
    default: Any
    doc: str
    planning: bool = True
    from_preset: bool = True
    instead: str | None = None


OPTIONS = (
    Option("strategy", "auto", '`"auto"` (default), `"tp"` or `"fsdp"`.'),
    Option("batch_axis", None, "mesh axis of the batch, if not `batch`/`data`."),
    Option("model_axis", None, "mesh axis of the weights, if not `model`/`tensor`."),
    Option(
        "context_axis",
        None,
        "mesh axis that splits each sequence (context parallelism), if not `context`.",
    ),
    Option(
        "context_parallel_strategy",
        "all_gather",
        'how keys and values reach each device on a context axis: `"all_gather"` '
        '(default: the whole sequence\'s at once) or `"ring"` (block by block '
        "around the axis; holds one block, not the sequence).",
    ),
    Option(
        "dtype",
        None,
        "the dtype (policy) the model is loaded with; keras-hub's own keyword.",
        from_preset=False,
    ),
    Option(
        "device_memory",
        None,
        "bytes per device; default: asked of the devices or the environment.",
        from_preset=False,
        instead="a load has the devices' own memory",
    ),
    Option(
        "lora_rank",
        None,
        "plan a LoRA fine-tune of this rank (`enable_lora(rank)`): only the "
        "LoRA kernels carry gradients and optimizer state (default `None`: "
        "full fine-tuning).",
        from_preset=False,
        instead="load, then call `lm.backbone.enable_lora(rank)`",
    ),
    Option(
        "remat",
        None,
        'rematerialization: a block policy (`"full"`: each decoder block '
        'keeps its inputs; `"dots"`: also its weight matmuls\' outputs), '
        'a `keras.RematScope` mode (`"larger_than"`, '
        '`"list_of_layers"`) or a dict of its arguments; the training step '
        "recomputes the rest in the backward pass instead of keeping it "
        '(default `None`). `from_preset(device_mesh="auto")` also takes '
        "`\"auto\"`: the layout search's winner's (off where no search runs).",
    ),
    Option(
        "progress",
        None,
        "show a progress bar while loading (default: on a terminal, unless "
        "`KERAS_HUB_AUTODIST_PROGRESS=0`).",
        planning=False,
    ),
    Option(
        "strict",
        True,
        "`True` (default): a weight that no layout rule matches is an error; "
        "`False`: a warning, the weight is replicated.",
    ),
    Option(
        "sequence_parallel",
        False,
        "shard residual-stream activations on the sequence over the model "
        "axis (default `False`).",
    ),
)
# The keywords `from_preset(device_mesh=...)` takes besides `device_mesh`.
DISTRIBUTION_KEYWORDS = tuple(o.name for o in OPTIONS if o.from_preset)
# Options of `plan()` that a load refuses → what it does instead.
PLAN_ONLY_KEYWORDS = {o.name: o.instead for o in OPTIONS if o.instead}
# The keywords of `plan()` besides the preset and the mesh, and the fields of
# `PlanOptions` (a test ties the dataclass to this list).
PLANNING_KEYWORDS = tuple(o.name for o in OPTIONS if o.planning)


# `remat=` asking the layout search for its winner's rematerialization:
# only `from_preset(..., device_mesh="auto")` searches (`split_auto_remat`).
AUTO_REMAT = "auto"


# The largest per-device memory a plan accepts: 1 PiB, far above any device,
# so that a typo (1e300) is an error rather than an overflow.
MAX_DEVICE_MEMORY_BYTES = 2**50


@dataclasses.dataclass(frozen=True)
class PlanOptions:
    """How to plan a model's layout.

    Args:
        strategy: `"auto"`, `"tp"` or `"fsdp"` (see `plan()`).
        batch_axis: the mesh axis that splits batches, if not
            `batch`/`data`.
        model_axis: the mesh axis that shards weights, if not
            `model`/`tensor`.
        context_axis: the mesh axis that splits each sequence, if not
            `context`.
        context_parallel_strategy: how keys and values reach each device
            on a context axis (`CONTEXT_PARALLEL_STRATEGIES`): `"all_gather"`
            or `"ring"`.
        dtype: the float dtype or mixed-precision policy the model will be
            loaded with (`reading.dtypes.ACCEPTED_DTYPES`); `None`: Keras'
            global policy, as keras-hub's `from_preset` loads a preset.
        device_memory: bytes per device, or the name of a device (e.g.
            `"t4"`, which `plan()` looks up); `None`: asked of
            the devices, the environment, or assumed
            (`device_memory.device_memory_info`).
        lora_rank: the rank of a LoRA fine-tune; `None`: full fine-tuning.
        remat: the rematerialization of the training step (`None`, a
            block policy of `remat_arguments.BLOCK_POLICIES`, a
            `keras.RematScope` mode, or a dict of its arguments).
        sequence_parallel: shard residual-stream activations on the
            sequence over the model axis.
        strict: a weight that matches no rule is an error (`True`) or a
            warning, the weight staying replicated (`False`).

    Example:
    >>> PlanOptions(strategy="fsdp").strategy
    'fsdp'
    """

    strategy: str = "auto"
    batch_axis: str | None = None
    model_axis: str | None = None
    context_axis: str | None = None
    context_parallel_strategy: str = "all_gather"
    dtype: Any = None
    device_memory: int | str | None = None
    lora_rank: int | None = None
    remat: Any = None
    sequence_parallel: bool = False
    strict: bool = True

    def __post_init__(self):
        if self.strategy not in STRATEGY_CHOICES:
            raise StrategyError(
                f"Unknown strategy. Use one of {list(STRATEGY_CHOICES)}. "
                f"Received: strategy={self.strategy!r}"
            )
        for name in ("batch_axis", "model_axis", "context_axis"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise MeshError(
                    f"{option(name)} names a mesh axis (a string) or is None. "
                    f"Received: {name}={value!r}"
                )
        check_strict(self.strict)
        if self.context_parallel_strategy not in CONTEXT_PARALLEL_STRATEGIES:
            raise StrategyError(
                "`context_parallel_strategy` is how keys and values reach "
                'each device on a context axis: "all_gather" (the whole '
                'sequence\'s at once) or "ring" (block by block). Received: '
                f"context_parallel_strategy={self.context_parallel_strategy!r}"
            )
        if not isinstance(self.sequence_parallel, bool):
            raise StrategyError(
                "`sequence_parallel` is True (shard residual-stream activations "
                "on the sequence over the model axis) or False. Received: "
                f"sequence_parallel={self.sequence_parallel!r}"
            )
        check_dtype(self.dtype)
        check_lora_rank(self.lora_rank)
        if isinstance(self.remat, str) and self.remat == AUTO_REMAT:
            raise PlanError(
                "remat='auto' lets the layout search choose rematerialization, "
                "and only from_preset(..., device_mesh='auto') searches: pass "
                "both there, or name a remat here (None, 'full', ...). "
                f"Received: remat={self.remat!r}"
            )
        check_remat(self.remat)
        # A device's name is looked up where its memory is: the fitting
        # stage (`device_profiles.device_profile`).
        if self.device_memory is not None and not isinstance(self.device_memory, str):
            object.__setattr__(
                self, "device_memory", device_memory_bytes(self.device_memory)
            )


def split_auto_remat(device_mesh, remat) -> tuple[Any, bool]:
    """`from_preset`'s `remat=` before it is checked (`check_remat`):
    `(remat, searched)`. `"auto"` is `(None, True)`: the layout search
    (`searching.auto_mesh`) chooses among the remats it searches, and
    without a search (a CPU, a device it doesn't know, the search off) it
    stays off; any other value is `(remat, False)`.

    Raises:
        PlanError: for `remat="auto"` with a `device_mesh` other than
            `"auto"`: only that one searches.

    Example:
    >>> split_auto_remat("auto", "auto")
    (None, True)
    >>> split_auto_remat({"batch": 2}, "full")
    ('full', False)
    """
    if not (isinstance(remat, str) and remat == AUTO_REMAT):
        return remat, False
    if isinstance(device_mesh, str) and device_mesh == "auto":
        return None, True
    raise PlanError(
        "remat='auto' lets the layout search choose rematerialization, and "
        "it searches only with device_mesh='auto': pass device_mesh='auto', "
        "or name a remat (None, 'full', ...). Received: "
        f"device_mesh={device_mesh!r}, remat={remat!r}"
    )


def check_strict(strict) -> bool:
    """`strict=` checked: a bool.

    Example:
    >>> check_strict(False)
    False
    """
    if not isinstance(strict, bool):
        raise PlanError(
            "`strict` is True (a weight that no layout rule matches is an "
            "error) or False (a warning; the weight stays replicated). "
            f"Received: strict={strict!r}"
        )
    return strict


def check_lora_rank(lora_rank) -> int | None:
    """`lora_rank=` checked: `None` (full fine-tuning) or a positive int.

    Example:
    >>> check_lora_rank(4)
    4
    """
    if lora_rank is not None and (
        isinstance(lora_rank, bool) or not isinstance(lora_rank, int) or lora_rank < 1
    ):
        raise PlanError(
            "`lora_rank` is the rank of a LoRA fine-tune (a positive integer, "
            "e.g. 4, as for `backbone.enable_lora(4)`) or None for full "
            f"fine-tuning. Received: lora_rank={lora_rank!r}"
        )
    return lora_rank


def device_memory_bytes(value) -> int:
    """`value`, a number of bytes per device, checked and made an `int`.

    Example:
    >>> device_memory_bytes(16 * 1024**3)
    17179869184
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise PlanError(
            "`device_memory` is a number of bytes per device, e.g. "
            f"16 * 1024**3. Received: device_memory={value!r}"
        )
    if isinstance(value, numbers.Integral):
        valid = 0 < value <= MAX_DEVICE_MEMORY_BYTES
    else:
        valid = math.isfinite(value) and 0 < value <= MAX_DEVICE_MEMORY_BYTES
    if not valid:
        raise PlanError(
            f"{option('device_memory')} must be a positive amount of memory "
            f"per device, at most {MAX_DEVICE_MEMORY_BYTES} bytes (1 PiB). "
            f"Received: device_memory={repr(value)[:60]}"
        )
    return int(value)


def progress_option(progress) -> bool | None:
    """`progress=` checked: `True`, `False`, or `None` (on a terminal).

    Example:
    >>> progress_option(None) is None
    True
    """
    if progress is not None and not isinstance(progress, bool):
        raise ArgumentError(
            "`progress` is True (show a progress bar while loading), False, "
            f"or None (on a terminal). Received: progress={progress!r}"
        )
    return progress
