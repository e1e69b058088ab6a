"""The accelerator run's targets, checked against its results: each target
is a row of `TARGETS` (what is compared, the bound), and `verdicts` gives
every measured instance of each its ratio and whether it is met."""

from __future__ import annotations

import statistics

# target: (how its ratio is bounded, the bound). "at most": the ratio is at
# or under the bound; "at least": at or over it (a verdict that agrees is
# 1, one that doesn't 0); "within": the ratio is within the bound of 1.
TARGETS = {
    "target compile's verdict = the device's": ("at least", 1.0),
    "target compile's peak / measured peak": ("within", 0.05),
    # "maybe" is never wrong; "yes" for a refused step or "NO" for one that
    # ran is.
    "closed form's verdict is not wrong": ("at least", 1.0),
    "calibrated closed form / measured peak": ("within", 0.15),
    "bfloat16 load / single-thread raw read": ("at most", 1.0),
    "load without dtype= / load in bfloat16": ("at most", 1.15),
    # A kilobyte over the final bytes (a random key, a scalar) is no copy.
    "device peak / final bytes while loading": ("at most", 1.001),
    # Within the noise of two processes' medians: no step slower than
    # keras-hub's by more than half a percent.
    "autodist's training tokens/s / keras-hub's": ("at least", 0.995),
    "autodist's `fit` tokens/s / keras-hub's": ("at least", 0.995),
    # The same weights and batch: one step's loss, within bfloat16's
    # rounding of a sum over the vocabulary.
    "autodist's first loss / keras-hub's": ("within", 1e-3),
}


def measured_bytes(row) -> int | None:
    """A training row's measured memory: its program's (compiled or named
    in the device's refusal) where read (a TPU's device peak leaves its
    temporaries out), else the device's peak."""
    return row.get("program_bytes") or row.get("peak_bytes")


def target_against_chip(row: dict, predicted: dict) -> tuple[int, int] | None:
    """`(target compile's bytes, the chip's)` of a measured step, each by
    the same measure: the compiler's own peak (`peak_memory_in_bytes`, what
    a target compile reports on a TPU) where the chip's was read, else the
    program's parts summed (temporaries + arguments + outputs - aliased,
    the chip's `program_bytes`), else (predictions saved before they held
    the sum) the target's peak against the chip's program. None where
    either is missing."""
    pairs = (
        (predicted.get("target_peak_bytes"), row.get("compiler_peak_bytes")),
        (predicted.get("target_program_bytes"), row.get("program_bytes")),
        (predicted.get("target_peak_bytes"), measured_bytes(row)),
    )
    return next(((t, c) for t, c in pairs if t and c), None)


def met(target: str, ratio: float) -> bool:
    """Whether `ratio` meets `target`.

    Example:
    >>> met("target compile's peak / measured peak", 0.96)
    True
    """
    kind, bound = TARGETS[target]
    if kind == "within":
        return abs(ratio - 1) <= bound
    return ratio >= bound if kind == "at least" else ratio <= bound


def _row(loading, variant, dtype):
    return next(
        (
            r
            for r in loading
            if r["variant"] == variant and r["dtype"] == dtype and "error" not in r
        ),
        None,
    )


def _ratios(results, predictions):
    """(target, instance, ratio) for every instance the results hold."""
    loading = results["loading"]
    raw = _row(loading, "raw read", None)
    bf16 = _row(loading, "autodist", "bfloat16")
    plain = _row(loading, "autodist", None)
    if raw and bf16:
        yield (
            "bfloat16 load / single-thread raw read",
            "autodist",
            (bf16["seconds"] / raw["seconds"]),
        )
    if bf16 and plain:
        yield (
            "load without dtype= / load in bfloat16",
            "autodist",
            (plain["seconds"] / bf16["seconds"]),
        )
    for row in (bf16, plain):
        if row and row.get("peak_bytes") and row.get("final_bytes"):
            label = f"autodist, dtype={row['dtype']}"
            yield (
                "device peak / final bytes while loading",
                label,
                (row["peak_bytes"] / row["final_bytes"]),
            )
    trained = [r for r in results["training"] if "error" not in r]
    # A step the device refused: the target compile's verdict against it.
    for row in results["training"]:
        predicted = predictions.get(row["step"], {})
        if row["variant"] == "autodist" and "target_refused" in predicted:
            if row.get("refused") or "error" not in row:
                agrees = predicted["target_refused"] == bool(row.get("refused"))
                yield (
                    "target compile's verdict = the device's",
                    row["step"],
                    float(agrees),
                )
    for row in results["training"]:
        verdict = predictions.get(row["step"], {}).get("closed_form_verdict")
        if row["variant"] == "autodist" and verdict:
            if row.get("refused") or "error" not in row:
                wrong = "NO" if not row.get("refused") else "yes"
                yield (
                    "closed form's verdict is not wrong",
                    f"{row['step']} ({verdict})",
                    float(verdict != wrong),
                )
    for row in trained:
        peak = measured_bytes(row)
        if row["variant"] != "autodist" or not peak:
            continue
        pair = target_against_chip(row, predictions.get(row["step"], {}))
        if pair:
            yield (
                "target compile's peak / measured peak",
                row["step"],
                pair[0] / pair[1],
            )
        calibrated = row.get("calibrated_bytes")
        if calibrated:
            yield (
                "calibrated closed form / measured peak",
                row["step"],
                (calibrated / peak),
            )
    yield from speed_ratios(results)
    for row in trained:
        if row["variant"] != "keras-hub":
            continue
        ours = next(
            (r for r in trained if r["step"] == row["step"] and r is not row), None
        )
        if not ours:
            continue
        pairs = [("autodist's first loss / keras-hub's", "first_loss")]
        # The speed part's alternated processes time a step better than
        # the ladder's one process each: where it ran, its ratio stands.
        if row["step"] not in {r["step"] for r in results.get("speed") or []}:
            pairs = list(SPEED_KEYS.items()) + pairs
        for target, key in pairs:
            if ours.get(key) and row.get(key):
                yield target, row["step"], ours[key] / row[key]


# The speed targets, and the figure of a training row each reads.
SPEED_KEYS = {
    "autodist's training tokens/s / keras-hub's": "tokens_per_s",
    "autodist's `fit` tokens/s / keras-hub's": "fit_tokens_per_s",
}


def speed_ratios(results) -> list[tuple[str, str, float]]:
    """(target, instance, ratio) of the part `speed`: per step, the median
    over autodist's processes of each speed figure over keras-hub's median.

    Example:
    >>> rows = [dict(step="s", variant=v, tokens_per_s=t, fit_tokens_per_s=t)
    ...         for v, t in [("keras-hub", 100.0), ("autodist", 99.0),
    ...                      ("autodist", 101.0), ("keras-hub", 100.0)]]
    >>> speed_ratios({"speed": rows})[0]
    ("autodist's training tokens/s / keras-hub's", 's (2 processes each)', 1.0)
    """
    rows = [r for r in results.get("speed") or [] if "error" not in r]
    found = []
    for step in dict.fromkeys(r["step"] for r in rows):
        for target, key in SPEED_KEYS.items():
            figures = {
                variant: [
                    r[key]
                    for r in rows
                    if r["step"] == step and r["variant"] == variant and r.get(key)
                ]
                for variant in ("autodist", "keras-hub")
            }
            if not all(figures.values()):
                continue
            count = min(len(f) for f in figures.values())
            ratio = statistics.median(figures["autodist"]) / statistics.median(
                figures["keras-hub"]
            )
            processes = "process" if count == 1 else "processes"
            found.append((target, f"{step} ({count} {processes} each)", ratio))
    return found


def verdicts(results, predictions) -> list[tuple[str, str, float, bool]]:
    """(target, instance, ratio, met) for each measured instance."""
    return [
        (target, instance, ratio, met(target, ratio))
        for target, instance, ratio in _ratios(results, predictions)
    ]


def table(results, predictions) -> list[str]:
    """The verdicts as Markdown lines."""
    rows = verdicts(results, predictions)
    if not rows:
        return []
    lines = [
        "",
        "### Targets",
        "",
        "| target | instance | ratio | bound | met |",
        "|---|---|---|---|---|",
    ]
    for target, instance, ratio, is_met in rows:
        kind, bound = TARGETS[target]
        shown = {"within": f"1 ± {bound:g}", "at least": f">= {bound:g}"}.get(
            kind, f"<= {bound:g}"
        )
        lines.append(
            f"| {target} | {instance} | {ratio:.3f} | {shown} | "
            f"{'yes' if is_met else '**no**'} |"
        )
    return lines
