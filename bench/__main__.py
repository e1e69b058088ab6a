"""`python -m bench`: regenerate docs/benchmarks.md and docs/img/*.png.

`python -m bench --only loading` runs section 4 alone and prints it;
`python -m bench --only context` the context-parallelism part of section 2,
`python -m bench --only remat` its rematerialization row,
`python -m bench --only long_context` the context axis' long-sequence curve.

Runs on 8 virtual CPU devices (set here, before JAX starts) in well under
20 minutes on a 2-core CPU. Every number in the document comes from this run.
`python -m bench --accelerator [--tiny]` runs `bench/accelerator.py` instead.
"""

import os

os.environ["KERAS_BACKEND"] = "jax"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import json  # noqa: E402
import pathlib  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import keras_hub_autodist  # noqa: E402, F401
from bench import comms  # noqa: E402
from bench import context  # noqa: E402
from bench import env  # noqa: E402
from bench import generation  # noqa: E402
from bench import loading  # noqa: E402
from bench import memory  # noqa: E402
from bench import models  # noqa: E402
from bench import planning  # noqa: E402
from bench import remat  # noqa: E402
from bench import report  # noqa: E402
from bench import report_context  # noqa: E402
from bench import report_loading  # noqa: E402
from bench import seqpar  # noqa: E402
from bench import steptime  # noqa: E402

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs"


def _context_section(result) -> list[str]:
    (DOCS / "img").mkdir(exist_ok=True)
    return report_context.context_section(result, DOCS / "img")


# `python -m bench --only NAME`: one part alone, printed (the document and
# its JSON are left as they are; the context plot goes to docs/img). Each
# part: what it measures in a temporary folder, and how its section reads.
ONLY = {
    "loading": (loading.run, report_loading.loading_section),
    "context": (
        lambda root: context.run(models.save_presets(root)),
        _context_section,
    ),
    "remat": (remat.run, report_context.remat_section),
    "long_context": (
        context.long_curve,
        report_context.long_context_lines,
    ),
}


def only(name: str) -> int:
    """Run and print the part `name` of `ONLY`."""
    measure, section = ONLY[name]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as root:
        result = measure(root)
    print(json.dumps(result, indent=1, default=str))
    print("\n".join(section(result)))
    print(f"{name} section in {time.perf_counter() - started:.0f} s")
    return 0


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if "--accelerator" in argv:  # the one-accelerator run instead
        from bench import accelerator

        return accelerator.main([a for a in argv if a != "--accelerator"])
    if argv:
        if len(argv) != 2 or argv[0] != "--only" or argv[1] not in ONLY:
            parts = " | ".join(f"--only {name}" for name in ONLY)
            print(
                f"usage: python -m bench [{parts} | --accelerator ...]; "
                f"received: {argv}"
            )
            return 2
        return only(argv[1])
    started = time.perf_counter()
    stamp = env.describe()
    results = {"stamp": stamp}
    print("memory...", flush=True)
    results["memory"] = memory.run()
    print("planning...", flush=True)
    results["planning"] = planning.run()
    with tempfile.TemporaryDirectory() as root:
        paths = models.save_presets(root)
        print("communication...", flush=True)
        results["comms"] = comms.run(paths)
        print("sequence parallelism...", flush=True)
        results["seqpar"] = seqpar.run(paths)
        print("rematerialization...", flush=True)
        results["remat"] = remat.run(root)
        print("context parallelism...", flush=True)
        results["context"] = context.run(paths)
        print("step time...", flush=True)
        results["steptime"] = steptime.run(paths)
        print("generation...", flush=True)
        results["generation"] = generation.run(paths)
        print("loading...", flush=True)
        results["loading"] = loading.run(root)
    results["elapsed_s"] = time.perf_counter() - started
    (DOCS / "img").mkdir(exist_ok=True)
    # The measurements first: a report that fails keeps them.
    (DOCS / "img" / "benchmarks.json").write_text(
        json.dumps(results, indent=1, default=str)
    )
    report.write(results, DOCS / "benchmarks.md", DOCS / "img")
    print(f"wrote {DOCS / 'benchmarks.md'} in {results['elapsed_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
