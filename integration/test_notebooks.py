"""The Kaggle notebooks run end to end, with their tiny-preset parameters.

Run by the `notebooks` nox session: each notebook is executed in a fresh
kernel (nbclient), so its parameter cell sets the virtual devices before JAX
starts. Outputs are not written back.
"""

import os
import pathlib

import pytest

pytestmark = pytest.mark.notebooks

NOTEBOOKS = sorted(
    (pathlib.Path(__file__).resolve().parents[1] / "docs" / "notebooks").glob("*.ipynb")
)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path, tmp_path):
    import nbformat
    from nbclient import NotebookClient

    notebook = nbformat.read(path, as_version=4)
    env_backup = dict(os.environ)
    # The kernel must start JAX itself: no device flags inherited from pytest.
    for name in ("XLA_FLAGS", "JAX_PLATFORMS", "KAGGLE_USERNAME", "KAGGLE_KEY"):
        os.environ.pop(name, None)
    try:
        NotebookClient(
            notebook,
            timeout=600,
            kernel_name="python3",
            resources={"metadata": {"path": str(tmp_path)}},
        ).execute()
    finally:
        os.environ.clear()
        os.environ.update(env_backup)
    outputs = "".join(
        out.get("text", "")
        for cell in notebook.cells
        if cell.cell_type == "code"
        for out in cell.get("outputs", [])
    )
    assert "per device:" in outputs  # the plan was printed
    assert "the quick brown" in outputs  # the completion was printed


def test_both_kaggle_notebooks_exist():
    assert {p.stem for p in NOTEBOOKS} == {"gemma_2b_lora_2x_t4", "llama3_tpu_v3_8"}
