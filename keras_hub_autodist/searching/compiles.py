"""Which candidates a layout search compiles, in what order, and what each
compile says (`Compiles`): every candidate's entry by the closed form,
then the layouts compiled one after another, each at its first rung and
then up or down its ladder of batches (`batches`) until its largest batch
that fits by the compile is known.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from keras_hub_autodist.errors import CompilerMissingError
from keras_hub_autodist.errors import TargetCompileError
from keras_hub_autodist.fitting.compiled_answer import compiled_fits
from keras_hub_autodist.fitting.planner import plan
from keras_hub_autodist.fitting.step_memory import step_estimate
from keras_hub_autodist.fitting.verdicts import NO
from keras_hub_autodist.fitting.verdicts import YES
from keras_hub_autodist.fitting.verdicts import estimate_verdict
from keras_hub_autodist.searching import batches
from keras_hub_autodist.searching import step_cost
from keras_hub_autodist.searching.candidates import Candidate
from keras_hub_autodist.searching.entries import Entry
from keras_hub_autodist.searching.entries import rank
from keras_hub_autodist.searching.inputs import SearchedStep
from keras_hub_autodist.searching.report import COMPILED
from keras_hub_autodist.searching.report import FAILED
from keras_hub_autodist.searching.report import NOT_COMPILED
from keras_hub_autodist.searching.report import PRUNED

# Why a rematerialized candidate is left uncompiled (`batches.dominated`).
DOMINATED = (
    "with a remat that recomputes less, or none, this layout fits by its "
    "compile at this batch or a larger one, and recomputation only adds time"
)


def planned(step: SearchedStep, candidate: Candidate):
    """The candidate's layout plan (its batch changes no plan)."""
    return plan(
        step.preset,
        dict(candidate.mesh),
        strategy=candidate.strategy,
        remat=candidate.remat,
        **step.plan_options(),
    )


class Compiles:
    """A search's entries and what its compiles found.

    Args:
        step: the step searched.
        compile_step: `(candidate, layout) -> (CompiledMemory, cache hit)`.
        speed: the device's `DeviceSpeed`.

    Attributes:
        entries: candidate -> `Entry`.
        compiles, hits, failed, fitting: how many compiles were made, were
            served by the cache, failed, fit.
    """

    def __init__(self, step: SearchedStep, compile_step: Callable, speed):
        self.step, self.compile_step, self.speed = step, compile_step, speed
        self.plans, self.entries = {}, {}
        self.compiles = self.hits = self.failed = self.fitting = 0

    def layout(self, candidate: Candidate):
        """The candidate's plan, made once per layout."""
        family = candidate.family()
        if family not in self.plans:
            self.plans[family] = planned(self.step, candidate)
        return self.plans[family]

    def add(self, candidate: Candidate) -> None:
        """The candidate's entry by the closed form: its bytes (with an
        accumulator per trained weight where its gradients accumulate:
        `batches.with_accumulators`) and its step time."""
        step, layout = self.step, self.layout(candidate)
        batch, seq = candidate.batch_size, step.sequence_length
        estimate = batches.with_accumulators(
            step_estimate(layout, batch, seq, step.optimizer, platform=step.device),
            candidate.accumulation,
        )
        closed = step_cost.closed_form_cost(layout, batch, seq, estimate, self.speed)
        verdict = estimate_verdict(
            layout, estimate, batch, seq, step.optimizer, step.device
        )
        self.entries[candidate] = Entry(
            candidate,
            PRUNED if verdict.answer == NO else NOT_COMPILED,
            estimate.total_bytes,
            verdict.least_bytes,
            closed,
            fits=estimate.total_bytes <= layout.device_memory_bytes,
            sequence_length=seq,
            verdict=verdict.answer,
        )

    def first_rung(self, rungs: list[Candidate], optimistic=False) -> Candidate:
        """The rung that stands for a ladder (`batches.first_rung`)."""
        entries = [self.entries[c] for c in rungs]
        index = batches.first_rung(
            [e.fits for e in entries], [e.stage != PRUNED for e in entries], optimistic
        )
        return rungs[index]

    def order(self, firsts) -> list[Candidate]:
        """The layouts' first rungs in the order they are compiled: those
        that fit by the closed form first, the fastest per token first, but
        the fastest that the closed form's verdict says yes to second, so
        that one likely to fit is among the first compiled; then the pruned
        ones, the smallest first."""
        entries = [self.entries[c] for c in firsts]
        order = sorted(
            (e for e in entries if e.stage != PRUNED),
            key=lambda e: (not e.fits, e.seconds_per_token),
        )
        safe = [e for e in order[1:] if e.verdict == YES]
        if safe:
            order.remove(safe[0])
            order.insert(min(1, len(order)), safe[0])
        pruned = sorted(
            (e for e in entries if e.stage == PRUNED), key=lambda e: e.estimate_bytes
        )
        return [e.candidate for e in order + pruned]

    def compile_entry(self, candidate: Candidate) -> None:
        """Compile one candidate and put what its compile says in its entry."""
        entry, layout = self.entries[candidate], self.layout(candidate)
        self.compiles += 1
        try:
            memory, hit = self.compile_step(candidate, layout)
        except CompilerMissingError:
            raise  # no candidate can compile: the extra is missing
        except Exception as error:  # any other failure is this candidate's
            self.failed += 1
            self.entries[candidate] = dataclasses.replace(
                entry, stage=FAILED, fits=False, error=words(error)
            )
            return
        self.hits += hit
        fits = compiled_fits(memory, layout.device_memory_bytes)
        self.fitting += fits
        batch, seq = candidate.batch_size, self.step.sequence_length
        least_flops = step_cost.model_flops(
            layout, batch, seq, layout.lora_rank, layout.remat
        )
        # A step the compiler refused has no program to cost: the closed
        # form's time stands for it.
        cost = (
            None
            if memory.out_of_memory
            else step_cost.compiled_cost(
                memory, self.speed, least_flops / layout.mesh_axes.num_devices
            )
        )
        seconds = (cost or entry.closed_form).seconds
        self.entries[candidate] = dataclasses.replace(
            entry,
            stage=COMPILED,
            compiled=memory,
            cost=cost,
            fits=fits,
            mfu=step_cost.modelled_mfu(layout, batch, seq, seconds, self.speed),
        )

    def compiled_fits(self) -> list[Candidate]:
        """The candidates whose compiles fit."""
        return [c for c, e in self.entries.items() if e.stage == COMPILED and e.fits]

    def skip_dominated(self, candidate: Candidate) -> bool:
        """Whether `candidate` can't be the fastest (`batches.dominated`);
        then its entry says why."""
        if not batches.dominated(candidate, self.compiled_fits()):
            return False
        self.entries[candidate] = dataclasses.replace(
            self.entries[candidate], skipped=DOMINATED
        )
        return True

    def climb(self, rungs: list[Candidate]) -> None:
        """Compile up or down a layout's ladder until its largest rung that
        fits by its compile is known (`batches.next_rung`)."""
        while True:
            entries = [self.entries[c] for c in rungs]
            if any(e.stage == FAILED for e in entries):
                return  # a failure says nothing of the memory
            known = [e.fits if e.stage == COMPILED else None for e in entries]
            index = batches.next_rung(known, [e.stage != PRUNED for e in entries])
            if index is None or self.skip_dominated(rungs[index]):
                return
            self.compile_entry(rungs[index])

    def compile_layouts(self, order: list, ladders: dict, max_compiles: int) -> None:
        """Compile the layouts in `order`, each at its first rung and then
        along its ladder (`climb`): `max_compiles` of them beside the first
        while one fits, up to twice as many while none does. A layout that
        fails to compile doesn't count (the next is compiled in its place);
        one whose answer is implied (`skip_dominated`) counts without the
        compile's time."""
        done = failed = 0
        seen = set()
        for candidate in order:
            if candidate.family() in seen:
                continue  # its ladder was compiled from another rung
            if done > max_compiles and (self.fitting or done > 2 * max_compiles):
                break
            if failed >= 2 * (max_compiles + 1) and not done:
                break  # none compiles: the same failure each time
            seen.add(candidate.family())
            if self.skip_dominated(candidate):
                done += 1
                continue
            self.compile_entry(candidate)
            if self.entries[candidate].stage == FAILED:
                failed += 1
                continue
            done += 1
            self.climb(ladders[candidate.family()])

    def descend_from_fastest(self, ladders: dict) -> None:
        """Compile the rung below the batch of the fastest candidate that
        fits, and again below the new fastest, until the rung below the
        fastest is compiled (and slower) or there is none: where steps are
        timed on the device, a smaller batch can be the faster one near the
        memory's limit, and more than one rung down (on a v5e, Qwen 2.5
        0.5B full at 1,024 tokens ran 30,707 tokens/s at 16 per device,
        31,810 at 8 and 32,080 at 4)."""
        while True:
            fitting = [self.entries[c] for c in self.compiled_fits()]
            if not fitting:
                return
            fastest = min(fitting, key=rank).candidate
            rungs = ladders[fastest.family()]
            index = rungs.index(fastest)
            if not index or self.entries[rungs[index - 1]].stage != NOT_COMPILED:
                return
            self.compile_entry(rungs[index - 1])

    def mark_settled(self, ladders: dict) -> None:
        """Say, of each rung not compiled, what the compiles tell: it can't
        be the fastest (`batches.dominated`), a larger batch of its layout
        fits, or a smaller one doesn't (then, memory growing with the
        batch, neither does it: `batches.skipped_rung`)."""
        fitting = self.compiled_fits()
        for candidate, entry in list(self.entries.items()):
            if entry.stage == NOT_COMPILED and batches.dominated(candidate, fitting):
                self.entries[candidate] = dataclasses.replace(entry, skipped=DOMINATED)
        for rungs in ladders.values():
            compiled = [c for c in rungs if self.entries[c].stage == COMPILED]
            fit = [c for c in compiled if self.entries[c].fits]
            refused = [c for c in compiled if not self.entries[c].fits]
            largest = fit[-1] if fit else None
            smallest = refused[0] if refused else None
            for candidate in rungs:
                entry = self.entries[candidate]
                if entry.stage != NOT_COMPILED or entry.skipped:
                    continue
                why = batches.skipped_rung(candidate, largest, smallest)
                above = smallest is not None and (
                    candidate.batch_size > smallest.batch_size
                )
                if why:
                    self.entries[candidate] = dataclasses.replace(
                        entry, skipped=why, fits=entry.fits and not above
                    )

    def compile_until_one_fits(self, max_compiles: int) -> None:
        """While no compile fits, compile the fastest candidate left that
        fits by the closed form (up to `max_compiles` more): what is chosen
        is always one a compile showed to fit, wherever one of those does."""
        for _ in range(max_compiles):
            if self.compiled_fits():
                return
            pending = [
                e
                for e in self.entries.values()
                if e.stage == NOT_COMPILED and e.fits and not e.skipped
            ]
            if not pending:
                return
            self.compile_entry(min(pending, key=rank).candidate)

    def raise_when_none_compiles(self, device: str, devices: int) -> None:
        """Raise when every candidate compiled failed: no layout can be
        chosen by its compile."""
        if not self.compiles or self.compiles != self.failed:
            return
        failures = [e for e in self.entries.values() if e.stage == FAILED]
        shown = "; ".join(f"{e.candidate.label()}: {e.error}" for e in failures[:3])
        raise TargetCompileError(
            f"No layout of the step compiles for {devices} x {device}: each of "
            f"the {len(failures)} candidates compiled failed ({shown}). Fix what "
            "the compiler names (the dtype, the sequence length, the model), or "
            f"search another device. Received: device={device!r}, devices={devices}"
        )


def words(error: BaseException) -> str:
    """An error's first line, as a row of the table shows it.

    Example:
    >>> words(ValueError("first\\nsecond"))
    'first'
    """
    text = str(error).strip()
    return (text.splitlines()[0][:300] if text else "") or type(error).__name__


__all__ = ["DOMINATED", "Compiles", "planned", "words"]
