"""Sessions: `tests` (default), `integration`, `matrices`, `multihost`,
`notebooks`, `lint`, `docs` (the site, strict), and `bench` and `versions`
(the lowest and highest declared versions), not run by CI. `slow` is
`integration`, `multihost` and `notebooks` in one run, as CI runs them.

The equivalence matrices' cases (tests/matrices.py) run in `matrices`
alone, not in `tests` or `integration`: CI runs those of the files whose
checked code changed since the matrices last passed in full.

Run with `nox` (the uv backend makes sessions start in seconds):

    nox -s tests
"""

import os
import pathlib

import nox

nox.options.default_venv_backend = "uv|virtualenv"
nox.options.sessions = ["tests"]
nox.options.reuse_existing_virtualenvs = True

TEST_ENV = {
    "KERAS_BACKEND": "jax",
    "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
    "TF_CPP_MIN_LOG_LEVEL": "3",
}
# The test sessions' extras: the test tools, and the TPU and GPU compilers
# that the memory check's target compiles run on (libtpu and the JAX CUDA
# plugin: about 400 MB to download, 1.2 GB installed; tests that need them
# skip, saying so, where they are missing).
TEST_EXTRAS = "dev,tpu-compile,gpu-compile"
# JAX's persistent compilation cache, shared by every session of one checkout
# (CI's fresh clone starts it empty): the sessions compile the same tiny
# models again and again, and a compiled step is read back instead. Every
# entry is kept, however small or quick to compile.
COMPILATION_CACHE = {
    "JAX_COMPILATION_CACHE_DIR": str(
        pathlib.Path(__file__).resolve().parent / ".nox" / "jax-compilation-cache"
    ),
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",
}


def _pytest(session, *args):
    """Install the package with its test dependencies and run pytest."""
    session.install("-e", f".[{TEST_EXTRAS}]")
    _run_pytest(session, *args, *session.posargs)


def _run_pytest(session, *args):
    """Run pytest on two workers in the session's environment."""
    session.run(
        "pytest",
        "-p",
        "no:cacheprovider",
        "-W",
        "ignore::DeprecationWarning",
        # The slowest tests of each session, in CI's log: where its time goes.
        "--durations=25",
        # Two workers (pytest-xdist), each taking the next test when free:
        # a test's time is much spent single-threaded (tracing, compiling,
        # building models) or waiting on its child processes, so two share
        # two cores well. More can be asked for after `--`, e.g. `-n 4`.
        "-n",
        "2",
        "--dist",
        "worksteal",
        *args,
        env={
            **TEST_ENV,
            **COMPILATION_CACHE,
            **{k: v for k, v in os.environ.items() if k.startswith("KERAS_HUB")},
        },
    )


@nox.session
def tests(session):
    """tests/ and the package's doctests on 8 virtual CPU devices (no network,
    no accelerator): the default session, and what a bare `pytest` runs
    (without the doctests)."""
    _pytest(
        session, "tests", "keras_hub_autodist", "--doctest-modules", "-m", "not matrix"
    )


@nox.session
def integration(session):
    """integration/ but multihost and notebooks: hubs and formats, LoRA,
    save/reload, generate, the full equivalence matrices and the
    fresh-virtualenv plugin tests."""
    _pytest(
        session,
        "integration",
        "-m",
        "not multihost and not notebooks and not bench and not matrix",
    )


@nox.session
def matrices(session):
    """The equivalence matrices' cases (tests/matrices.py), of the test
    files given after `--` (CI: those whose checked code changed), else of
    every file; a run of every file that passes records what it checked
    (.ci/matrices-passed.json, to commit)."""
    files = session.posargs or ["tests", "integration"]
    session.install("-e", f".[{TEST_EXTRAS}]")
    selection = "matrix and not multihost and not notebooks and not bench"
    _run_pytest(session, *files, "-m", selection)
    if not session.posargs:
        session.run("python", "tests/matrices.py", "--record")


# The tests `versions` runs: the per-device attention kernels, the chunked
# loss, loading (Keras presets, and safetensors files through keras-hub),
# the plan and the data path, and the extras' checkpoints (orbax) and plots
# (matplotlib).
VERSIONS_TESTS = [
    "tests/test_every_mesh_attention.py",
    "tests/test_chunked_loss.py",
    "tests/test_from_preset.py",
    "tests/test_plan.py",
    "tests/test_data_path.py",
    "tests/test_loading.py",
    "tests/test_checkpointing.py",
    "tests/test_plot.py",
]
# Which package versions each of `versions`' environments lists before its
# tests: Python's, and those of what the package requires (its extras' too).
SHOW_VERSIONS = """
import importlib.metadata as m, platform, re
names = ["jaxlib", "numpy"] + [
    re.match(r"[A-Za-z0-9._-]+", r).group()
    for r in m.requires("keras-hub-autodist")
]
found = {}
for name in names:
    try:
        found[name] = m.version(name)
    except m.PackageNotFoundError:
        pass
print("Python", platform.python_version(), "with", ", ".join(
    f"{name} {version}" for name, version in sorted(found.items())))
"""


# uv alone resolves to the lowest versions (`--resolution lowest-direct`).
@nox.session(venv_backend="uv")
@nox.parametrize(("python", "resolution"), [("3.11", "lowest"), ("3.13", "highest")])
def versions(session, resolution):
    """The core tests (VERSIONS_TESTS) at the lowest versions pyproject.toml
    declares, on the lowest Python it declares, and at the newest versions
    on Python 3.13 (not run by CI). `lowest` is uv's lowest-direct
    resolution: each requirement of the package and its test extras at its
    lower bound, what those need at their newest. nox skips an interpreter
    it cannot find, saying so (`--error-on-missing-interpreters` fails
    instead)."""
    resolve = ["--resolution", "lowest-direct"] if resolution == "lowest" else []
    # --upgrade: resolved afresh each run, not kept from a reused environment.
    session.install("--upgrade", *resolve, "-e", f".[{TEST_EXTRAS}]")
    shown = session.run("python", "-c", SHOW_VERSIONS, silent=True, log=False)
    if shown:  # None where `--install-only` skips running
        session.log(shown.strip())
    _run_pytest(session, *VERSIONS_TESTS, "-m", "not matrix", *session.posargs)


@nox.session
def multihost(session):
    """2 processes x 4 virtual CPU devices on 127.0.0.1 against one process."""
    _pytest(session, "integration", "-m", "multihost")


def _install_with_a_kernel(session):
    """Install the package with its test dependencies, and the session's
    Jupyter kernel (`python3`) that the notebooks run on."""
    session.install("-e", f".[{TEST_EXTRAS}]")
    session.run(
        "python", "-m", "ipykernel", "install", "--sys-prefix", "--name", "python3"
    )


@nox.session
def notebooks(session):
    """Execute docs/notebooks end to end with their tiny-preset parameters,
    each in a fresh virtualenv installed by its own install cell (pointed at
    this checkout's wheel), and check their committed outputs are current
    (`python integration/notebook_runner.py` rewrites them)."""
    _install_with_a_kernel(session)
    _run_pytest(session, "integration", "-m", "notebooks", *session.posargs)


@nox.session
def slow(session):
    """`integration`, `multihost` and `notebooks` in one environment and one
    pool of two workers (CI's run): each session alone ends with one worker
    idle behind its longest test (the two-process resume after kills, 4.6
    minutes), and makes its own environment."""
    _install_with_a_kernel(session)
    _run_pytest(
        session, "integration", "-m", "not matrix and not bench", *session.posargs
    )


@nox.session
def bench(session):
    """Check the benchmark scripts on tiny shapes, then regenerate
    docs/benchmarks.md and docs/img/*.png (not run by CI)."""
    _pytest(session, "integration", "-m", "bench")
    session.install("matplotlib")
    session.run("python", "-m", "bench", env=TEST_ENV)


@nox.session
def lint(session):
    """ruff check and ruff format --check."""
    session.install("ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def docs(session):
    """Build the documentation site from docs/ (mkdocs.yml) in strict mode:
    a broken link, a missing anchor or a page left out of the nav fails it.
    The API reference is read from the docstrings without importing the
    package."""
    session.install("mkdocs-material>=9.5", "mkdocstrings[python]>=0.26")
    session.run(
        "mkdocs",
        "build",
        "--strict",
        "--site-dir",
        str(pathlib.Path(session.create_tmp()) / "site"),
        env={"NO_MKDOCS_2_WARNING": "1"},
    )
