"""The Kaggle notebooks run end to end in a fresh virtualenv, installed by
their own install cell (pointed at this checkout's wheel), and their
committed outputs are current.

Run by the `notebooks` nox session: each notebook is executed in a fresh
kernel of a new virtualenv that sees the heavy dependencies but not this
package (venvs.bare_venv); the install cell's `%pip install` installs the
wheel, offline. The committed notebook must have the same structure of
outputs (streams, images; not their text or timings), and the tiny run must
end with a better completion than it started with.
"""

import os
import re
import subprocess

import pytest
import venvs
from notebook_runner import NOTEBOOKS
from notebook_runner import execute
from notebook_runner import structure
from notebook_runner import text_of
from notebook_runner import with_install_source

from keras_hub_autodist import demo

pytestmark = pytest.mark.notebooks
KERNEL = "fresh-venv"


@pytest.fixture(scope="module")
def fresh_kernel(tmp_path_factory):
    """A Jupyter kernel of a bare virtualenv, and this checkout's wheel."""
    python = venvs.bare_venv(tmp_path_factory)
    prefix = os.path.dirname(os.path.dirname(python))
    subprocess.run(
        [python, "-m", "ipykernel", "install", "--prefix", prefix, "--name", KERNEL],
        check=True,
        capture_output=True,
    )
    wheel = venvs.build_wheel(tmp_path_factory)
    env = {
        "JUPYTER_PATH": os.path.join(prefix, "share", "jupyter"),
        "PIP_NO_INDEX": "1",
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    }
    return python, wheel, env


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_in_a_fresh_venv_and_its_outputs_are_current(
    path, fresh_kernel, tmp_path
):
    import nbformat

    python, wheel, env = fresh_kernel
    committed = nbformat.read(path, as_version=4)
    notebook = with_install_source(committed, wheel.as_uri())
    execute(notebook, kernel_name=KERNEL, cwd=str(tmp_path), env=env)
    installed = subprocess.run(
        [python, "-m", "pip", "show", "keras-hub-autodist"],
        capture_output=True,
        text=True,
    )
    assert installed.returncode == 0, "the install cell did not install the wheel"
    assert structure(notebook) == structure(committed), (
        "the committed outputs are stale: run "
        "`python integration/notebook_runner.py` and commit the notebooks"
    )
    outputs = text_of(notebook)
    assert "per device:" in outputs  # the plan was printed
    before, after = _completions(outputs)
    assert after != before and after.startswith("the quick brown")
    assert demo.TARGET.split()[3] in after  # "fox": it learned the sentence


def _completions(outputs: str) -> tuple[str, str]:
    """The last completions printed before and after fine-tuning."""
    before = re.findall(r"before fine-tuning: *'([^']*)'", outputs)
    after = re.findall(r"after fine-tuning: *'([^']*)'", outputs)
    assert before and after, outputs[-2000:]
    return before[-1], after[-1]


def test_both_kaggle_notebooks_exist():
    assert {p.stem for p in NOTEBOOKS} == {"gemma_2b_lora_2x_t4", "llama3_tpu_v3_8"}
