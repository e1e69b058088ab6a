"""`python -m bench.accelerator` (or `python -m bench --accelerator`): the
benchmark for one accelerator, a GPU (an H200) or a TPU chip (a v5e), in
one command of under 10 minutes.

It makes its own presets (random weights, saved by keras-hub in bfloat16):
nothing is downloaded. Every measurement runs in a fresh process
(`--child`). What it measures depends on the accelerator's family
(`accelerator_choices`), named by `--target` (by default the machine's own:
a v5e on a TPU v5 lite, an h200 on an H200, a v5e on a CPU):

- training steps (`accelerator_steps`), keras-hub against autodist on a
  one-device mesh, on a ladder of batches up to the first the device
  refuses: the step's program memory (XLA's `memory_analysis()` of the step
  Keras jitted, or the bytes in the device's refusal), median seconds per
  `train_on_batch` after warm-up, tokens/s and model TFLOP/s, beside the
  target compile's predictions committed before the run and the closed
  forms (`accelerator_training`);
- loading a preset with `Backbone.from_preset` (a Gemma 7B shape on a GPU,
  the Gemma 2B shape on a 16 GiB TPU chip): keras-hub, autodist and a raw
  read of the files, with `dtype="bfloat16"` and without `dtype=`;
  seconds, device peak and final bytes;
- attention alone at 32k tokens: the family's fused kernel (cuDNN on a
  GPU, splash on a TPU) against the context axis' per-device blockwise
  attention; and on a GPU one long LoRA sequence (`--parts long`).

It writes `accelerator.json` (after every measurement) and `accelerator.md`
(the section "On one accelerator") under `$OUT` or `--out`; `--insert
docs/benchmarks.md` puts the section in that file. `--tiny` runs tiny shapes
on any machine, the CPU included, in a few minutes.
`--predict TARGET` compiles the steps for TARGET here instead, and writes
`bench/predictions/TARGET[-tiny].json`.

On a machine without Keras, bring wheels: `scripts/accelerator_kit.sh`
makes them, and `scripts/accelerator_run.sh` installs them and runs this.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

from bench import accelerator_choices as choices
from bench import accelerator_steps
from bench.accelerator_render import insert
from bench.accelerator_render import merge
from bench.accelerator_render import render

__all__ = ["insert", "main", "merge", "render"]


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        from bench.accelerator_children import child_main

        child_main(argv[1:])
        return 0
    parser = argparse.ArgumentParser(prog="python -m bench.accelerator")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes, any machine")
    parser.add_argument("--out", default=os.environ.get("OUT") or ".", help="folder")
    parser.add_argument("--insert", default=None, help="a Markdown file to update")
    parser.add_argument("--tmp", default=None, help="where to write the presets")
    parser.add_argument(
        "--parts",
        default=None,
        help="comma-separated, of load, train, long, attention, speed, chunks, "
        "search; by default the family's (a TPU: train,load,attention)",
    )
    parser.add_argument(
        "--target",
        default=None,
        help="the accelerator whose steps and committed predictions to use; "
        "by default this machine's (v5e on a CPU)",
    )
    parser.add_argument(
        "--models",
        default=None,
        help="comma-separated keys of accelerator_steps.MODELS: train their "
        "steps alone (e.g. gemma3_1b,llama3.2_1b)",
    )
    parser.add_argument(
        "--labels",
        default=None,
        help="comma-separated labels of accelerator_steps' steps: measure "
        "those alone (e.g. gemma3_1b_32k); with --predict, compile those alone "
        "and keep the other saved predictions",
    )
    parser.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="multiplies each part's time (accelerator_choices.BUDGET_S)",
    )
    parser.add_argument(
        "--predict",
        default=None,
        metavar="TARGET",
        help="compile the steps for TARGET on this machine and save the "
        "predictions (bench/predictions/), instead of measuring",
    )
    parser.add_argument(
        "--render",
        default=None,
        metavar="JSON[,JSON...]",
        help="render saved accelerator.json files (several runs on one "
        "machine, merged) instead of measuring",
    )
    args = parser.parse_args(argv)
    if args.predict:
        labels = None if args.labels is None else args.labels.split(",")
        print(accelerator_steps.write_predictions(args.predict, args.tiny, labels))
        return 0
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.render:
        runs = [json.loads(pathlib.Path(p).read_text()) for p in args.render.split(",")]
        results = runs[0] if len(runs) == 1 else merge(runs)
    else:
        from bench import accelerator_runner

        target = args.target
        probe = None
        if target is None:
            probe = accelerator_runner.probe()
            target = choices.target_of(probe["platform"], probe["device_kind"])
        parts = choices.parts_of(choices.family_of(target), args.parts)
        results = accelerator_runner.run(
            target,
            tiny=args.tiny,
            root=args.tmp,
            out=out,
            parts=parts,
            scale=args.time_scale,
            probed=probe,
            models=None if args.models is None else args.models.split(","),
            labels=None if args.labels is None else args.labels.split(","),
        )
    target = results.get("target") or "h200"
    predictions = accelerator_steps.read_predictions(target, results["tiny"])
    section = render(results, predictions)
    (out / "accelerator.md").write_text(section)
    if args.insert:
        insert(pathlib.Path(args.insert), section)
    print(section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
