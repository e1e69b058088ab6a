"""The batches a layout search tries per layout, and which of them it
compiles.

A layout (mesh, strategy, remat: `Candidate.family()`) is tried at a
ladder of batches, the smallest first (`ladders`):

- with a global batch `B`, at each split of it into micro-steps: the
  global batch of one step `B / k` and `k` steps whose gradients
  accumulate into one update (Keras' `gradient_accumulation_steps`), for
  each `k` dividing `B` whose micro-batch the layout's batch axis divides
  (`accumulation_splits`); per device that is `b * k * d == B` on `d`
  replicas of the batch axis;
- with a per-device range, at its ends and the powers of two between
  them (`per_device_batches`), `k = 1`.

A step's memory grows with its batch, so each ladder has a largest rung
that fits, and that rung is the layout's fastest per token (a larger
batch amortises the weights' reads; `step_cost`). It is found with few
compiles (`next_rung`): the rung the closed form puts last under the
device's memory first (`first_rung`), then the rung next to it up (while
it fits) or down (while it doesn't), then halving what is left between
the largest rung that fits and the smallest that doesn't by their
compiles; only rungs the closed form doesn't prune.

Imports neither Keras nor JAX.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

from keras_hub_autodist.searching.candidates import Candidate
from keras_hub_autodist.searching.candidates import candidates
from keras_hub_autodist.searching.candidates import divisors


def per_device_batches(low: int, high: int) -> list[int]:
    """The per-device batches tried in `[low, high]`: both ends and the
    powers of two between them, ascending.

    Example:
    >>> per_device_batches(1, 16)
    [1, 2, 4, 8, 16]
    >>> per_device_batches(3, 20)
    [3, 4, 8, 16, 20]
    """
    found = {low, high}
    power = 1
    while power < high:
        if power > low:
            found.add(power)
        power *= 2
    return sorted(found)


def accumulation_splits(batch_size: int) -> list[tuple[int, int]]:
    """`(micro_batch, steps)` pairs whose product is `batch_size`: the
    global batch of one compiled step and how many accumulate into one
    update, the largest micro-batch first.

    Example:
    >>> accumulation_splits(8)
    [(8, 1), (4, 2), (2, 4), (1, 8)]
    """
    return [(batch_size // steps, steps) for steps in divisors(batch_size)]


def batch_candidates(
    devices: int,
    sequence_length: int,
    *,
    batch_size: int | None = None,
    per_device: tuple[int, int] | None = None,
    accumulate: bool = True,
    strategies,
    remats,
    experts: bool = False,
) -> list[Candidate]:
    """Every layout at every batch it is tried at: with `batch_size`, each
    split of it (`accumulation_splits`; only the whole batch without
    `accumulate`); with `per_device`, each of `per_device_batches` per
    replica of the layout's batch axis.

    Example:
    >>> found = batch_candidates(1, 64, batch_size=4, strategies=("tp",),
    ...                          remats=(None,))
    >>> [(c.batch_size, c.accumulation) for c in found]
    [(4, 1), (2, 2), (1, 4)]
    >>> found = batch_candidates(2, 64, per_device=(1, 2), strategies=("tp",),
    ...                          remats=(None,))
    >>> [(c.label(), c.batch_size) for c in found][:2]
    [('batch=2,model=1 tp', 2), ('batch=2,model=1 tp', 4)]
    """
    options = dict(strategies=strategies, remats=remats, experts=experts)
    found = []
    if per_device is not None:
        for layout in candidates(devices, None, sequence_length, **options):
            for rows in per_device_batches(*per_device):
                batch = rows * layout.mesh["batch"]
                found.append(dataclasses.replace(layout, batch_size=batch))
        return found
    splits = accumulation_splits(batch_size) if accumulate else [(batch_size, 1)]
    for micro, steps in splits:
        for layout in candidates(devices, micro, sequence_length, **options):
            found.append(dataclasses.replace(layout, accumulation=steps))
    return found


def with_accumulators(estimate, steps: int):
    """A closed-form `StepEstimate` with Keras' gradient accumulators where
    `steps` > 1: one per trained weight, of its dtype and layout (the size
    `gradients` counts), kept with the optimizer's state across steps.

    Example:
    ```python
    with_accumulators(step_estimate(plan, 4, 2048), 8).total_bytes
    ```
    """
    if steps <= 1:
        return estimate
    return dataclasses.replace(
        estimate, optimizer_state=estimate.optimizer_state + estimate.gradients
    )


def ladders(found) -> dict[tuple, list[Candidate]]:
    """The candidates of each layout (`Candidate.family()`), the smallest
    batch of one step first."""
    grouped = defaultdict(list)
    for candidate in found:
        grouped[candidate.family()].append(candidate)
    return {
        family: sorted(rungs, key=lambda c: c.batch_size)
        for family, rungs in grouped.items()
    }


def first_rung(
    closed_form_fits: list[bool], reachable: list[bool], optimistic: bool = False
) -> int:
    """The rung of a ladder that stands for its layout: the largest that
    fits by the closed form; with `optimistic`, the largest the closed form
    doesn't prune (it may fit: the closed form is within its margin); else
    the smallest the closed form doesn't prune; else the smallest.

    Example:
    >>> first_rung([True, True, False], [True, True, True])
    1
    >>> first_rung([True, True, False], [True, True, True], optimistic=True)
    2
    >>> first_rung([False, False], [False, True])
    1
    """
    fitting = [i for i, fits in enumerate(closed_form_fits) if fits]
    if optimistic:
        fitting = [i for i, ok in enumerate(reachable) if ok]
    if fitting:
        return fitting[-1]
    return next((i for i, ok in enumerate(reachable) if ok), 0)


# The platforms whose compiler refuses a step over the memory as it
# compiles, and sooner than it compiles one it accepts: on this 2-core
# machine, a Llama 3.2 1B step for a v5e took 25-40 s to refuse and 200-250
# s to accept. There a ladder's first compile is its largest rung within
# the closed form's margin (`first_rung(optimistic=True)`): a refusal and
# the rung below cost less than a rung that fits and the one above it. A
# GPU's compiler accepts any step, at full cost.
EARLY_REFUSALS = ("tpu",)


def largest_fit(rungs: list, entries: dict):
    """The largest rung of a ladder whose compile fits, or `None`."""
    fits = [c for c in rungs if entries[c].compiled is not None and entries[c].fits]
    return fits[-1] if fits else None


def next_rung(known: list[bool | None], reachable: list[bool]) -> int | None:
    """The next rung of a ladder to compile, or `None` when its largest
    fitting rung is known (or there is none).

    Args:
        known: per rung, whether its compile fits (`True`), doesn't
            (`False`), or `None` where not compiled.
        reachable: per rung, whether the closed form leaves it to compile
            (not pruned); only those are tried.

    Between the largest rung known to fit and the smallest known not to
    (the ends where none is), the rung next to the one compiled first
    comes first (the closed form's guess is rarely more than a rung off),
    then the middle.

    Example:
    >>> next_rung([None, None, True, None, None], [True] * 5)  # up by one
    3
    >>> next_rung([None, None, None, None, False], [True] * 5)  # down by one
    3
    >>> next_rung([None, None, None, False, False], [True] * 5)  # halve
    1
    >>> next_rung([None, True, None, False], [True] * 4)
    2
    >>> next_rung([None, True, None], [True, True, False]) is None  # pruned
    True
    >>> next_rung([None, None, False], [False, True, True])
    1
    """
    fit = max((i for i, k in enumerate(known) if k is True), default=-1)
    refused = min((i for i, k in enumerate(known) if k is False), default=len(known))
    open_rungs = [
        i for i in range(fit + 1, refused) if known[i] is None and reachable[i]
    ]
    if not open_rungs:
        return None
    compiled = sum(k is not None for k in known)
    if compiled == 1:
        return open_rungs[0] if fit >= 0 else open_rungs[-1]
    return open_rungs[len(open_rungs) // 2]


# The remats searched by default, by how much the backward pass computes
# again, least first (`remat_arguments.BLOCK_POLICIES`): off, the matmuls'
# outputs kept, only each block's inputs kept. Each keeps more memory than
# the next and recomputes less.
RECOMPUTATION_ORDER = (None, "dots", "full")


def dominated(candidate: Candidate, compiled_fits) -> bool:
    """Whether a rematerialized `candidate` can't be the fastest: the same
    layout with a remat that recomputes less (`RECOMPUTATION_ORDER`), or
    none, fits by its compile at the same batch per step or a larger one.
    More recomputation only adds time, and a larger batch per step (fewer
    micro-steps) is modelled at least as fast per token, so compiling it
    would change no answer.

    Args:
        candidate: a candidate.
        compiled_fits: the candidates whose compiles fit.
    """
    if candidate.remat not in RECOMPUTATION_ORDER[1:]:
        return False
    less = RECOMPUTATION_ORDER[: RECOMPUTATION_ORDER.index(candidate.remat)]
    twins = {dataclasses.replace(candidate, remat=r).family() for r in less}
    return any(
        fit.family() in twins and fit.batch_size >= candidate.batch_size
        for fit in compiled_fits
    )


def skipped_rung(candidate: Candidate, fits: Candidate | None, refused) -> str:
    """Why a rung of a settled ladder was not compiled, or `""`: a larger
    batch of its layout fits by its compile, or a smaller one doesn't.

    Example:
    >>> one = Candidate({"batch": 1}, "tp", None, 4)
    >>> skipped_rung(dataclasses.replace(one, batch_size=2), one, None)
    'a larger batch of this layout fits by its compile (4 per device)'
    """
    if fits is not None and candidate.batch_size < fits.batch_size:
        return (
            "a larger batch of this layout fits by its compile "
            f"({fits.per_device_batch} per device)"
        )
    if refused is not None and candidate.batch_size > refused.batch_size:
        return (
            "a smaller batch of this layout does not fit by its compile "
            f"({refused.per_device_batch} per device)"
        )
    return ""


__all__ = [
    "EARLY_REFUSALS",
    "accumulation_splits",
    "batch_candidates",
    "dominated",
    "first_rung",
    "ladders",
    "largest_fit",
    "next_rung",
    "per_device_batches",
    "skipped_rung",
    "with_accumulators",
]
