"""Every code snippet in README.md and docs/*.md runs, so the docs can't rot.

Python blocks of one page run in order in one namespace, in a folder holding
tiny Gemma presets under the names the docs use. `keras-hub-autodist` command
lines in bash blocks run through the CLI. `bash scripts/...` lines are the
two Quick start commands; CI runs them itself.
"""

import os
import pathlib
import re
import shlex
import shutil

import keras
import pytest

from keras_hub_autodist import cli
from keras_hub_autodist import demo

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"```(python|bash)\n(.*?)```", re.DOTALL)
PRESET_NAMES = ["gemma_2b", "gemma_2b_en", "my_gemma_preset"]


def blocks(page):
    return BLOCK.findall(page.read_text())


@pytest.fixture(scope="module")
def docs_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("docs")
    built = demo.build_tiny_gemma_preset(str(folder / PRESET_NAMES[0]))
    for name in PRESET_NAMES[1:]:
        shutil.copytree(built, folder / name)
    return folder


def test_every_page_is_checked_and_has_snippets():
    counted = {page.name: len(blocks(page)) for page in PAGES}
    assert counted["README.md"] >= 4 and counted["quickstart.md"] >= 2
    assert counted["architectures.md"] >= 1


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_snippets_run(page, docs_folder, monkeypatch, capsys):
    monkeypatch.chdir(docs_folder)
    namespace = {"data": demo.SENTENCES, "texts": demo.SENTENCES}
    for language, code in blocks(page):
        if language == "python":
            exec(compile(code, f"{page.name} snippet", "exec"), namespace)
            assert keras.distribution.distribution() is None
            continue
        for line in code.splitlines():
            line = line.split("  #")[0].strip()
            if line.startswith("keras-hub-autodist "):
                assert cli.main(shlex.split(line)[1:]) == 0, line
            elif line and not line.startswith(("bash scripts/", "#")):
                pytest.fail(f"{page.name}: no runner for shell line {line!r}")
    capsys.readouterr()
    assert os.getcwd() == str(docs_folder)
