"""Shared by tests/ and integration/: JAX on the CPU with 8 virtual devices.

The environment is set here, before anything imports JAX.
"""

import os

os.environ["KERAS_BACKEND"] = "jax"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8"

import pathlib  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "tests"))

import tiny_presets  # noqa: E402

SHARED_PRESETS = ROOT.parent / "shared" / "presets"


def shared_presets_dir() -> pathlib.Path:
    """`../shared/presets`, beside the repository (as laid out for CI)."""
    override = os.environ.get("KERAS_HUB_AUTODIST_SHARED_PRESETS")
    return pathlib.Path(override) if override else SHARED_PRESETS


@pytest.fixture(scope="session")
def tiny_presets_dir(tmp_path_factory):
    """Every tiny preset of `tiny_presets.BUILDERS`, saved once per session."""
    root = tmp_path_factory.mktemp("tiny_presets")
    return {name: build(root / name) for name, build in tiny_presets.BUILDERS.items()}


@pytest.fixture(scope="session")
def real_configs():
    """The real Hugging Face configs in ../shared/presets (no weights)."""
    root = shared_presets_dir()
    found = sorted(p for p in root.iterdir() if (p / "config.json").exists())
    assert found, f"no configs found in {root}"
    return found


def pytest_configure(config):
    pytest.shared = shared_presets_dir()
