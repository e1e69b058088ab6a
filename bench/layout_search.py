"""`python -m bench.layout_search`: the layout search's reference points,
run on real configs (tests/data/presets, no weights) for their targets on
this CPU-only machine, each written as its `--search --json` object and
its table to bench/layout_searches/ (the tests and docs/benchmarks.md read
them there). Each case runs twice: cold (the compiles cached in a fresh
folder) and warm (served from it); both times are recorded.

`--measured` instead models the training steps the H200 run measured
(docs/data/accelerator-h200.json): each compiled for one H200 here, its
modelled step time (`step_cost.compiled_cost`) beside the measured one,
written to bench/layout_searches/h200_measured.json.

    python -m bench.layout_search [--case NAME ...] [--cache DIR] [--measured]
"""

from __future__ import annotations

import os

os.environ["KERAS_BACKEND"] = "jax"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import argparse  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import tempfile  # noqa: E402

from keras_hub_autodist.searching import cache as search_cache  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
REAL_PRESETS = HERE.parent / "tests" / "data" / "presets"
RESULTS = HERE / "layout_searches"

# name -> the search's arguments.
CASES = {
    "gemma_7b_lora_2x_t4": dict(
        preset="gemma_7b",
        device="t4",
        devices=2,
        batch_size=1,
        sequence_length=1024,
        lora_rank=4,
        dtype="bfloat16",
    ),
    # The same in float16, which a T4 computes natively.
    "gemma_7b_lora_2x_t4_float16": dict(
        preset="gemma_7b",
        device="t4",
        devices=2,
        batch_size=1,
        sequence_length=1024,
        lora_rank=4,
        dtype="float16",
    ),
    "llama3_8b_full_v5e_8": dict(
        preset="llama3_8b",
        device="v5e",
        devices=8,
        batch_size=8,
        sequence_length=2048,
        dtype="bfloat16",
    ),
    "gemma3_1b_32k_v5e_8": dict(
        preset="gemma3_1b",
        device="v5e",
        devices=8,
        batch_size=1,
        sequence_length=32768,
        dtype="bfloat16",
    ),
}


def run(name: str, cache: pathlib.Path, max_compiles: int) -> dict:
    """One case, cold then warm, as its JSON object with the timings."""
    from keras_hub_autodist.searching.report import table
    from keras_hub_autodist.searching.report import to_json
    from keras_hub_autodist.searching.search import search

    arguments = dict(CASES[name])
    preset = str(REAL_PRESETS / arguments.pop("preset"))
    arguments.update(cache_dir=cache, max_compiles=max_compiles)
    cold = search(preset, **arguments)
    warm = search(preset, **arguments)
    answer = to_json(cold)
    answer["preset"] = pathlib.Path(preset).name
    answer["case"] = name
    answer["cold_seconds"] = cold.seconds
    answer["warm_seconds"] = warm.seconds
    answer["warm_cache_hits"] = warm.cache_hits
    (RESULTS / f"{name}.json").write_text(json.dumps(answer, indent=1) + "\n")
    text = table(cold).replace(preset, answer["preset"])
    (RESULTS / f"{name}.md").write_text(
        f"{text}\n\ncold {cold.seconds:.1f} s, warm {warm.seconds:.2f} s "
        f"({warm.cache_hits} compiles from the cache)\n"
    )
    return answer


def measured(cache: pathlib.Path) -> list[dict]:
    """The H200 run's training steps: modelled against measured."""
    from bench.accelerator_steps import GPU_STEPS
    from bench.accelerator_steps import model_config
    from keras_hub_autodist.fitting.device_profiles import device_speed
    from keras_hub_autodist.fitting.planner import plan
    from keras_hub_autodist.searching import step_cost
    from keras_hub_autodist.searching.search import _compile

    run = json.loads((HERE.parent / "docs/data/accelerator-h200.json").read_text())
    times = {
        row["step"]: row["step_s"]
        for row in run["training"]
        if row.get("variant") == "autodist" and row.get("step_s")
    }
    speed = device_speed("h200")
    rows = []
    # Each step ran at one batch on the H200.
    for step, batch in ((step, step.batches[0]) for step in GPU_STEPS):
        name = step.name(batch)
        if name not in times:
            continue
        class_name, config = model_config(step.model, tiny=False)
        preset = {"class_name": class_name, "config": dict(config)}
        lora = step.lora_rank or None
        layout = plan(
            preset,
            {"batch": 1, "model": 1},
            dtype="bfloat16",
            lora_rank=lora,
            device_memory="h200",
        )
        memory, _ = _compile(
            layout,
            batch,
            step.sequence,
            "adam",
            "h200",
            lora,
            search_cache.compile_cache_folder(cache),
            dict(config),
            preset,
        )
        cost = step_cost.compiled_cost(memory, speed)
        flops = step_cost.model_flops(layout, batch, step.sequence, lora)
        rows.append(
            {
                "step": name,
                "measured_step_seconds": times[name],
                "modelled_step_seconds": cost.seconds,
                "modelled_over_measured": cost.seconds / times[name],
                "roofline_seconds": cost.terms(),
                "hlo_flops": cost.flops,
                "model_flops": flops,
                "hlo_over_model_flops": cost.flops / flops,
            }
        )
        print(rows[-1], flush=True)
    (RESULTS / "h200_measured.json").write_text(json.dumps(rows, indent=1) + "\n")
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", nargs="*", default=list(CASES), choices=list(CASES))
    parser.add_argument("--cache", default=None, help="default: a fresh folder")
    parser.add_argument("--measured", action="store_true")
    parser.add_argument("--max-compiles", type=int, default=4)
    args = parser.parse_args(argv)
    RESULTS.mkdir(exist_ok=True)
    cache = pathlib.Path(args.cache or tempfile.mkdtemp(prefix="layout-search-"))
    if args.measured:
        measured(cache)
        return 0
    for name in args.case:
        answer = run(name, cache, args.max_compiles)
        chosen = answer["chosen"]
        print(
            f"{name}: chosen {chosen['mesh']} {chosen['strategy']} "
            f"remat={chosen['remat']}, {answer['compiles']} compiles, cold "
            f"{answer['cold_seconds']:.1f} s, warm {answer['warm_seconds']:.2f} s",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
