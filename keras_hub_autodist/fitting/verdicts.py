"""The closed form's one fit verdict for a step: yes, NO, or maybe.

The closed form is within a measured share of the compiled peak on the
families it was not fitted to (`ESTIMATE_MARGIN` short of it,
`OVER_ESTIMATE_MARGIN` above it): a step is yes when its estimate plus
the shortfall fits the device, NO when its estimate less the excess does
not, and maybe between, where only compiling the step settles it. On a
CPU the estimate is exact. The TPU compiler rematerializes activations
when a program is short of memory: a step the estimate says is too large
may still run (Gemma 2B's LoRA step of 8 x 1024 tokens, estimated at 26.85
GiB, runs on a v5e chip in 14.69 GiB). There NO needs even the least the
step could need (`least_step_bytes`: every block's activations
rematerialized) not to fit.
"""

from __future__ import annotations

import dataclasses

from keras_hub_autodist.fitting import step_memory
from keras_hub_autodist.fitting.memory_factors import ESTIMATE_MARGIN
from keras_hub_autodist.fitting.memory_factors import FLOAT32_BYTES
from keras_hub_autodist.fitting.memory_factors import OVER_ESTIMATE_MARGIN
from keras_hub_autodist.fitting.remat_memory import BLOCK_TERMS

YES, MAYBE, NO = "yes", "maybe", "NO"
# The platforms whose compiler fits a step that is short of memory by
# rematerializing activations (XLA's TPU compiler does by default).
REMATERIALIZING_PLATFORMS = ("tpu",)


@dataclasses.dataclass(frozen=True)
class StepVerdict:
    """The closed form's verdict on a step.

    Args:
        answer: `YES`, `MAYBE` or `NO`.
        estimate: the closed-form estimate (`step_memory.StepEstimate`).
        least_bytes: the least the step could need per device: the
            estimate's total less its excess (`OVER_ESTIMATE_MARGIN`), and
            no more than `least_step_bytes` where the compiler
            rematerializes; the total itself without a step.
        capacity: the bytes per device the verdict holds it to.
        margin: how far the estimate may fall short of the compiled peak
            on this platform (`ESTIMATE_MARGIN`); "yes" needs the
            estimate plus this share to fit.
        over_margin: how far it may exceed it (`OVER_ESTIMATE_MARGIN`);
            NO needs the estimate less this share not to fit.

    Example:
    ```python
    verdict = step_verdict(plan, 8, 1024, platform="v5e")
    verdict.answer  # "maybe"
    ```
    """

    answer: str
    estimate: step_memory.StepEstimate
    least_bytes: int
    capacity: int
    margin: float = 0.0
    over_margin: float = 0.0

    @property
    def fits(self) -> bool | None:
        """`True` for yes, `False` for NO, `None` for maybe."""
        return {YES: True, NO: False}.get(self.answer)


def platform_of(plan, platform: str | None = None) -> str:
    """The compiler whose buffers a verdict counts: `platform` when given,
    else the named device the plan was made for, else a GPU's.

    Example:
    ```python
    platform_of(keras_hub_autodist.plan(..., device_memory="v5e"))  # "v5e"
    ```
    """
    return platform or getattr(plan, "device_name", "") or "gpu"


def rematerializes(platform: str) -> bool:
    """Whether the compiler of `platform` (or of a named device) fits a
    step that is short of memory by rematerializing activations.

    Example:
    >>> rematerializes("v5e"), rematerializes("h100"), rematerializes("tpu")
    (True, False, True)
    """
    return step_memory.calibration_of(platform)[0] in REMATERIALIZING_PLATFORMS


def least_activation_bytes(
    plan, batch_size: int, sequence_length: int, platform: str
) -> int:
    """The least activation bytes a training step holds at once per device,
    however much the compiler rematerializes: each block's input, kept for
    its recomputation (one residual-stream buffer per block), and beside
    them the larger of the loss's float32 logits (one buffer: the loss and
    its gradient are computed from them whole) and one block's activations
    as it is differentiated (one buffer of each of its terms). Sizes as
    the estimate's (`step_memory.term_sizes`), no buffer counted twice.

    Example:
    ```python
    least_activation_bytes(plan, 8, 1024, "v5e")
    ```
    """
    terms = step_memory.activation_terms(plan, batch_size, sequence_length, platform)
    sizes = step_memory.term_sizes(plan, platform)
    layers = step_memory.num_blocks(plan)
    inputs = terms["stream"] * sizes["stream"]
    one_block = (
        sum(
            terms[name] * sizes[name] / layers
            for name in BLOCK_TERMS
            if name != "scores"
        )
        + terms["scores_one_block"] * sizes["scores_one_block"]
    )
    logits = terms["logits_float32"] * FLOAT32_BYTES
    return int(inputs + max(logits, one_block))


def least_step_bytes(
    plan, batch_size: int, sequence_length: int, optimizer: str, platform: str
) -> int:
    """The least a training step could need per device: the weights and
    the optimizer's slots (the step's donated arguments), and the least
    activations (`least_activation_bytes`). No gradient is counted: the TPU
    compiler applies each weight's update as its gradient is made.

    Example:
    ```python
    least_step_bytes(plan, 8, 1024, "adam", "v5e")
    ```
    """
    state = step_memory.step_estimate(plan, None, None, optimizer, platform=platform)
    return (
        state.weights
        + state.optimizer_state
        + least_activation_bytes(plan, batch_size, sequence_length, platform)
    )


def step_verdict(
    plan,
    batch_size: int | None,
    sequence_length: int | None,
    optimizer: str = "adam",
    platform: str | None = None,
) -> StepVerdict:
    """The closed form's verdict on a step on `platform` (or a named
    device; by default the plan's, else a GPU: `platform_of`): yes, NO, or
    maybe (module docstring).

    Without a batch and sequence length it is the state's (weights,
    gradients and optimizer state): yes or NO, nothing to rematerialize.

    Example:
    ```python
    step_verdict(plan, 4, 1024, platform="v5e").answer
    ```
    """
    platform = platform_of(plan, platform)
    estimate = step_memory.step_estimate(
        plan, batch_size, sequence_length, optimizer, platform=platform
    )
    return estimate_verdict(
        plan, estimate, batch_size, sequence_length, optimizer, platform
    )


def estimate_verdict(
    plan,
    estimate: step_memory.StepEstimate,
    batch_size: int | None,
    sequence_length: int | None,
    optimizer: str,
    platform: str,
) -> StepVerdict:
    """`step_verdict` on an estimate already made (`step_memory.step_estimate`
    for `platform`, which may add to it, e.g. the layout search's gradient
    accumulators)."""
    capacity = plan.device_memory_bytes
    total = estimate.total_bytes
    if estimate.covers != step_memory.STEP:
        return StepVerdict(YES if total <= capacity else NO, estimate, total, capacity)
    calibration = step_memory.calibration_of(platform)[0]
    margin = ESTIMATE_MARGIN[calibration]
    over_margin = OVER_ESTIMATE_MARGIN[calibration]
    least = int(total / (1 + over_margin))
    if rematerializes(platform):
        least = min(
            least,
            least_step_bytes(plan, batch_size, sequence_length, optimizer, platform),
        )
    if total * (1 + margin) <= capacity:
        answer = YES
    elif least > capacity:
        answer = NO
    else:
        answer = MAYBE
    return StepVerdict(answer, estimate, least, capacity, margin, over_margin)


__all__ = [
    "MAYBE",
    "NO",
    "YES",
    "StepVerdict",
    "estimate_verdict",
    "least_activation_bytes",
    "least_step_bytes",
    "platform_of",
    "rematerializes",
    "step_verdict",
]
