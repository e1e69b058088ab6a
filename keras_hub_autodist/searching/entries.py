"""A candidate as the layout search leaves it (`Entry`): where it stopped,
what the closed form and its compile say, and how entries rank (`rank`).
"""

from __future__ import annotations

import dataclasses
import math

from keras_hub_autodist.fitting.compiled_step import CompiledMemory
from keras_hub_autodist.searching import step_cost
from keras_hub_autodist.searching.candidates import Candidate
from keras_hub_autodist.searching.report import COMPILED
from keras_hub_autodist.searching.report import FAILED
from keras_hub_autodist.searching.report import NOT_COMPILED


@dataclasses.dataclass(frozen=True)
class Entry:
    """A candidate as the search left it.

    Args:
        candidate: the layout, its batch and accumulation.
        stage: `PRUNED`, `NOT_COMPILED`, `COMPILED` or `FAILED`.
        estimate_bytes: the closed form's bytes per device.
        least_bytes: the least the closed form says it could need per
            device (its verdict's: `verdicts.step_verdict`).
        closed_form: its `StepCost` by the closed form.
        compiled: the compiled step, when compiled.
        cost: its `StepCost` from the compiled program, when compiled.
        fits: by the compile where compiled, else by the closed form (or
            by the compile of a smaller batch of its layout that doesn't).
        verdict: the closed form's verdict on it, yes, NO or maybe
            (`verdicts.step_verdict`): NO is pruned.
        rule: whether the memory rule (`device_mesh="auto"`) picks it.
        why: one line on why it won or lost (`report`).
        mfu: the modelled model-flops utilization of its compiled step.
        sequence_length: tokens per sequence.
        error: why its compile failed (`FAILED`), in the compiler's words.
        skipped: why the search did not compile it, where a compile of
            another candidate says (`batches.skipped_rung`, `dominated`).
    """

    candidate: Candidate
    stage: str
    estimate_bytes: int
    least_bytes: int
    closed_form: step_cost.StepCost
    compiled: CompiledMemory | None = None
    cost: step_cost.StepCost | None = None
    fits: bool = False
    verdict: str = ""
    rule: bool = False
    why: str = ""
    mfu: float = 0.0
    sequence_length: int = 0
    error: str = ""
    skipped: str = ""

    @property
    def modelled(self) -> step_cost.StepCost:
        return self.cost or self.closed_form

    @property
    def seconds_per_token(self) -> float:
        """The modelled time of one (micro-)step over its tokens. Keras'
        JAX optimizer computes the update in every micro-step and keeps it
        every `accumulation`-th (its `_backend_apply_gradients`), so the
        compiled micro-step's time is what each micro-step costs: nothing
        of the update is amortised over the micro-steps."""
        tokens = self.candidate.batch_size * self.sequence_length
        return self.modelled.seconds / tokens if tokens else math.inf


# Ranked first: compiled and fitting; then compiled and not fitting (the
# search's answer is always one it compiled); then not compiled but fitting
# by the closed form; then those that failed to compile; then the rest
# (pruned, or known not to fit).
STAGE_RANK = {
    (COMPILED, True): 0,
    (COMPILED, False): 1,
    (NOT_COMPILED, True): 2,
    (FAILED, False): 3,
}


def rank(entry: Entry) -> tuple:
    """Stage first (`STAGE_RANK`); then the modelled time per token, and
    among ties the smaller compiled peak (the same speed with more memory
    to spare); but the compiled peak among compiled steps that don't fit
    (the one closest to fitting first)."""
    stage = STAGE_RANK.get((entry.stage, entry.fits), 4)
    if stage == 1:
        return (stage, entry.compiled.peak_bytes)
    per_token = step_cost.rounded_time(entry.seconds_per_token)
    peak = entry.compiled.peak_bytes if entry.compiled else entry.estimate_bytes
    return (stage, per_token, peak)


__all__ = ["STAGE_RANK", "Entry", "rank"]
