"""Shared by tests/ and integration/: JAX on the CPU with 8 virtual devices.

The environment is set here, before anything imports JAX.
"""

import os

os.environ["KERAS_BACKEND"] = "jax"
# JAX's own backend is the CPU, even where an accelerator's compiler is
# installed (the tpu-compile and gpu-compile extras): the tests reach those
# compilers through compile-only devices, never as JAX's backend.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8"

import pathlib  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

# Abstract builds are cached on disk; tests use a fresh cache of their own.
os.environ.setdefault(
    "KERAS_HUB_AUTODIST_CACHE", tempfile.mkdtemp(prefix="keras_hub_autodist_cache_")
)

import pytest  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent
# tests/ holds the helper modules both sessions import: the tiny-preset
# factory, the equivalence check, the real configs.
sys.path.insert(0, str(ROOT / "tests"))

import matrices  # noqa: E402
import real_presets  # noqa: E402
import tiny_presets  # noqa: E402


@pytest.fixture(scope="session")
def tiny_presets_dir(tmp_path_factory):
    """Name -> folder of each tiny preset of `tiny_presets.BUILDERS`, saved on
    first use and shared by the whole session."""
    return tiny_presets.PresetFolder(tmp_path_factory.mktemp("tiny_presets"))


@pytest.fixture(scope="session")
def real_configs():
    """The real Hugging Face configs in tests/data/presets (no weights)."""
    root = real_presets.REAL_PRESETS
    found = sorted(root / name for name in real_presets.PLANNED_REAL_PRESETS)
    missing = [p for p in found if not (p / "config.json").exists()]
    assert not missing, f"configs missing from {root}: {missing}"
    return found


# The default session (tests/) must stay fast: tests that train for long or
# build virtual environments live in integration/.
INTEGRATION_MARKERS = ("slow", "venv")


# Before `-m` selects: the matrix cases are marked as they are collected.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    matrices.mark_matrix_cases(items)
    misplaced = [
        item.nodeid
        for item in items
        if item.nodeid.startswith("tests/")
        and any(item.get_closest_marker(name) for name in INTEGRATION_MARKERS)
    ]
    if misplaced:
        raise pytest.UsageError(
            f"tests/ is the default session; tests marked {INTEGRATION_MARKERS} "
            f"belong in integration/. Move them there. Received: {misplaced[:5]}"
        )
