"""`search()`: the fastest layout of a training step that fits a named
device, chosen by the step compiled for it.

1. Candidates (`candidates`): every mesh over the `batch`, `model` and
   `context` axes (and `expert` for a mixture of experts) of the devices,
   each with strategy `"tp"` and `"fsdp"` and rematerialization off and
   `"full"`; with `batch_size="auto"`, each at the largest batch that
   fits by the closed form.
2. Pruning: the calibrated closed form (`step_memory.step_estimate` for
   the device) drops the candidates that can't fit; the rest are ranked by
   the closed form's step time (`step_cost.closed_form_cost`) and the
   fastest `max_compiles` of them, with the memory rule's choice
   (`device_mesh="auto"` today, under the strategy and remat asked for),
   are compiled for the device (`compiled_step.compiled_memory`, cached on
   disk: `cache`). A candidate the compiler refuses for a reason
   other than its size is a `FAILED` row with the compiler's words, and
   the next one is compiled in its place; one with remat whose twin
   without remat fits by its compile is not compiled (it can't be faster).
3. Ranking: the compiled ones that fit by their compile, by the modelled
   time per token of the compiled program (`step_cost.compiled_cost`); the
   rule's choice is among them, so the chosen one is never slower in the
   model than it. `report` explains each loser in one line.

Every candidate, the rule's included, has one of the strategies and remats
asked for: the chosen layout is what was compiled, and what a load with
those options runs.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Mapping

from keras_hub_autodist.errors import CompilerMissingError
from keras_hub_autodist.errors import TargetCompileError
from keras_hub_autodist.fitting.compiled_answer import compiled_fits
from keras_hub_autodist.fitting.compiled_step import CompiledMemory
from keras_hub_autodist.fitting.compiled_step import compiled_memory
from keras_hub_autodist.fitting.device_profiles import device_profile
from keras_hub_autodist.fitting.device_profiles import device_speed
from keras_hub_autodist.fitting.planner import plan
from keras_hub_autodist.fitting.step_memory import step_estimate
from keras_hub_autodist.reading.presets import read_config
from keras_hub_autodist.searching import cache
from keras_hub_autodist.searching import step_cost
from keras_hub_autodist.searching.candidates import REMATS
from keras_hub_autodist.searching.candidates import STRATEGIES
from keras_hub_autodist.searching.candidates import Candidate
from keras_hub_autodist.searching.candidates import candidates
from keras_hub_autodist.searching.candidates import meshes
from keras_hub_autodist.searching.candidates import remat_key
from keras_hub_autodist.searching.inputs import SearchedStep
from keras_hub_autodist.searching.inputs import check_search_inputs
from keras_hub_autodist.searching.report import COMPILED
from keras_hub_autodist.searching.report import FAILED
from keras_hub_autodist.searching.report import NOT_COMPILED
from keras_hub_autodist.searching.report import PRUNED
from keras_hub_autodist.searching.report import explain
from keras_hub_autodist.searching.report import table
from keras_hub_autodist.searching.step_inputs import CompiledStepInputs

# A candidate whose closed-form estimate exceeds the device's memory by
# more than this factor is not compiled: the calibrated closed form is
# within about 20% of the target compiles (docs/benchmarks.md, section 8).
PRUNE_MARGIN = 1.2
# How many candidates, beside the memory rule's choice, are compiled.
MAX_COMPILES = 4
# With `batch_size="auto"`: batches tried, up to this many sequences.
MAX_AUTO_BATCH = 1024


@dataclasses.dataclass(frozen=True)
class Entry:
    """A candidate as the search left it.

    Args:
        candidate: the layout.
        stage: `PRUNED`, `NOT_COMPILED`, `COMPILED` or `FAILED`.
        estimate_bytes: the closed form's bytes per device.
        closed_form: its `StepCost` by the closed form.
        compiled: the compiled step, when compiled.
        cost: its `StepCost` from the compiled program, when compiled.
        fits: by the compile where compiled, else by the closed form.
        rule: whether the memory rule (`device_mesh="auto"`) picks it.
        why: one line on why it won or lost (`report`).
        error: why its compile failed (`FAILED`), in the compiler's words.
    """

    candidate: Candidate
    stage: str
    estimate_bytes: int
    closed_form: step_cost.StepCost
    compiled: CompiledMemory | None = None
    cost: step_cost.StepCost | None = None
    fits: bool = False
    rule: bool = False
    why: str = ""
    mfu: float = 0.0

    @property
    def modelled(self) -> step_cost.StepCost:
        return self.cost or self.closed_form

    @property
    def seconds_per_token(self) -> float:
        tokens = self.candidate.batch_size * self.sequence_length
        return self.modelled.seconds / tokens if tokens else math.inf

    sequence_length: int = 0
    error: str = ""


@dataclasses.dataclass(frozen=True)
class SearchResult:
    """The search's answer: every candidate ranked, the chosen one and the
    memory rule's choice (see `report` for its table and JSON)."""

    preset: str
    device: str
    devices: int
    sequence_length: int
    lora_rank: int | None
    optimizer: str
    capacity_bytes: int
    dtype: str
    entries: tuple[Entry, ...]
    chosen: Entry
    rule_choice: Entry
    seconds: float
    compiles: int
    cache_hits: int

    def __str__(self):
        return table(self)


def _planned(step: SearchedStep, candidate: Candidate):
    return plan(
        step.preset,
        dict(candidate.mesh),
        strategy=candidate.strategy,
        remat=candidate.remat,
        **step.plan_options(),
    )


def _closed_form(step: SearchedStep, candidate: Candidate, speed):
    """The candidate's plan, closed-form bytes and closed-form cost."""
    layout = _planned(step, candidate)
    batch, seq = candidate.batch_size, step.sequence_length
    estimate = step_estimate(layout, batch, seq, step.optimizer, platform=step.device)
    cost = step_cost.closed_form_cost(layout, batch, seq, estimate, speed)
    return layout, estimate.total_bytes, cost


def _largest_batch(step: SearchedStep, candidate: Candidate) -> Candidate:
    """With `batch_size="auto"`: the largest batch (the batch axis times a
    power of two, up to `MAX_AUTO_BATCH`) whose closed form fits; the batch
    axis' size when none does."""
    layout = _planned(step, candidate)
    rows = candidate.mesh["batch"]
    best = rows
    seq, optimizer = step.sequence_length, step.optimizer
    while rows <= MAX_AUTO_BATCH:
        estimate = step_estimate(layout, rows, seq, optimizer, platform=step.device)
        if estimate.total_bytes > layout.device_memory_bytes:
            break
        best, rows = rows, rows * 2
    return dataclasses.replace(candidate, batch_size=best)


def rule_choice(
    preset,
    device,
    devices,
    batch_size,
    lora_rank,
    dtype,
    strategy: str = "auto",
    remat=None,
    context_parallel_strategy: str = "all_gather",
) -> tuple[dict[str, int], str]:
    """What `device_mesh="auto"` picks by the memory rule
    (`planner.resolve_mesh`) with the strategy (`"auto"`: the rule's too)
    and remat asked for, as a mesh and a strategy."""
    chosen = plan(
        preset,
        "auto",
        strategy=strategy,
        num_devices=devices,
        batch_size=batch_size,
        device_memory=device,
        lora_rank=lora_rank,
        dtype=dtype,
        remat=remat,
        context_parallel_strategy=context_parallel_strategy,
    )
    axes = chosen.mesh_axes
    return dict(zip(axes.axis_names, axes.shape)), chosen.strategy


def _compile(layout, batch, seq, optimizer, device, lora_rank, folder, config, preset):
    """The compiled step, from the disk cache when there; and whether it
    was. The step is compiled from its inputs as gathered for its key
    (`CompiledStepInputs`), so that the key names all it is made from."""
    inputs = CompiledStepInputs(
        layout, config, batch, seq, optimizer, device, lora_rank, preset
    )
    key = cache.step_key(inputs)
    stored = cache.read_compile(folder, key)
    if stored is not None:
        return stored, True
    args, kwargs = inputs.compile_arguments()
    memory = compiled_memory(*args, **kwargs)
    cache.store_compile(folder, key, memory)
    return memory, False


def search(
    preset: str | os.PathLike | Mapping,
    device: str,
    devices: int,
    batch_size: int | str,
    sequence_length: int,
    lora_rank: int | None = None,
    *,
    dtype: str | None = None,
    optimizer: str = "adam",
    strategies=STRATEGIES,
    remats=REMATS,
    max_compiles: int = MAX_COMPILES,
    cache_dir: str | os.PathLike | None = None,
    context_parallel_strategy: str = "all_gather",
) -> SearchResult:
    """The fastest layout of a training step that fits `devices` of
    `device`, by the step compiled for that device; every candidate ranked
    and explained.

    Args:
        preset: what to plan, as for `plan()`.
        device: a named device of `compile_targets.TARGETS` (`"v5e"`,
            `"t4"`, `"h100"`): its memory, speed and compiler.
        devices: how many of them.
        batch_size: the global batch, or `"auto"`: the largest per-step
            batch that fits, per layout (ranked by tokens per second).
        sequence_length: tokens per sequence.
        lora_rank: search for a LoRA fine-tune of this rank.
        dtype: the dtype the model is loaded with; defaults to the preset's.
        optimizer: the optimizer's name (`trained_state.OPTIMIZERS`).
        strategies: the strategies searched; every candidate, the memory
            rule's choice included, has one of them.
        remats: the rematerializations searched (`None`: off); every
            candidate has one of them.
        max_compiles: how many candidates beside the memory rule's choice
            are compiled (more when none of them fits, or one fails to
            compile).
        cache_dir: where compiled steps are kept
            (`cache.compile_cache_folder`).
        context_parallel_strategy: how the candidates with a context axis
            pass keys and values (`"all_gather"` or `"ring"`).

    Returns:
        A `SearchResult`; `str()` of it is the ranked table.

    Raises:
        PlanError: for an argument of the wrong kind, naming it.
        TargetCompileError: when no candidate compiles at all.
        CompilerMissingError: when the device's compiler isn't installed.

    Example:
    ```python
    result = keras_hub_autodist.search("./llama3_8b", device="v5e", devices=8,
                                       batch_size=8, sequence_length=2048)
    result.chosen.candidate.mesh, result.chosen.modelled.seconds
    ```
    """
    started = time.perf_counter()
    strategies, remats = check_search_inputs(
        preset=preset,
        device=device,
        devices=devices,
        batch_size=batch_size,
        sequence_length=sequence_length,
        lora_rank=lora_rank,
        dtype=dtype,
        optimizer=optimizer,
        strategies=strategies,
        remats=remats,
        max_compiles=max_compiles,
        cache_dir=cache_dir,
        context_parallel_strategy=context_parallel_strategy,
    )
    step = SearchedStep(
        preset,
        device,
        sequence_length,
        optimizer,
        lora_rank,
        dtype,
        context_parallel_strategy,
    )
    auto = batch_size == "auto"
    profile = device_profile(device)
    speed = device_speed(device)
    info = read_config(preset)
    config = dict(info.config)
    folder = cache.usable_cache_folder(cache.compile_cache_folder(cache_dir))
    experts = any(
        "expert" in w.logical_axes
        for w in _planned(
            step, Candidate({"batch": 1}, strategies[0], remats[0], 1)
        ).rows
    )
    found = candidates(
        devices,
        None if auto else batch_size,
        sequence_length,
        strategies=strategies,
        remats=remats,
        experts=experts,
    )
    rule = _rule_candidate(
        step, devices, None if auto else batch_size, strategies, remats
    )
    if all(c.key()[:3] != rule.key()[:3] for c in found):
        found.append(rule)
    if auto:
        found = [_largest_batch(step, c) for c in found]
    rule = next(c for c in found if c.key()[:3] == rule.key()[:3])
    # Each candidate by the closed form.
    planned = {}
    entries = {}
    for candidate in found:
        layout, estimate, closed = _closed_form(step, candidate, speed)
        planned[candidate] = layout
        fits = estimate <= layout.device_memory_bytes
        entries[candidate] = Entry(
            candidate,
            PRUNED
            if estimate > PRUNE_MARGIN * layout.device_memory_bytes
            else NOT_COMPILED,
            estimate,
            closed,
            fits=fits,
            rule=candidate == rule,
            sequence_length=sequence_length,
        )
    to_compile = [rule] + [
        e.candidate for e in _compile_order(entries, planned) if e.candidate != rule
    ]
    compiles = hits = fitting = failed = implied = 0

    def compile_entry(candidate):
        """Compile one candidate and put what its compile says in its entry."""
        nonlocal compiles, hits, fitting, failed
        layout = planned[candidate]
        compiles += 1
        try:
            memory, hit = _compile(
                layout,
                candidate.batch_size,
                sequence_length,
                optimizer,
                device,
                lora_rank,
                folder,
                config,
                preset,
            )
        except CompilerMissingError:
            raise  # no candidate can compile: the extra is missing
        except Exception as error:  # any other failure is this candidate's
            failed += 1
            entries[candidate] = dataclasses.replace(
                entries[candidate], stage=FAILED, fits=False, error=_words(error)
            )
            return
        hits += hit
        fits = compiled_fits(memory, layout.device_memory_bytes)
        fitting += fits
        # A step the compiler refused has no program to cost: the closed
        # form's time stands for it.
        cost = None if memory.out_of_memory else step_cost.compiled_cost(memory, speed)
        entries[candidate] = dataclasses.replace(
            entries[candidate],
            stage=COMPILED,
            compiled=memory,
            cost=cost,
            fits=fits,
            mfu=step_cost.modelled_mfu(
                layout,
                candidate.batch_size,
                sequence_length,
                (cost or entries[candidate].closed_form).seconds,
                speed,
            ),
        )

    for candidate in to_compile:
        # Candidates that failed to compile don't count: the next ones are
        # compiled in their place. One whose answer is implied counts as
        # compiled, without the compile's time.
        done = compiles - failed + implied
        if done > max_compiles and (fitting or done > 2 * max_compiles):
            break
        if failed >= 2 * (max_compiles + 1) and not done:
            break  # none compiles: the same failure each time
        if _slower_twin_of_a_fit(candidate, entries):
            implied += 1
            continue
        compile_entry(candidate)
    if compiles and compiles == failed:
        _none_compiled(entries, device, devices)
    # One ranked first on the closed form alone is compiled before it is
    # chosen: what is chosen, a compile showed to fit (`max_compiles` more).
    for _ in range(max_compiles):
        first = min(entries.values(), key=_rank)
        if first.stage != NOT_COMPILED:
            break
        compile_entry(first.candidate)
    ranked = sorted(entries.values(), key=_rank)
    chosen = ranked[0]
    entries_out = tuple(explain(ranked, chosen, profile, speed))
    chosen = entries_out[0]
    rule_entry = next(e for e in entries_out if e.rule)
    return SearchResult(
        preset=str(preset) if not isinstance(preset, Mapping) else "<config dict>",
        device=profile.name,
        devices=devices,
        sequence_length=sequence_length,
        lora_rank=lora_rank,
        optimizer=optimizer,
        capacity_bytes=planned[rule].device_memory_bytes,
        dtype=planned[rule].dtype,
        entries=entries_out,
        chosen=chosen,
        rule_choice=rule_entry,
        seconds=time.perf_counter() - started,
        compiles=compiles - failed,
        cache_hits=hits,
    )


def _rule_candidate(
    step: SearchedStep, devices: int, batch_size, strategies, remats
) -> Candidate:
    """The memory rule's choice as a candidate of the strategies and remats
    asked for: the rule chooses the strategy only when both are asked for;
    its remat is off when off is asked for, else the first asked for."""
    strategy = "auto" if set(strategies) >= set(STRATEGIES) else strategies[0]
    keys = [remat_key(r) for r in remats]
    remat = None if None in keys else remats[0]
    mesh, chosen_strategy = rule_choice(
        step.preset,
        step.device,
        devices,
        batch_size,
        step.lora_rank,
        step.dtype,
        strategy=strategy,
        remat=remat,
        context_parallel_strategy=step.context_parallel_strategy,
    )
    return Candidate(mesh, chosen_strategy, remat, batch_size or 0)


def _slower_twin_of_a_fit(candidate: Candidate, entries: dict) -> bool:
    """Whether `candidate` is a rematerialized layout whose twin without
    remat (same mesh, strategy and batch) compiled and fits: remat only
    adds recomputation, so the twin is the faster of the two and the
    candidate can't be chosen; compiling it would change no answer."""
    if candidate.remat is None:
        return False
    twin = entries.get(dataclasses.replace(candidate, remat=None))
    return twin is not None and twin.stage == COMPILED and twin.fits


def _compile_order(entries: dict, planned: dict) -> list:
    """The entries in the order they are compiled: those that fit by the
    closed form first, the fastest first, but the fastest that fits with
    the closed form's margin to spare second, so that one likely to fit is
    among the first compiled; then the pruned ones, the smallest first."""
    order = sorted(
        (e for e in entries.values() if e.stage != PRUNED),
        key=lambda e: (not e.fits, e.seconds_per_token),
    )
    safe = [
        e
        for e in order[1:]
        if e.estimate_bytes * PRUNE_MARGIN <= planned[e.candidate].device_memory_bytes
    ]
    if safe:
        order.remove(safe[0])
        order.insert(min(1, len(order)), safe[0])
    pruned = sorted(
        (e for e in entries.values() if e.stage == PRUNED),
        key=lambda e: e.estimate_bytes,
    )
    return order + pruned


def _words(error: BaseException) -> str:
    """An error's first line, as a row of the table shows it."""
    text = str(error).strip()
    return (text.splitlines()[0][:300] if text else "") or type(error).__name__


def _none_compiled(entries: dict, device: str, devices: int) -> None:
    """Raise when every candidate compiled failed: no layout can be
    chosen by its compile."""
    failures = [e for e in entries.values() if e.stage == FAILED]
    shown = "; ".join(f"{e.candidate.label()}: {e.error}" for e in failures[:3])
    raise TargetCompileError(
        f"No layout of the step compiles for {devices} x {device}: each of "
        f"the {len(failures)} candidates compiled failed ({shown}). Fix what "
        "the compiler names (the dtype, the sequence length, the model), or "
        f"search another device. Received: device={device!r}, devices={devices}"
    )


# Ranked first: compiled and fitting; then not compiled but fitting by the
# closed form; then compiled and not fitting; then those that failed to
# compile; then pruned.
_STAGE_RANK = {
    (COMPILED, True): 0,
    (NOT_COMPILED, True): 1,
    (COMPILED, False): 2,
    (FAILED, False): 3,
}


def _rank(entry: Entry) -> tuple:
    """Stage first (`_STAGE_RANK`); then the modelled time per token, but
    the compiled peak among compiled steps that don't fit (the one closest
    to fitting first)."""
    stage = _STAGE_RANK.get((entry.stage, entry.fits), 4)
    if stage == 2:
        return (stage, entry.compiled.peak_bytes)
    return (stage, entry.seconds_per_token)


__all__ = [
    "COMPILED",
    "Candidate",
    "Entry",
    "FAILED",
    "MAX_COMPILES",
    "NOT_COMPILED",
    "PRUNED",
    "PRUNE_MARGIN",
    "REMATS",
    "STRATEGIES",
    "SearchResult",
    "candidates",
    "meshes",
    "remat_key",
    "rule_choice",
    "search",
]
