"""`search()`: the fastest configuration of a training step that fits a
named device (its layout, remat, batch per device and gradient
accumulation), chosen by the step compiled for it.

1. Candidates (`candidates`, `batches`): every mesh over the `batch`,
   `model` and `context` axes (and `expert` for a mixture of experts) of
   the devices, each with strategy `"tp"` and `"fsdp"` and the remats
   asked for (off, `"dots"` and `"full"` by default), each at a ladder of
   batches:
   a global batch and its splits into micro-steps whose gradients
   accumulate, or a range of batches per device; with
   `batch_size="auto"`, each at the largest batch that fits by the closed
   form.
2. Pruning: the calibrated closed form (`step_memory.step_estimate` for
   the device) drops the candidates that can't fit. Of each layout's
   ladder, the rung the closed form puts last under the memory is its
   first compile (on a TPU, whose compiler refuses a step too large
   sooner than it accepts one, the last within the closed form's margin:
   `batches.EARLY_REFUSALS`); layouts are compiled in the order of the
   closed form's step time per token (`step_cost.closed_form_cost`), the
   fastest
   `max_compiles` of them with the memory rule's choice
   (`device_mesh="auto"` today, under the strategy and remat asked for),
   each for the device (`compiled_step.compiled_memory`, cached on disk:
   `cache`) and then up or down its ladder until its largest batch that
   fits by the compile is known (`batches.next_rung`). A candidate the
   compiler refuses for a reason other than its size is a `FAILED` row
   with the compiler's words, and the next layout is compiled in its
   place; one with remat whose twin with less recomputation (or none)
   fits by its compile at the same batch or a larger one is not compiled
   (it can't be faster: `batches.dominated`).
3. Ranking: the compiled ones that fit by their compile, by the time per
   token of the compiled (micro-)step (`step_cost.compiled_cost`): modelled,
   or, where this machine has the devices searched for, measured by
   running each compiled step (`step_timing`); then the rung below the
   fastest one's batch is compiled and timed too, and below that while
   each is faster, as a larger batch can run slower near the memory's
   limit (the compiler rematerializes to fit it). The rule's choice is
   among them, so the chosen one is never slower than it. `report`
   explains each loser in one line, `winner` writes the code that trains
   with the chosen one.

Every candidate, the rule's included, has one of the strategies and remats
asked for: the chosen configuration is what was compiled, and what a load
with those options runs.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Mapping

from keras_hub_autodist.fitting.compile_targets import attached
from keras_hub_autodist.fitting.compiled_step import compiled_memory
from keras_hub_autodist.fitting.device_profiles import device_profile
from keras_hub_autodist.fitting.device_profiles import device_speed
from keras_hub_autodist.fitting.step_memory import step_estimate
from keras_hub_autodist.fitting.step_timing import TIMED_STEPS
from keras_hub_autodist.reading.presets import read_config
from keras_hub_autodist.searching import batches
from keras_hub_autodist.searching import cache
from keras_hub_autodist.searching import winner
from keras_hub_autodist.searching.candidates import REMATS
from keras_hub_autodist.searching.candidates import STRATEGIES
from keras_hub_autodist.searching.candidates import Candidate
from keras_hub_autodist.searching.candidates import candidates
from keras_hub_autodist.searching.candidates import meshes
from keras_hub_autodist.searching.candidates import remat_key
from keras_hub_autodist.searching.compiles import Compiles
from keras_hub_autodist.searching.entries import Entry
from keras_hub_autodist.searching.entries import rank
from keras_hub_autodist.searching.inputs import SearchedStep
from keras_hub_autodist.searching.inputs import check_search_inputs
from keras_hub_autodist.searching.report import COMPILED
from keras_hub_autodist.searching.report import FAILED
from keras_hub_autodist.searching.report import NOT_COMPILED
from keras_hub_autodist.searching.report import PRUNED
from keras_hub_autodist.searching.report import explain
from keras_hub_autodist.searching.report import table
from keras_hub_autodist.searching.rule import rule_candidate
from keras_hub_autodist.searching.rule import rule_choice
from keras_hub_autodist.searching.step_inputs import CompiledStepInputs

# How many layouts, beside the memory rule's choice, are compiled.
MAX_COMPILES = 4
# With `batch_size="auto"`: batches tried, up to this many sequences.
MAX_AUTO_BATCH = 1024


@dataclasses.dataclass(frozen=True)
class SearchResult:
    """The search's answer: every candidate ranked, the chosen one, the
    memory rule's choice (see `report` for its table and JSON) and the code
    that trains with the chosen one (`run_code`).

    Besides what was searched (`preset`, `device`, `devices`,
    `sequence_length`, `lora_rank`, `optimizer`, `dtype`) and what it
    found (`entries`, `chosen`, `rule_choice`, `compiles`, `cache_hits`,
    `seconds`, `capacity_bytes` per device): `per_device_batch`, the range
    of batches per device searched (`None` with a global batch);
    `model_class`, the keras-hub task's name the code loads; `asked_dtype`,
    the `dtype=` asked for (`None`: the preset's).
    """

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
    per_device_batch: tuple[int, int] | None = None
    model_class: str = "CausalLM"
    asked_dtype: str | None = None

    @property
    def run_code(self) -> str:
        """The Python that loads and trains the chosen configuration
        (`winner.run_code`); `""` when nothing compiled fits."""
        return winner.run_code(self)

    def __str__(self):
        return table(self)


def _largest_batch(step: SearchedStep, candidate: Candidate, layout) -> Candidate:
    """With `batch_size="auto"`: the largest batch (the batch axis times a
    power of two, up to `MAX_AUTO_BATCH`) whose closed form fits; the batch
    axis' size when none does."""
    rows = candidate.mesh["batch"]
    best = rows
    seq, optimizer = step.sequence_length, step.optimizer
    while rows <= MAX_AUTO_BATCH:
        estimate = step_estimate(layout, rows, seq, optimizer, platform=step.device)
        if estimate.total_bytes > layout.device_memory_bytes:
            break
        best, rows = rows, rows * 2
    return dataclasses.replace(candidate, batch_size=best)


def _compile(inputs: CompiledStepInputs, folder):
    """The step compiled from `inputs` (`CompiledStepInputs`, what its key
    names), from the disk cache when there; and whether it was."""
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
    batch_size: int | str | None = None,
    sequence_length: int | None = None,
    lora_rank: int | None = None,
    *,
    per_device_batch: int | tuple[int, int] | None = None,
    gradient_accumulation: bool = True,
    dtype: str | None = None,
    optimizer: str = "adam",
    strategies=STRATEGIES,
    remats=REMATS,
    max_compiles: int = MAX_COMPILES,
    cache_dir: str | os.PathLike | None = None,
    context_parallel_strategy: str = "all_gather",
) -> SearchResult:
    """The fastest configuration of a training step that fits `devices` of
    `device` (layout, remat, batch per device, gradient accumulation), by
    the step compiled for that device; every candidate ranked and
    explained.

    Args:
        preset: what to plan, as for `plan()`.
        device: a named device of `compile_targets.TARGETS` (`"v5e"`,
            `"t4"`, `"h100"`): its memory, speed and compiler.
        devices: how many of them.
        batch_size: the global batch: the sequences of one optimizer
            update, over all devices. Each layout tries it whole and (with
            `gradient_accumulation`) split into `k` micro-steps of
            `batch_size / k` sequences whose gradients accumulate. Or
            `"auto"`: the largest per-step batch that fits by the closed
            form, per layout. `None` with `per_device_batch`.
        sequence_length: tokens per sequence.
        lora_rank: search for a LoRA fine-tune of this rank.
        per_device_batch: instead of `batch_size`, the batches per replica
            of the batch axis to try, `(low, high)` (or one): both ends and
            the powers of two between; per layout, the largest that fits
            by its compile is found with few compiles (`batches`).
        gradient_accumulation: whether a global batch is also tried as
            micro-steps whose gradients accumulate (Keras'
            `gradient_accumulation_steps`).
        dtype: the dtype the model is loaded with; defaults to the preset's.
        optimizer: the optimizer's name (`trained_state.OPTIMIZERS`).
        strategies: the strategies searched; every candidate, the memory
            rule's choice included, has one of them.
        remats: the rematerializations searched (`None`: off), each a value
            `remat=` takes; every candidate has one of them.
        max_compiles: how many layouts beside the memory rule's choice are
            compiled (more when none of them fits, or one fails to
            compile); each is compiled at as many batches as finding its
            largest that fits takes.
        cache_dir: where compiled steps are kept
            (`cache.compile_cache_folder`).
        context_parallel_strategy: how the candidates with a context axis
            pass keys and values (`"all_gather"` or `"ring"`).

    Returns:
        A `SearchResult`; `str()` of it is the ranked table, its `run_code`
        what trains with the chosen configuration.

    Raises:
        PlanError: for an argument of the wrong kind, naming it.
        TargetCompileError: when no candidate compiles at all.
        CompilerMissingError: when the device's compiler isn't installed.

    Example:
    ```python
    result = keras_hub_autodist.search("./llama3_8b", device="v5e", devices=8,
                                       batch_size=8, sequence_length=2048)
    result.chosen.candidate.mesh, result.chosen.modelled.seconds
    one_chip = keras_hub_autodist.search("./gemma3_1b", "v5e", 1,
        sequence_length=2048, per_device_batch=(1, 16))
    print(one_chip.run_code)
    ```
    """
    started = time.perf_counter()
    strategies, remats, per_device = check_search_inputs(
        preset=preset,
        device=device,
        devices=devices,
        batch_size=batch_size,
        per_device_batch=per_device_batch,
        gradient_accumulation=gradient_accumulation,
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
    whole = None if auto or per_device else batch_size
    profile = device_profile(device)
    speed = device_speed(device)
    info = read_config(preset)
    config = dict(info.config)
    folder = cache.usable_cache_folder(cache.compile_cache_folder(cache_dir))
    timed_steps = TIMED_STEPS if attached(device, devices) else 0

    def compile_step(candidate, layout):
        inputs = CompiledStepInputs(
            layout,
            config,
            candidate.batch_size,
            sequence_length,
            optimizer,
            device,
            lora_rank,
            preset,
            gradient_accumulation_steps=candidate.accumulation,
            timed_steps=timed_steps,
        )
        return _compile(inputs, folder)

    run = Compiles(step, compile_step, speed)
    experts = any(
        "expert" in w.logical_axes
        for w in run.layout(Candidate({"batch": 1}, strategies[0], remats[0], 1)).rows
    )
    options = dict(strategies=strategies, remats=remats, experts=experts)
    if auto:
        found = candidates(devices, None, sequence_length, **options)
    else:
        found = batches.batch_candidates(
            devices,
            sequence_length,
            batch_size=whole,
            per_device=per_device,
            accumulate=gradient_accumulation,
            **options,
        )
    rule = rule_candidate(step, devices, whole, strategies, remats)
    if all(c.family() != rule.family() for c in found):
        found += _rungs_of(rule, per_device)
    if auto:
        found = [_largest_batch(step, c, run.layout(c)) for c in found]
    for candidate in found:
        run.add(candidate)
    ladders = batches.ladders(found)
    # Layouts are ordered by the rung the closed form fits last; each is
    # compiled first at that rung, or where the compiler refuses early, at
    # the largest within the closed form's margin.
    optimistic = profile.platform in batches.EARLY_REFUSALS
    heads = {family: run.first_rung(rungs) for family, rungs in ladders.items()}
    starts = {f: run.first_rung(rungs, optimistic) for f, rungs in ladders.items()}
    # The rule's choice at the whole batch in one step; else its ladder.
    rule = next((c for c in found if c == rule), starts[rule.family()])
    order = [starts[c.family()] for c in run.order(heads.values())]
    run.compile_layouts(
        [rule] + [c for c in order if c.family() != rule.family()],
        ladders,
        max_compiles,
    )
    run.raise_when_none_compiles(device, devices)
    if timed_steps:
        run.descend_from_fastest(ladders)
    run.mark_settled(ladders)
    run.compile_until_one_fits(max_compiles)
    if whole is None:  # a batch per layout: the rule's largest that fits
        rule = batches.largest_fit(ladders[rule.family()], run.entries) or rule
    run.entries[rule] = dataclasses.replace(run.entries[rule], rule=True)
    ranked = sorted(run.entries.values(), key=rank)
    entries_out = tuple(explain(ranked, ranked[0], profile, speed))
    rule_layout = run.layout(rule)
    return SearchResult(
        preset=str(preset) if not isinstance(preset, Mapping) else "<config dict>",
        device=profile.name,
        devices=devices,
        sequence_length=sequence_length,
        lora_rank=lora_rank,
        optimizer=optimizer,
        capacity_bytes=rule_layout.device_memory_bytes,
        dtype=rule_layout.dtype,
        entries=entries_out,
        chosen=entries_out[0],
        rule_choice=next(e for e in entries_out if e.rule),
        seconds=time.perf_counter() - started,
        compiles=run.compiles - run.failed,
        cache_hits=run.hits,
        per_device_batch=per_device,
        model_class=_task_class_name(info),
        asked_dtype=dtype,
    )


def _rungs_of(rule: Candidate, per_device) -> list[Candidate]:
    """The memory rule's layout at the batches searched, where the
    candidates lack it: at the whole batch, or at each per-device batch."""
    if per_device is None:
        return [rule]
    return [
        dataclasses.replace(rule, batch_size=rows * rule.mesh["batch"])
        for rows in batches.per_device_batches(*per_device)
    ]


def _task_class_name(info) -> str:
    """The keras-hub task the step trains (the backbone's `CausalLM`), by
    name; the backbone's name with `CausalLM` for `Backbone` where it can't
    be looked up."""
    from keras_hub_autodist.fitting.compile_arguments import default_task_class
    from keras_hub_autodist.planning.shapes import backbone_class_named

    name = info.backbone_class or "CausalLM"
    try:
        backbone = info.backbone_cls or backbone_class_named(name)
        return default_task_class(backbone).__name__
    except Exception:  # an unknown backbone: the code shown names it alone
        return name.replace("Backbone", "CausalLM")


__all__ = [
    "COMPILED",
    "Candidate",
    "Entry",
    "FAILED",
    "MAX_COMPILES",
    "NOT_COMPILED",
    "PRUNED",
    "REMATS",
    "STRATEGIES",
    "SearchResult",
    "candidates",
    "meshes",
    "remat_key",
    "rule_choice",
    "search",
]
