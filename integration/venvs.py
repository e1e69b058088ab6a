"""Fresh virtual environments for the `venv` tests (offline and quick).

Heavy dependencies (keras, keras-hub, jax, TensorFlow) come from the running
environment through a path file; the packages under test, their startup
hooks, metadata and entry points are installed for real with pip.
"""

import os
import pathlib
import subprocess
import sys
import sysconfig
import textwrap

ROOT = str(pathlib.Path(__file__).resolve().parent.parent)


def run(python, code, env=None):
    """Run `code` with `python`, outside the repository and its PYTHONPATH."""
    base = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env = {**base, **(env or {})}
    return subprocess.run(
        [python, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=os.path.dirname(python),  # not the repository: import the installed copy
    )


def pip_install(python, *args):
    """`pip install --no-deps` into the venv of `python`, offline."""
    subprocess.run(
        [python, "-m", "pip", "install", "--no-deps", "--no-index", "-q", *args],
        check=True,
    )


def bare_venv(tmp_path_factory):
    """A new virtual environment that sees the running one's packages (the
    heavy dependencies) but not this package.

    Returns:
        The path of the venv's `python`.
    """
    venv = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    site = run(python, "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    purelib = site.stdout.strip()
    with open(os.path.join(purelib, "_outer_dependencies.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    return python


def build_wheel(tmp_path_factory) -> pathlib.Path:
    """This checkout built as a wheel (no dependencies); its path."""
    wheel_dir = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "-q",
            "-w",
            str(wheel_dir),
            ROOT,
        ],
        check=True,
    )
    return next(wheel_dir.glob("keras_hub_autodist-*.whl"))


def fresh_venv(tmp_path_factory):
    """A new virtual environment with a non-editable install of this package.

    Returns:
        The path of the venv's `python`.
    """
    python = bare_venv(tmp_path_factory)
    pip_install(python, str(build_wheel(tmp_path_factory)))
    purelib = run(python, "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    assert os.path.exists(
        os.path.join(purelib.stdout.strip(), "keras_hub_autodist.pth")
    )
    return python
