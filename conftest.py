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
import tempfile  # noqa: E402

# Abstract builds are cached on disk; tests use a fresh cache of their own.
os.environ.setdefault(
    "KERAS_HUB_AUTODIST_CACHE", tempfile.mkdtemp(prefix="keras_hub_autodist_cache_")
)

import pytest  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "tests"))

import tiny_presets  # noqa: E402

# Real Hugging Face configs (no weights), copied into the repository so that
# a fresh clone needs nothing beside it.
REAL_PRESETS = ROOT / "tests" / "data" / "presets"
# The real configs the planner's per-device targets hold on. Qwen 2.5 0.5B
# misses the fsdp target on a (256, 1) mesh: neither its vocabulary (151936)
# nor its hidden size (896) divide by 256 (tests/test_dense_families.py).
PLANNED_REAL_PRESETS = (
    "gemma2_2b",
    "gemma3_1b",
    "gemma_2b",
    "gemma_7b",
    "llama2_7b",
    "llama3.2_1b",
    "llama3_8b",
    "mixtral_8x7b",
    "qwen1.5_moe_a2.7b",
    "qwen2.5_0.5b",
    "qwen2.5_7b",
)


def shared_presets_dir() -> pathlib.Path:
    """`tests/data/presets`: the real configs the tests plan against."""
    return REAL_PRESETS


@pytest.fixture(scope="session")
def tiny_presets_dir(tmp_path_factory):
    """Every tiny preset of `tiny_presets.BUILDERS`, saved once per session."""
    root = tmp_path_factory.mktemp("tiny_presets")
    return {name: build(root / name) for name, build in tiny_presets.BUILDERS.items()}


@pytest.fixture(scope="session")
def real_configs():
    """The real Hugging Face configs in tests/data/presets (no weights)."""
    root = shared_presets_dir()
    found = sorted(root / name for name in PLANNED_REAL_PRESETS)
    missing = [p for p in found if not (p / "config.json").exists()]
    assert not missing, f"configs missing from {root}: {missing}"
    return found


def pytest_configure(config):
    pytest.shared = shared_presets_dir()
