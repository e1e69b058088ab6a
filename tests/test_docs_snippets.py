"""Every code snippet in README.md and docs/*.md runs, so the docs can't rot.

Python blocks of one page run in order in one namespace, in a folder holding
tiny Gemma presets under the names the docs use. `keras-hub-autodist` command
lines in bash blocks run through the CLI, `export NAME=VALUE` lines set the
variable. `bash scripts/...` lines are the two Quick start commands; CI runs
them itself.

The conftest forces the JAX backend for this process, which would hide a
README that forgets to say so: the README's first snippet also runs in a
fresh Python process whose environment has only what the README's bash
blocks before it export (no `KERAS_BACKEND` otherwise), with the startup hook
of a regular install.
"""

import json
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys

import keras
import pytest
import tiny_presets

from keras_hub_autodist import cli

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"```(python|bash)\n(.*?)```", re.DOTALL)
PRESET_NAMES = ["gemma_2b", "gemma_2b_en", "my_gemma_preset"]
EXPORT = re.compile(r"export ([A-Za-z_][A-Za-z0-9_]*)=(\S*)")


def blocks(page):
    return BLOCK.findall(page.read_text())


def shell_lines(code):
    """The commands of a bash block, without comments and blank lines."""
    lines = (line.split("  #")[0].strip() for line in code.splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def exported(line):
    """`(NAME, VALUE)` for an `export NAME=VALUE` line, else `None`."""
    match = EXPORT.fullmatch(line)
    return (match[1], match[2].strip("\"'")) if match else None


@pytest.fixture(scope="module")
def docs_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("docs")
    built = tiny_presets.gemma_preset(folder / PRESET_NAMES[0])
    for name in PRESET_NAMES[1:]:
        shutil.copytree(built, folder / name)
    tiny_presets.gemma3_preset(folder / "gemma3_1b")  # docs/long-context.md
    return folder


def test_every_page_is_checked_and_has_snippets():
    counted = {page.name: len(blocks(page)) for page in PAGES}
    assert counted["README.md"] >= 4 and counted["quickstart.md"] >= 2
    assert counted["architectures.md"] >= 1


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_snippets_run(page, docs_folder, monkeypatch, capsys):
    monkeypatch.chdir(docs_folder)
    # docs/long-context.md: its 32k-token fine-tune, on a tiny Gemma 3 here.
    monkeypatch.setenv("LONG_CONTEXT_TOKENS", "512")
    namespace = {"data": tiny_presets.SENTENCES, "texts": tiny_presets.SENTENCES}
    for language, code in blocks(page):
        if language == "python":
            exec(compile(code, f"{page.name} snippet", "exec"), namespace)
            assert keras.distribution.distribution() is None
            continue
        for line in shell_lines(code):
            if line.startswith("keras-hub-autodist "):
                assert cli.main(shlex.split(line)[1:]) == 0, line
            elif exported(line):
                monkeypatch.setenv(*exported(line))
            elif not line.startswith("bash scripts/"):
                pytest.fail(f"{page.name}: no runner for shell line {line!r}")
    capsys.readouterr()
    assert os.getcwd() == str(docs_folder)


# Runs the README's first Python block as a user following the README would:
# the startup hook of a regular install (`site` reads its .pth file), the
# README's exports, and nothing else choosing the backend.
README_USER = """
import json, site, sys
site.addsitedir(sys.argv[1])
namespace = {"data": json.loads(sys.argv[3])}
exec(compile(open(sys.argv[2]).read(), "README.md first snippet", "exec"), namespace)
import keras
import keras_hub_autodist
distribution, plan = keras_hub_autodist.distribution_of(namespace["lm"])
print("backend:", keras.config.backend(), "mesh:", plan.mesh_axes.describe())
"""


def test_readme_first_snippet_as_written_in_a_fresh_process(docs_folder, tmp_path):
    readme = blocks(ROOT / "README.md")
    first = next(i for i, (language, _) in enumerate(readme) if language == "python")
    env = {
        name: value
        for name, value in os.environ.items()
        if name not in ("KERAS_BACKEND", "PYTHONPATH", "KERAS_HOME")
    }
    for _, code in readme[:first]:
        env.update(dict(filter(None, map(exported, shell_lines(code)))))
    env["PYTHONPATH"] = str(ROOT)  # this checkout's package
    env["KERAS_HOME"] = str(tmp_path / "keras_home")  # no keras.json of ours
    snippet = tmp_path / "snippet.py"
    snippet.write_text(readme[first][1])
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            README_USER,
            str(ROOT / "startup"),
            str(snippet),
            json.dumps(tiny_presets.SENTENCES),
        ],
        cwd=docs_folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "backend: jax mesh: batch=2, model=4" in result.stdout
