"""Run the Kaggle notebooks (docs/notebooks) in their tiny CPU mode.

`python integration/notebook_runner.py` executes each notebook in this
environment and writes it back with its outputs (the committed outputs are
those of the tiny run); the notebooks session (integration/test_notebooks.py)
runs them again in a fresh virtualenv and compares `structure`.

The install cell (tagged `install`) installs the package from git; here its
`git+` requirement is replaced by a local source (`with_install_source`), or
the cell is skipped when writing outputs (this environment has the package),
and its outputs are never kept: they depend on the machine.
"""

from __future__ import annotations

import os
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "docs" / "notebooks").glob("*.ipynb"))
INSTALL_TAG = "install"
# The pinned requirement of the install cell.
GIT_REQUIREMENT = re.compile(r"git\+\{REPOSITORY\}@\{COMMIT\}")
# Environment variables the kernel must not inherit: it starts JAX itself.
NOT_INHERITED = ("XLA_FLAGS", "JAX_PLATFORMS", "KAGGLE_USERNAME", "KAGGLE_KEY")


def is_install_cell(cell) -> bool:
    return INSTALL_TAG in cell.get("metadata", {}).get("tags", [])


def with_install_source(notebook, source: str | None):
    """A copy of `notebook` whose install cell installs `source` (a wheel's
    path) instead of the git commit; with `source=None` the cell does nothing."""
    import copy

    notebook = copy.deepcopy(notebook)
    for cell in notebook.cells:
        if is_install_cell(cell):
            if source is None:
                cell.source = "pass  # the package is installed in this environment"
            else:
                cell.source = GIT_REQUIREMENT.sub(source, cell.source)
    return notebook


def execute(notebook, *, kernel_name: str = "python3", cwd: str, env=None):
    """Run `notebook` (in place) in a fresh kernel, without the parent's device
    flags; returns it."""
    from nbclient import NotebookClient

    saved = dict(os.environ)
    for name in NOT_INHERITED:
        os.environ.pop(name, None)
    os.environ.update(env or {})
    try:
        NotebookClient(
            notebook,
            timeout=900,
            kernel_name=kernel_name,
            resources={"metadata": {"path": cwd}},
        ).execute()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return notebook


def structure(notebook) -> list:
    """Per code cell but the install cell: the kinds of its outputs (stream
    names, MIME types), without their text, timings or counts."""
    cells = []
    for cell in notebook.cells:
        if cell.cell_type != "code" or is_install_cell(cell):
            continue
        kinds = []
        for output in cell.get("outputs", []):
            if output["output_type"] == "stream":
                kind = ("stream", output["name"])
            elif output["output_type"] == "error":
                kind = ("error", output["ename"])
            else:
                kind = (output["output_type"], tuple(sorted(output.get("data", {}))))
            if not kinds or kinds[-1] != kind:
                kinds.append(kind)
        cells.append(kinds)
    return cells


def text_of(notebook) -> str:
    """All stream and plain-text outputs, joined."""
    return "".join(
        output.get("text", "") + output.get("data", {}).get("text/plain", "")
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.get("outputs", [])
    )


def write_outputs(path: pathlib.Path, scratch: str) -> None:
    """Execute `path` here and write it back with its outputs (the install
    cell's source kept, its outputs dropped)."""
    import nbformat

    original = nbformat.read(path, as_version=4)
    executed = execute(with_install_source(original, None), cwd=scratch)
    for cell, ran in zip(original.cells, executed.cells):
        if cell.cell_type == "code" and not is_install_cell(cell):
            cell.outputs, cell.execution_count = ran.outputs, ran.execution_count
    nbformat.write(original, path)


if __name__ == "__main__":
    import tempfile

    for path in NOTEBOOKS if len(sys.argv) < 2 else map(pathlib.Path, sys.argv[1:]):
        with tempfile.TemporaryDirectory() as scratch:
            write_outputs(path, scratch)
        print(f"wrote {path}")
