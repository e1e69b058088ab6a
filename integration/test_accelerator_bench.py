"""The accelerator bench's tiny run on CPU, in the `bench` session with the
benchmark it checks (`nox -s bench`; a run takes minutes)."""

import pytest

pytestmark = pytest.mark.bench


def test_accelerator_bench_runs_tiny(tmp_path):
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "out"
    subprocess.run(
        # Time enough for a shared CPU: the parts' times are a TPU chip's.
        [
            sys.executable,
            "-m",
            "bench.accelerator",
            "--tiny",
            "--time-scale",
            "4",
            "--out",
            str(out),
        ],
        check=True,
        cwd=root,
        timeout=1800,
    )
    from bench import accelerator_choices
    from bench import accelerator_steps

    results = json.loads((out / "accelerator.json").read_text())
    # On a CPU the run is the v5e's: its tiny steps, keras-hub beside
    # autodist on every batch of each ladder (none refused on a CPU).
    assert results["target"] == "v5e"
    rows = results["loading"] + results["training"] + results["attention"]
    assert len(results["loading"]) == 5
    steps = accelerator_steps.steps_of("tpu", tiny=True)
    assert len(results["training"]) == sum(2 * len(s.batches) for s in steps)
    cases = accelerator_choices.attention_cases("tpu", tiny=True)
    assert [r["variant"] for r in results["attention"]] == [c[0] for c in cases]
    assert not [row for row in rows if "error" in row]
    assert all(row["program_bytes"] > 0 for row in results["training"])
    assert not results["skipped"]
    assert (out / "accelerator.md").read_text().startswith("## On one TPU chip")
