"""The Kaggle notebooks as committed: linked from README.md and docs/index.md,
opened by a pinned install cell and a cell on the license and the
accelerator, and saved with the outputs of their tiny run (plots included).
Executing them is the notebooks session's job (integration/test_notebooks.py)."""

import pathlib
import re

import nbformat
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "docs" / "notebooks").glob("*.ipynb"))
PINNED_GIT_INSTALL = re.compile(r"%pip install .*git\+\{REPOSITORY\}@\{COMMIT\}")


def _notebook(path):
    return nbformat.read(path, as_version=4)


def _code_cells(path):
    return [cell for cell in _notebook(path).cells if cell.cell_type == "code"]


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 2


@pytest.mark.parametrize("page", ["README.md", "docs/index.md"])
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_each_notebook_is_linked(path, page):
    text = (ROOT / page).read_text()
    target = path.relative_to(ROOT if page == "README.md" else ROOT / "docs")
    assert f"]({target.as_posix()})" in text, f"{page} does not link {target}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_each_notebook_starts_with_a_pinned_install_cell(path):
    first = _code_cells(path)[0]
    assert "install" in first.metadata.get("tags", [])
    assert PINNED_GIT_INSTALL.search(first.source), first.source
    assert re.search(r'COMMIT = "[0-9a-f]{40}"', first.source), first.source


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_each_notebook_says_license_and_accelerator_before_installing(path):
    cells = _notebook(path).cells
    install = next(i for i, c in enumerate(cells) if c.cell_type == "code")
    before = " ".join(c.source for c in cells[:install] if c.cell_type == "markdown")
    assert "license" in before.lower() and "accelerator" in before.lower()
    assert "attach" in before.lower()


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_each_notebook_is_committed_with_its_outputs(path):
    cells = _code_cells(path)[1:]  # the install cell's outputs are not kept
    producing = [c for c in cells if "print(" in c.source or "plt.show()" in c.source]
    assert producing and all(c.outputs for c in producing), [
        c.source[:40] for c in producing if not c.outputs
    ]
    images = [o for c in cells for o in c.outputs if "image/png" in o.get("data", {})]
    assert len(images) >= 2  # the loss and the memory per device
    text = "".join(o.get("text", "") for c in cells for o in c.outputs)
    assert (
        "after fine-tuning:" in text and "fox" in text.split("after fine-tuning:")[-1]
    )
