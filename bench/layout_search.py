"""`python -m bench.layout_search`: the layout search's reference points,
run on real configs (tests/data/presets, no weights) for their targets on
this CPU-only machine, each written as its `--search --json` object and
its table to bench/layout_searches/ (the tests and docs/benchmarks.md read
them there). Each case runs twice: cold (the compiles cached in a fresh
folder) and warm (served from it); both times are recorded.

    python -m bench.layout_search [--case NAME ...] [--cache DIR]
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


def run(name: str, cache: pathlib.Path) -> dict:
    """One case, cold then warm, as its JSON object with the timings."""
    from keras_hub_autodist.fitting.search import search
    from keras_hub_autodist.fitting.search_report import table
    from keras_hub_autodist.fitting.search_report import to_json

    arguments = dict(CASES[name])
    preset = str(REAL_PRESETS / arguments.pop("preset"))
    cold = search(preset, cache_dir=cache, **arguments)
    warm = search(preset, cache_dir=cache, **arguments)
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", nargs="*", default=list(CASES), choices=list(CASES))
    parser.add_argument("--cache", default=None, help="default: a fresh folder")
    args = parser.parse_args(argv)
    RESULTS.mkdir(exist_ok=True)
    cache = pathlib.Path(args.cache or tempfile.mkdtemp(prefix="layout-search-"))
    for name in args.case:
        answer = run(name, cache)
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
