"""Planning a 70B preset: the abstract build's time, memory and cache.

Each preset is planned in a fresh process (`python -m bench.planning CHILD
<config.json>`), so imports, time and peak RSS are its own: the child times
importing keras-hub, the first `plan()` (which builds the backbone abstractly
from config.json: the child's disk cache starts empty), a re-plan of the same
preset on another mesh (served by the cache), and counts JAX's live arrays
before and after.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile

# Llama 3.1 70B and Qwen 2.5 72B: their Hugging Face config.json files, kept
# with the other real configs (tests/test_plan.py plans the 70B too).
PRESETS_DIR = pathlib.Path(__file__).resolve().parents[1] / "tests" / "data" / "presets"
PRESETS = ("llama3.1_70b", "qwen2.5_72b")
FIRST_MESH = {"batch": 16, "model": 16}
SECOND_MESH = {"batch": 8, "model": 32}


def _peak_rss() -> int:
    """This process's peak RSS (VmHWM: per address space, fresh after exec)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def child(folder: str) -> dict:
    import time

    start = time.perf_counter()
    import jax
    import keras_hub  # noqa: F401

    import keras_hub_autodist

    imported = time.perf_counter() - start
    arrays_before = len(jax.live_arrays())
    start = time.perf_counter()
    first = keras_hub_autodist.plan(folder, FIRST_MESH, dtype="bfloat16")
    first_s = time.perf_counter() - start
    start = time.perf_counter()
    keras_hub_autodist.plan(folder, SECOND_MESH, dtype="bfloat16")
    replan_s = time.perf_counter() - start
    return dict(
        import_s=imported,
        first_plan_s=first_s,
        replan_s=replan_s,
        params=first.num_parameters,
        peak_rss=_peak_rss(),
        live_arrays=len(jax.live_arrays()) - arrays_before,
        architecture=first.architecture,
    )


def run() -> list[dict]:
    rows = []
    for name in PRESETS:
        # An empty disk cache: the first plan builds, as a new user's does.
        with tempfile.TemporaryDirectory() as cache:
            folder = str(PRESETS_DIR / name)
            done = subprocess.run(
                [sys.executable, "-m", "bench.planning", "CHILD", folder],
                capture_output=True,
                text=True,
                env={
                    **os.environ,
                    "TF_CPP_MIN_LOG_LEVEL": "3",
                    "KERAS_HUB_AUTODIST_CACHE": cache,
                },
            )
        if done.returncode != 0:
            last = done.stderr.strip().splitlines()[-1:] or ["?"]
            rows.append(dict(preset=name, error=last[0]))
            continue
        result = json.loads(done.stdout.strip().splitlines()[-1])
        rows.append(dict(preset=name, **result))
    return rows


if __name__ == "__main__" and sys.argv[1:2] == ["CHILD"]:
    os.environ["KERAS_BACKEND"] = "jax"
    print(json.dumps(child(sys.argv[2])))
