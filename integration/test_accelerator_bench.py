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
        [sys.executable, "-m", "bench.accelerator", "--tiny", "--out", str(out)],
        check=True,
        cwd=root,
        timeout=1800,
    )
    results = json.loads((out / "accelerator.json").read_text())
    rows = results["loading"] + results["training"] + results["long_context"]
    assert len(results["loading"]) == 5
    # The tiny full step timed against keras-hub, the tiny LoRA step alone.
    assert len(results["training"]) == 3
    assert len(results["long_context"]) == 2
    assert not [row for row in rows if "error" in row]
    assert (out / "accelerator.md").read_text().startswith("## On one accelerator")
