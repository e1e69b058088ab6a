"""The layout search's answer in words: why each candidate won or lost (one
line each), the ranked table, the `--search --json` object, and the one
line `from_preset` prints about the chosen layout. An entry is a
`search.Entry`, a result a `search.SearchResult` (typed `Any` here: the
search imports this module, not the other way round).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING
from typing import Any

from keras_hub_autodist.fitting.device_profiles import FLOAT32_FOR_BFLOAT16
from keras_hub_autodist.searching import step_cost
from keras_hub_autodist.searching.winner import run_code
from keras_hub_autodist.searching.winner import run_values
from keras_hub_autodist.words import counted

if TYPE_CHECKING:
    from keras_hub_autodist.fitting.device_profiles import DeviceProfile
    from keras_hub_autodist.fitting.device_profiles import DeviceSpeed

GIB = 1024**3
# Where a candidate stopped (`search.Entry.stage`).
PRUNED = "pruned"  # over the memory by the closed form: not compiled
NOT_COMPILED = "not compiled"  # fits by the closed form, slower than those compiled
COMPILED = "compiled"
# The compiler refused it for a reason other than its size (its words are
# the entry's `error`); the search went on without it.
FAILED = "failed to compile"
# How each link is named in a reason.
LINK_NAMES = {"ici": "ICI", "nvlink": "NVLink", "pcie": "PCIe"}
# What each term of the roofline is, in a reason.
TERM_WORDS = {"compute": "flops", "memory": "HBM bytes", "link": "link bytes"}
_TERM_FIELDS = {"compute": "flops", "memory": "hbm_bytes", "link": "link_bytes"}


def _largest_collective(entry: Any) -> str:
    if entry.compiled is None or not entry.compiled.collectives:
        return ""
    kind = max(entry.compiled.collectives, key=lambda c: c.bytes).kind
    return f", mostly {kind}"


def _slower(entry: Any, chosen: Any, speed: DeviceSpeed) -> str:
    """Why a candidate that fits is slower than the chosen one (or, compiled
    and modelled as fast, why it lost the tie: its larger peak): its tokens
    per second against the chosen one's, the term of the roofline it loses
    most time on (as a ratio of amounts), and what of it differs from the
    chosen one (`_differences`)."""
    differences = _differences(entry.candidate, chosen.candidate)
    because = ": " + "; ".join(differences) if differences else ""
    # A candidate not compiled is held to the chosen one's closed form: the
    # two models' scales differ.
    compiled = entry.cost is not None
    if compiled and step_cost.rounded_time(
        entry.seconds_per_token
    ) == step_cost.rounded_time(chosen.seconds_per_token):
        return (
            "fits, as fast as the chosen one by the model, with a larger "
            f"compiled peak ({entry.compiled.peak_bytes / GIB:.2f} GiB per "
            f"device){because}"
        )
    mine = entry.modelled
    best = chosen.modelled if compiled else chosen.closed_form
    ratio = (mine.seconds / entry.candidate.batch_size) / (
        best.seconds / chosen.candidate.batch_size
    )
    lost = {
        term: mine.terms()[term] / entry.candidate.batch_size
        - best.terms()[term] / chosen.candidate.batch_size
        for term in TERM_WORDS
    }
    term = max(lost, key=lost.get)
    amount = getattr(mine, _TERM_FIELDS[term])
    their = getattr(best, _TERM_FIELDS[term])
    scale = chosen.candidate.batch_size / max(entry.candidate.batch_size, 1)
    times = amount * scale / their if their else float("inf")
    where = f" over {LINK_NAMES[speed.link]}" if term == "link" else ""
    detail = _largest_collective(entry) if term == "link" else ""
    how = "" if compiled else " by the closed form"
    speed_up = 1 / ratio if ratio else float("inf")
    line = f"fits, {speed_up:.2f}x the chosen one's tokens/s{how}"
    if their:  # a compiler's own estimate may come without the amounts
        line += f"; {times:.1f}x the {TERM_WORDS[term]} per token{where}{detail}"
    return line + because


def _differences(candidate: Any, chosen: Any) -> list[str]:
    """What of a candidate differs from the chosen one, in words: its
    remat, its batch per device, its accumulation, its layout.

    Example:
    >>> from keras_hub_autodist.searching.candidates import Candidate
    >>> mine = Candidate({"batch": 1}, "tp", "full", 8, 2)
    >>> for words in _differences(mine, Candidate({"batch": 1}, "tp", None, 4)):
    ...     print(words)
    remat full recomputes activations in the backward pass
    8 sequences per device per step, not 4
    2 micro-steps per update: Keras' JAX optimizer computes its update in each
    """
    found = []
    if candidate.remat != chosen.remat:
        if candidate.remat:
            found.append(
                f"remat {candidate.remat} recomputes activations in the backward pass"
            )
        else:
            found.append(f"without the chosen one's remat {chosen.remat}")
    if candidate.per_device_batch != chosen.per_device_batch:
        found.append(
            f"{counted(candidate.per_device_batch, 'sequence')} per device per "
            f"step, not {chosen.per_device_batch}"
        )
    if candidate.accumulation > 1:
        found.append(
            f"{candidate.accumulation} micro-steps per update: Keras' JAX "
            "optimizer computes its update in each"
        )
    if candidate.family()[:2] != chosen.family()[:2]:
        mesh = ",".join(f"{k}={v}" for k, v in candidate.mesh.items())
        found.append(f"layout {mesh} {candidate.strategy}")
    return found


def why(entry: Any, chosen: Any, capacity: int, speed: DeviceSpeed) -> str:
    """One line on why `entry` won or lost against `chosen`."""
    gib = GIB
    if entry is chosen or entry.candidate == chosen.candidate:
        peak = entry.compiled.peak_bytes if entry.compiled else entry.estimate_bytes
        if not entry.fits:
            return (
                f"nothing compiled fits: this needs the least, {peak / gib:.2f} "
                f"GiB per device of {capacity / gib:.2f} GiB; more devices or "
                "memory, or a smaller step"
            )
        return (
            f"chosen: the fastest modelled step that fits ({peak / gib:.2f} GiB "
            f"of {capacity / gib:.2f} GiB per device)"
        )
    if entry.stage == FAILED:
        return f"does not compile: {entry.error}"
    if entry.stage == NOT_COMPILED and entry.skipped:
        return f"not compiled: {entry.skipped}"
    if entry.stage == PRUNED:
        return (
            f"pruned: the closed form needs {entry.estimate_bytes / gib:.2f} GiB "
            f"per device, and at least {entry.least_bytes / gib:.2f} GiB, over "
            f"{capacity / gib:.2f} GiB"
        )
    if entry.stage == COMPILED and not entry.fits:
        memory = entry.compiled
        if memory.out_of_memory:
            return (
                f"does not fit: the compiler refuses it, needing "
                f"{memory.peak_bytes / gib:.2f} GiB per device"
            )
        return (
            f"does not fit: compiled peak {memory.peak_bytes / gib:.2f} GiB "
            f"per device, over {capacity / gib:.2f} GiB"
        )
    if not entry.fits:
        return (
            f"not compiled: the closed form needs {entry.estimate_bytes / gib:.2f}"
            f" GiB per device, over {capacity / gib:.2f} GiB"
        )
    line = _slower(entry, chosen, speed)
    if entry.stage != COMPILED:
        line = "not compiled, " + line
    return line


def explain(
    ranked: list, chosen: Any, profile: DeviceProfile, speed: DeviceSpeed
) -> list:
    """The ranked entries, each with its `why`."""
    capacity = profile.memory_bytes
    return [
        dataclasses.replace(entry, why=why(entry, chosen, capacity, speed))
        for entry in ranked
    ]


def mesh_text(entry: Any) -> str:
    return ",".join(f"{k}={v}" for k, v in entry.candidate.mesh.items())


def entry_json(entry: Any, result: Any) -> dict:
    """One candidate as `--search --json` prints it."""
    seconds = entry.modelled.seconds
    candidate = entry.candidate
    return {
        "mesh": dict(candidate.mesh),
        **candidate.settings(),
        "stage": entry.stage,
        "compiled_peak_bytes_per_device": (
            entry.compiled.peak_bytes if entry.compiled else None
        ),
        "estimate_bytes_per_device": entry.estimate_bytes,
        "fits": entry.fits,
        "modelled_step_seconds": seconds,
        "modelled_by": entry.modelled.source,
        "closed_form_step_seconds": entry.closed_form.seconds,
        "tokens_per_second": step_cost.tokens_per_second(
            candidate.batch_size, result.sequence_length, seconds
        ),
        "modelled_mfu": entry.mfu if entry.compiled else None,
        "roofline_seconds": entry.modelled.terms(),
        "rule_choice": entry.rule,
        "compile_error": entry.error or None,
        "why": entry.why,
    }


def to_json(result: Any) -> dict:
    """The `--search --json` object: `chosen`, `rule_choice` and every
    candidate ranked (`candidates`), with what was searched."""
    return {
        "preset": result.preset,
        "device": result.device,
        "devices": result.devices,
        "sequence_length": result.sequence_length,
        "lora_rank": result.lora_rank,
        "optimizer": result.optimizer,
        "device_memory_bytes": result.capacity_bytes,
        "collective_overlap": step_cost.COLLECTIVE_OVERLAP,
        "chosen": entry_json(result.chosen, result),
        "rule_choice": entry_json(result.rule_choice, result),
        "candidates": [entry_json(e, result) for e in result.entries],
        "advice": advice(result),
        "per_device_batch_range": (
            list(result.per_device_batch) if result.per_device_batch else None
        ),
        "run": _run_json(result),
        "compiles": result.compiles,
        "cache_hits": result.cache_hits,
        "search_seconds": result.seconds,
    }


def _run_json(result: Any) -> dict | None:
    """What trains with the chosen configuration (`winner`), or `None`
    when nothing compiled fits."""
    values = run_values(result)
    return None if values is None else {**values, "code": run_code(result)}


def batch_text(candidate: Any) -> str:
    """A candidate's batch as a row shows it: one step's, per device where
    the batch axis splits it, and the accumulation.

    Example:
    >>> from keras_hub_autodist.searching.candidates import Candidate
    >>> batch_text(Candidate({"batch": 2, "model": 2}, "tp", None, 8, 4))
    '8 (4/device) x4 accum'
    """
    text = str(candidate.batch_size)
    if candidate.mesh.get("batch", 1) > 1:
        text += f" ({candidate.per_device_batch}/device)"
    if candidate.accumulation > 1:
        text += f" x{candidate.accumulation} accum"
    return text


def table(result: Any) -> str:
    """The ranked table, one row per candidate, in Markdown."""
    gib = GIB
    lines = [
        f"layouts of a training step on {result.devices} x {result.device} "
        f"(sequence {result.sequence_length}, {result.optimizer}"
        + (
            ", {} to {} sequences per device".format(*result.per_device_batch)
            if result.per_device_batch
            else ""
        )
        + (f", LoRA rank {result.lora_rank}" if result.lora_rank else "")
        + f"): {result.compiles} compiled ({result.cache_hits} from the cache), "
        f"{result.seconds:.1f} s",
        "",
        "| # | layout | batch | peak GiB/device | step s | tokens/s | MFU | why |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for rank, entry in enumerate(result.entries, 1):
        peak = (
            f"{entry.compiled.peak_bytes / gib:.2f}"
            if entry.compiled
            else "failed"
            if entry.stage == FAILED
            else f"~{entry.estimate_bytes / gib:.2f}"
        )
        seconds = entry.modelled.seconds
        tokens = step_cost.tokens_per_second(
            entry.candidate.batch_size, result.sequence_length, seconds
        )
        mfu = f"{entry.mfu:.0%}" if entry.compiled else ""
        rule = " (rule)" if entry.rule else ""
        lines.append(
            f"| {rank} | {entry.candidate.label()}{rule} | "
            f"{batch_text(entry.candidate)} | {peak} | {seconds:.4g} | "
            f"{tokens:,.0f} | {mfu} | {entry.why} |"
        )
    lines.append("")
    measured = any(
        e.cost is not None and e.cost.source == "measured" for e in result.entries
    )
    lines.append(
        "peak: compiled for the device (~: the closed form's estimate, not "
        "compiled); step s: "
        + ("measured on this machine's devices, else " if measured else "")
        + "the compiler's estimate where it gives one (TPU), "
        "else the roofline of the compiled program, never under the device's "
        "peak on the model's flops, with "
        + ", ".join(
            f"{share:.0%} of {LINK_NAMES[link]} collectives hidden"
            for link, share in step_cost.COLLECTIVE_OVERLAP.items()
        )
    )
    for line in advice(result):
        lines += ["", line]
    code = run_code(result)
    if code:
        lines += ["", "To train with the chosen configuration:", "", "```python"]
        lines += [code, "```"]
    return "\n".join(lines)


def advice(result: Any) -> list[str]:
    """What to change when no layout fits, where the search knows more
    than "more devices or memory": a bfloat16 model on a device that
    computes bfloat16 in float32 (`FLOAT32_FOR_BFLOAT16`).

    Example:
    >>> from types import SimpleNamespace as Result
    >>> unfit = Result(chosen=Result(fits=False), dtype="bfloat16", device="t4")
    >>> advice(unfit)[0][:40]
    'A t4 has no bfloat16 arithmetic: its com'
    >>> advice(Result(chosen=Result(fits=True)))
    []
    """
    if result.chosen.fits:
        return []
    if result.dtype == "bfloat16" and result.device in FLOAT32_FOR_BFLOAT16:
        return [
            f"A {result.device} has no bfloat16 arithmetic: its compiler "
            "computes a bfloat16 model in float32 copies of its tensors. "
            "Loaded in float16 (`dtype='float16'`) the same layouts need about "
            "half those copies' bytes; float16's range is narrower than "
            "bfloat16's, so watch the loss for inf/NaN (or use loss scaling)."
        ]
    return []


def chosen_reason(result: Any) -> str:
    """Why the search chose its layout, in one line (the summary's)."""
    chosen, rule = result.chosen, result.rule_choice
    compiled = sum(1 for e in result.entries if e.compiled is not None)
    if chosen.candidate == rule.candidate:
        against = "the memory rule's choice too"
    else:
        speedup = rule.seconds_per_token / chosen.seconds_per_token
        against = (
            f"{speedup:.2f}x the tokens/s of the memory rule's "
            f"{mesh_text(rule)} {rule.candidate.strategy}"
        )
    remat = f", remat {chosen.candidate.remat}" if chosen.candidate.remat else ""
    return (
        f"searched for {result.devices} x {result.device}: the fastest "
        f"modelled step of {compiled} compiled layouts at batch "
        f"{chosen.candidate.batch_size} x {result.sequence_length}{remat}, "
        f"{against}"
    )


__all__ = [
    "COMPILED",
    "FAILED",
    "NOT_COMPILED",
    "PRUNED",
    "advice",
    "batch_text",
    "chosen_reason",
    "entry_json",
    "explain",
    "table",
    "to_json",
    "why",
]
