"""The section "On one accelerator" of docs/benchmarks.md, rendered from a
run's results (`accelerator_runner.run`) and the predictions committed
before it (`accelerator_steps.read_predictions`)."""

from __future__ import annotations

import pathlib
import statistics

from bench import accelerator_targets

GB = 1e9
GIB = 2**30


def _gb(n):
    """Bytes in GB, or MB below 0.1 GB (`--tiny`)."""
    if n is None:
        return ""
    return f"{n / GB:.2f} GB" if n >= GB / 10 else f"{n / 1e6:.2f} MB"


def _gib(n):
    """Bytes in GiB (as the TPU compiler counts them), or MiB below 0.1."""
    if not n:
        return ""
    return f"{n / GIB:.2f} GiB" if n >= GIB / 10 else f"{n / 2**20:.2f} MiB"


def _failure(row) -> str:
    """A failed measurement's error as a Markdown cell: in a code span, so
    that its brackets are not read as links, without the table's bars."""
    text = " ".join(row["error"]).replace("`", "'").replace("|", "/")
    return f"fails: `{text}`"


def _ratio(a, b):
    return "" if not a or not b else f"{a / b:.2f}"


def _dtype_label(row):
    if row["variant"] == "raw read":
        return "(bfloat16 file)"
    return row["dtype"] or "none (float32 model)"


def _runs(results) -> str:
    """How long the run took, or each of the runs whose parts were merged."""
    runs = results.get("runs")
    if not runs:
        return f"in {results.get('elapsed_s', 0):.0f} s"
    return "in {} runs ({})".format(
        len(runs),
        "; ".join(f"`--parts {r['parts']}` {r['elapsed_s']:.0f} s" for r in runs),
    )


def _load_lines(results) -> list[str]:
    rows = results.get("loading") or []
    if not rows:
        return []
    model = results.get("load_model", "gemma_7b")
    lines = [
        "",
        f"### Loading (`Backbone.from_preset`, the {model} shape)",
        "",
        "| variant | dtype= | s | device peak | final | peak / final |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['variant']} | {r['dtype']} | {_failure(r)} | | | |")
            continue
        lines.append(
            f"| {r['variant']} | {_dtype_label(r)} | "
            f"{r['seconds']:.2f} | {_gb(r.get('peak_bytes'))} | "
            f"{_gb(r.get('final_bytes'))} | "
            f"{_ratio(r.get('peak_bytes'), r.get('final_bytes'))} |"
        )
    warned = sorted(
        {w for r in rows if r["variant"] == "autodist" for w in r.get("warnings", [])}
    )
    lines += [
        "",
        "Python warnings during autodist's loads: "
        + ("; ".join(f"`{w}`" for w in warned) if warned else "none."),
    ]
    return lines


def _training_lines(results) -> list[str]:
    if not results.get("training"):
        return []
    lines = [
        "",
        "### Training (bfloat16, Adam, `train_on_batch`, one device)",
        "",
        "Median of the timed steps after the warm-up ones, each waited for; "
        "TFLOP/s counted as 6 x parameters x tokens (LoRA steps: the whole "
        "model's parameters, so an upper bound). Program: the step's own "
        "memory, temporaries + arguments + outputs - aliased from the "
        "compiled program's `memory_analysis()`, or for a refused step the "
        "bytes its `RESOURCE_EXHAUSTED` names (arguments included); device "
        "peak: `memory_stats()` (a TPU's leaves the temporaries out), the "
        "process's so far: a model's batches run in one process, smallest "
        "first.",
        "",
        "| step | variant | runs | program | s/step | tokens/s | TFLOP/s | "
        "first step s | device peak | generate tokens/s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["training"]:
        head = f"| {r['step']} | {r['variant']} |"
        if r.get("refused"):
            lines.append(
                f"{head} no | {_gib(r.get('program_bytes'))} | {_failure(r)} "
                "| | | | | |"
            )
            continue
        if "error" in r:
            lines.append(f"{head} | | {_failure(r)} | | | | | |")
            continue
        generated = r.get("generate_tokens_per_s")
        lines.append(
            f"{head} yes | {_gib(r.get('program_bytes'))} | {r['step_s']:.4f} | "
            f"{r['tokens_per_s']:,.0f} | {r['tflops']:.1f} | "
            f"{r['first_step_s']:.1f} | {_gb(r.get('peak_bytes'))} | "
            f"{'' if generated is None else f'{generated:,.0f}'} |"
        )
    return lines


def largest_batches(results) -> list[tuple[str, str, int | None, int | None]]:
    """Per model and variant of the training rows: (label, variant, the
    largest batch that ran, the first refused), in the rows' order."""
    found = {}
    for r in results["training"]:
        key = (r.get("label") or r["step"].rsplit(" ", 2)[0], r["variant"])
        ran, refused = found.get(key, (None, None))
        if r.get("refused"):
            refused = refused or r.get("batch")
        elif "error" not in r:
            ran = max(ran or 0, r.get("batch") or 0) or ran
        found[key] = (ran, refused)
    return [(k[0], k[1], *v) for k, v in found.items()]


def _ladder_lines(results) -> list[str]:
    rows = [r for r in largest_batches(results) if r[2] or r[3]]
    if not any(r.get("batch") for r in results["training"]):
        return []
    lines = [
        "",
        "### The largest batch that runs",
        "",
        "Each model's batches, smallest first, in one process per variant, "
        "up to the first the device refuses.",
        "",
        "| model | variant | largest that ran | first refused |",
        "|---|---|---|---|",
    ]
    for label, variant, ran, refused in rows:
        lines.append(
            f"| {label} | {variant} | {ran or 'none'} | {refused or 'none tried'} |"
        )
    return lines


def _memory_lines(results, predictions) -> list[str]:
    """Each autodist step's measured memory against the answers given
    before it ran: the target compile (on a CPU machine, with its verdict),
    the local compile (on the device), the plan's closed form, the
    calibrated one and its verdict (yes, NO or maybe: `step_verdict`)."""
    rows = [
        r
        for r in results["training"]
        if r["variant"] == "autodist" and ("error" not in r or r.get("refused"))
    ]
    if not rows:
        return []
    lines = [
        "",
        "### Memory answers against the measured memory (autodist's steps)",
        "",
        "Each answer as bytes and as a ratio to the measured memory (the "
        "program's where read, else the device's peak). Target compile: the "
        "step compiled for this accelerator on a CPU-only machine before the "
        "run (`bench/predictions/`), and whether it fit there; local compile: "
        "`compiled_memory` on the device itself; closed form says: "
        "`step_verdict`'s answer for the target, given before the run.",
        "",
        "| step | runs | measured | target compile | target says | local compile "
        "| closed form | calibrated closed form | closed form says |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        measured = accelerator_targets.measured_bytes(r)
        predicted = predictions.get(r["step"], {})

        def cell(value, measured=measured):
            if not value:
                return ""
            return f"{_gb(value)} ({_ratio(value, measured)})"

        pair = accelerator_targets.target_against_chip(r, predicted)
        target = "" if pair is None else f"{_gb(pair[0])} ({_ratio(*pair)})"
        says = ""
        if "target_refused" in predicted:
            says = "refused" if predicted["target_refused"] else "fits"
        lines.append(
            f"| {r['step']} | {'no' if r.get('refused') else 'yes'} | "
            f"{_gb(measured)} | {target} | "
            f"{says} | {cell(r.get('compiled_peak_bytes'))} | "
            f"{cell(r.get('closed_form_bytes'))} | "
            f"{cell(r.get('calibrated_bytes'))} | "
            f"{predicted.get('closed_form_verdict', '')} |"
        )
    return lines


def _long_lines(results) -> list[str]:
    rows = results.get("long_context") or []
    if not rows:
        return []
    lines = [
        "",
        "### Long context (Gemma 2B shape, LoRA 8, one sequence, bfloat16)",
        "",
        "The fused attention kernel is read from the optimized programs XLA "
        "dumped on the device (`--xla_dump_to`): cuDNN's custom calls are "
        "named `__cudnn$fmha...`, a Pallas kernel by its name; none listed "
        "means XLA's own attention.",
        "",
        "| tokens | variant | s/step | tokens/s | first step s | device peak "
        "| fused attention kernels |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['seq']} | {r['variant']} | {_failure(r)} | | | | |")
            continue
        kernels = ", ".join(f"`{k}`" for k in r["attention_kernels"]) or "none"
        lines.append(
            f"| {r['seq']} | {r['variant']} | {r['step_s']:.3f} | "
            f"{r['tokens_per_s']:,.0f} | {r['first_step_s']:.1f} | "
            f"{_gb(r.get('peak_bytes'))} | {kernels} |"
        )
    return lines


def _attention_lines(results) -> list[str]:
    rows = results.get("attention") or []
    if not rows:
        return []
    first = rows[0]
    lines = [
        "",
        "### Attention alone (causal, bfloat16, forward and backward)",
        "",
        f"{first['heads']} query heads, {first['kv_heads']} key/value head, "
        f"head_dim {first['head_dim']}, batch 1; the last `queries` of a "
        "sequence of `keys` tokens. cudnn and xla: "
        "`jax.nn.dot_product_attention`'s implementations over a whole "
        "sequence; splash: Pallas' TPU kernel on one device; blockwise: the "
        "context axis' per-device attention (at queries = keys / 8, one "
        "device's share of a context axis of 8).",
        "",
        "| variant | queries x keys | s | device peak | program | compile s "
        "| fused kernels |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        size = f"{r['queries']} x {r['keys']}"
        if "error" in r:
            lines.append(f"| {r['variant']} | {size} | {_failure(r)} | | | | |")
            continue
        kernels = ", ".join(f"`{k}`" for k in r["fused"]) or "none"
        lines.append(
            f"| {r['variant']} | {size} | {r['step_s']:.4f} | "
            f"{_gb(r.get('peak_bytes'))} | {_gb(r.get('program_bytes'))} | "
            f"{r['compile_s']:.1f} | {kernels} |"
        )
    return lines


def _speed_lines(results) -> list[str]:
    rows = results.get("speed") or []
    if not rows:
        return []
    lines = [
        "",
        "### Speed (`train_on_batch` and `fit`, processes alternated)",
        "",
        "Each variant in fresh processes, in turns first (keras-hub, "
        "autodist, then autodist, keras-hub); in each, the median of the "
        "timed `train_on_batch` steps, and one `fit` epoch of as many "
        "batches after an untimed one. The targets take each variant's "
        "median over its processes. Host phases: medians of as many more "
        "steps, timed around the jitted step (after the call: the device's "
        "time, the state put back, the logs read).",
        "",
        "| step | round | variant | s/step | tokens/s | `fit` tokens/s | "
        "host ms before / in / after the call |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        head = f"| {r['step']} | {r['round']} | {r['variant']} |"
        if "error" in r or r.get("refused"):
            lines.append(f"{head} {_failure(r)} | | | |")
            continue
        fit = r.get("fit_tokens_per_s")
        phases = r.get("host_phases") or {}
        shown = " / ".join(
            f"{phases[key]:.2f}"
            for key in ("before_ms", "call_ms", "after_ms")
            if key in phases
        )
        lines.append(
            f"{head} {r['step_s']:.4f} | {r['tokens_per_s']:,.0f} | "
            f"{'' if fit is None else f'{fit:,.0f}'} | {shown} |"
        )
    return lines


def _chunk_lines(results) -> list[str]:
    rows = results.get("chunks") or []
    if not rows:
        return []
    lines = [
        "",
        "### The loss whole and in chunks (one process per batch)",
        "",
        "One autodist model per batch, its step compiled again under each "
        "chunk rule in turn (`bench/accelerator_chunks.py`), the odd rounds "
        "in reverse; each round's median `train_on_batch` step. The ratio is "
        "of each rule's median over its rounds to whole logits'.",
        "",
        "| step | rule | chunks | s/step by round | tokens/s vs whole logits "
        "| program |",
        "|---|---|---|---|---|---|",
    ]
    runs = {}  # (step, variant) -> its rows, in the order measured
    for r in rows:
        runs.setdefault((r["step"], r["variant"]), []).append(r)

    def median_step(step, variant):
        timed = [r["step_s"] for r in runs.get((step, variant), ()) if "step_s" in r]
        return statistics.median(timed) if timed else None

    for (step, variant), mine in runs.items():
        failed = [r for r in mine if "error" in r]
        if failed:
            lines.append(f"| {step} | {variant} | {_failure(failed[0])} | | | |")
            continue
        whole = median_step(step, "whole logits")
        times = ", ".join(f"{r['step_s']:.4f}" for r in mine)
        ratio = f"{whole / median_step(step, variant):.3f}" if whole else ""
        lines.append(
            f"| {step} | {variant} | {mine[0]['chunks']} | {times} | {ratio} "
            f"| {_gib(mine[0].get('program_bytes'))} |"
        )
    return lines


def title(results) -> str:
    """The section's title: a TPU chip's run has its own section beside the
    GPU's.

    Example:
    >>> title({"family": "tpu"})
    '## On one TPU chip'
    """
    if results.get("family") == "tpu":
        return "## On one TPU chip"
    return "## On one accelerator"


def render(results, predictions=None) -> str:
    """The section "On one accelerator" (a GPU's) or "On one TPU chip" of
    docs/benchmarks.md, as Markdown.

    Args:
        results: a run's results (`accelerator.json`).
        predictions: the target compile's figures per step, made on a CPU
            machine before the run (`accelerator_steps.read_predictions`).
    """
    predictions = predictions or {}
    shapes = "tiny shapes (`--tiny`)" if results["tiny"] else "real model shapes"
    found = ", ".join(f"{k} {v}" for k, v in results.get("versions", {}).items())
    target = results.get("target")
    against = f"; predictions for `{target}`" if target else ""
    lines = [
        title(results),
        "",
        f"{results.get('machine', 'unknown machine')}, {results['date']}; "
        f"{found}; {shapes}{against}; `python -m bench --accelerator` "
        f"{_runs(results)}. Random bfloat16 weights saved by keras-hub; each "
        "measurement in a fresh process.",
    ]
    if results.get("skipped"):
        lines += [
            "",
            "Not measured (out of time): " + "; ".join(results["skipped"]) + ".",
        ]
    lines += _load_lines(results)
    lines += _training_lines(results)
    lines += _ladder_lines(results)
    lines += _memory_lines(results, predictions)
    lines += _long_lines(results)
    lines += _attention_lines(results)
    lines += _speed_lines(results)
    lines += _chunk_lines(results)
    lines += accelerator_targets.table(results, predictions)
    return "\n".join(lines) + "\n"


MEASUREMENTS = ("loading", "training", "long_context", "attention", "speed", "chunks")


def merge(runs: list[dict]) -> dict:
    """Several runs' results on one machine as one: their measurements in
    order, what none of them measured as skipped, and each run's parts and
    seconds (`runs`).

    Example:
    >>> a = dict(date="d", tiny=False, parts=["train"], elapsed_s=400.0,
    ...          training=[{"step": "s"}], skipped=["load x"])
    >>> b = dict(date="d", tiny=False, parts=["load"], elapsed_s=90.0,
    ...          loading=[{"variant": "x"}], skipped=[])
    >>> merged = merge([a, b])
    >>> len(merged["training"]), len(merged["loading"]), merged["runs"][1]
    (1, 1, {'parts': 'load', 'elapsed_s': 90.0})
    """
    merged = dict(runs[0])
    for key in MEASUREMENTS:
        merged[key] = [row for run in runs for row in run.get(key) or []]
    # Skipped in one run but measured in another: not skipped.
    later_parts = {p for run in runs for p in run.get("parts", [])}
    merged["skipped"] = [
        what
        for i, run in enumerate(runs)
        for what in run.get("skipped", [])
        if not any(
            what.split(" ")[0] in later.get("parts", [])
            and what not in later.get("skipped", [])
            for later in runs[i + 1 :]
        )
    ]
    merged["parts"] = sorted(later_parts)
    merged["runs"] = [
        dict(parts=",".join(run.get("parts", [])), elapsed_s=run.get("elapsed_s", 0))
        for run in runs
    ]
    return merged


def insert(markdown: pathlib.Path, section: str) -> None:
    """Put `section` in `markdown`, replacing an earlier one of the same title."""
    text = markdown.read_text() if markdown.exists() else ""
    title = section.splitlines()[0]
    if title in text:
        before, rest = text.split(title, 1)
        after = rest.find("\n## ")
        text = before + section + (rest[after + 1 :] if after >= 0 else "")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    markdown.write_text(text)
