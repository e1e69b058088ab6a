"""`python -m bench.cross_validation`: the closed form on cases no factor
was fitted to.

The stored target compiles (`bench/target_compiles`) are split into folds,
by family (the config's `model_type`) and by device kind (the target); in
turn each fold is left out, the factors of `target_calibration.FIT_TERMS`
are fitted to the others (`target_calibration.fit`), and the left-out
cases are estimated with those factors. A kind whose calibration has no
case left to fit (a T4, the only kind of its own) takes the factors fitted
to its platform's other kinds (a GPU's). Each fold's cases count toward the
closed form's targets (`target_calibration.CLOSE`, `FAR`, `SHARE`), and a
case whose estimate fits the device where its compile did not is a wrong
yes.

    python -m bench.cross_validation bench/target_compiles/*.jsonl
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys

from bench import target_calibration

# A calibration with no case left, fitted from this one's fit instead.
FALLBACK_CALIBRATION = {"t4": "gpu", "gpu": "t4", "tpu": "gpu"}
# A kernel's factors where no case of its calibration is left to fit them
# (a TPU v5e left out: no other kind runs splash): those read from the
# buffers live at the peak of a program compiled for a v5p (Gemma 3 1B,
# LoRA, 8,192 tokens), which no stored case set.
PRIOR_KERNEL_FACTORS = {
    "splash": {"tpu": {"stream": 4, "attention": 0.5, "scores": 0, "mlp": 1.5}}
}


def family_of(row: dict) -> str:
    """The family of a case: its config's `model_type` (gemma, gemma2,
    llama, qwen2_moe, ...)."""
    path = os.path.join(target_calibration.REAL_PRESETS, row["config"], "config.json")
    with open(path) as f:
        return json.load(f)["model_type"]


FOLDS = {"family": family_of, "target": lambda row: row["target"]}


def _with_factors(fitted: dict, test_calibrations: set[str]) -> list:
    """Put `fitted`'s factors (`target_calibration.fit`'s) in place, those of
    a test calibration with no fit taken from its fallback's; return what
    `_restore` puts back."""
    from keras_hub_autodist.fitting import step_memory
    from keras_hub_autodist.fitting.memory_factors import ACTIVATION_FACTORS

    saved = [(ACTIVATION_FACTORS, copy.deepcopy(ACTIVATION_FACTORS))]
    saved += [(t, copy.deepcopy(t)) for t in step_memory.KERNEL_FACTORS.values()]
    for name in test_calibrations:
        for factor_set in {s for _, s in fitted}:
            source = (
                name if (name, factor_set) in fitted else FALLBACK_CALIBRATION[name]
            )
            factors = fitted.get((source, factor_set))
            if factors is None:
                factors = PRIOR_KERNEL_FACTORS.get(factor_set, {}).get(name)
            if factors is None:
                continue
            if factor_set is None:
                ACTIVATION_FACTORS[name].update(factors)
            else:
                table = step_memory.KERNEL_FACTORS[factor_set]
                table[name] = {**table.get(name, {}), **factors}
    return saved


def _restore(saved: list) -> None:
    for table, values in saved:
        table.clear()
        table.update(values)


def held_out(rows: list[dict], by: str) -> list[dict]:
    """Each compiled case of `rows`, estimated with the factors fitted to
    the other folds of `by` ("family" or "target"), with its fold named."""
    from keras_hub_autodist.fitting import step_memory

    fold_of = FOLDS[by]
    compiled = [row for row in rows if "refused" not in row]
    estimated = []
    for fold in sorted({fold_of(row) for row in compiled}):
        test = [row for row in compiled if fold_of(row) == fold]
        train = [row for row in compiled if fold_of(row) != fold]
        fitted = target_calibration.fit(train)
        calibrations = {step_memory.calibration_of(r["target"])[0] for r in test}
        saved = _with_factors(fitted, calibrations)
        try:
            estimated += [
                {**target_calibration.estimated_again(row), "fold": fold}
                for row in test
            ]
        finally:
            _restore(saved)
    return estimated


def wrong_yes(row: dict) -> bool:
    """Whether the estimate fits the device where the compiled peak does
    not."""
    from keras_hub_autodist.fitting.device_profiles import device_profile

    capacity = device_profile(row["target"]).memory_bytes
    return row["estimate"] <= capacity < row["peak"]


def report(rows: list[dict]) -> str:
    """Markdown: per way of folding, the closed form's targets on the held
    out cases, fold by fold and in all."""
    lines = []
    for by in FOLDS:
        estimated = held_out(rows, by)
        lines.append(f"\n### Each {by} left out in turn\n")
        lines.append(
            "| left out | cases | within 15% | within 25% | wrong yes | range |"
        )
        lines.append("|---|---|---|---|---|---|")
        for fold in dict.fromkeys(r["fold"] for r in estimated):
            mine = [r for r in estimated if r["fold"] == fold]
            lines.append(_row(fold, mine))
        lines.append(_row("**all**", estimated))
    return "\n".join(lines) + "\n"


def _row(name: str, rows: list[dict]) -> str:
    ratios = [r["estimate"] / r["peak"] for r in rows]
    close = sum(abs(x - 1) <= target_calibration.CLOSE for x in ratios)
    far = sum(abs(x - 1) <= target_calibration.FAR for x in ratios)
    wrong = sum(wrong_yes(r) for r in rows)
    return (
        f"| {name} | {len(rows)} | {close} | {far} | {wrong} | "
        f"{min(ratios):.2f}-{max(ratios):.2f}x |"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rows", nargs="+", help="stored cases, JSON lines")
    args = parser.parse_args(argv)
    print(report(target_calibration.stored_rows(args.rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
