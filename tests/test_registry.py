"""Built-in families registered in code; plugins through entry points."""

import os
import pathlib
import re
import subprocess
import sys
import textwrap
import warnings
from importlib import metadata

import pytest
from real_presets import REAL_PRESETS

import keras_hub_autodist
from keras_hub_autodist import UnsupportedArchitectureError
from keras_hub_autodist import registry
from keras_hub_autodist.architectures.gemma import GEMMA

# The built-in families, as the "Supported backbones" list of errors shows them.
BUILTINS = re.escape(", ".join(sorted(registry.BUILTIN_ARCHITECTURES)))

ROOT = pathlib.Path(__file__).resolve().parents[1]
MESH = {"batch": 2, "model": 4}
# A Hugging Face Mistral config (no real Mistral config is in tests/data).
MISTRAL = {
    "model_type": "mistral",
    "vocab_size": 1000,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
}
# One real config per built-in family, and the handler that must plan it.
FAMILIES = [
    ("gemma_2b", "GemmaBackbone", "gemma"),
    ("gemma2_2b", "GemmaBackbone", "gemma"),
    ("gemma3_1b", "Gemma3Backbone", "gemma3"),
    ("llama2_7b", "Llama3Backbone", "llama"),
    ("llama3_8b", "Llama3Backbone", "llama"),
    (MISTRAL, "MistralBackbone", "mistral"),
]


@pytest.fixture
def no_installed_metadata(monkeypatch):
    """As in a source checkout that was never installed: no entry points."""
    monkeypatch.setattr(metadata, "entry_points", lambda **kwargs: [])
    registry.clear_cache()
    yield
    registry.clear_cache()


def _plugin(folder: pathlib.Path, dist: str, lines: str) -> pathlib.Path:
    """A distribution named `dist` with entry points `lines`, in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    info = folder / f"{dist}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n"
    )
    (info / "entry_points.txt").write_text(
        f"[keras_hub_autodist.architectures]\n{lines}\n"
    )
    return folder


@pytest.fixture
def plugins(tmp_path, monkeypatch):
    """Install fake plugin distributions on sys.path, each in its own folder.

    `install(name, lines)` prepends one: the last installed is found first.
    """
    (tmp_path / "dup_layouts.py").write_text(
        textwrap.dedent(
            """
            from keras_hub_autodist.architectures.gemma import GemmaArchitecture

            class Other(GemmaArchitecture):
                name = "other"

            OTHER = Other()
            SECOND = Other()
            SECOND.name = "second"
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))

    def install(dist, lines):
        monkeypatch.syspath_prepend(str(_plugin(tmp_path / dist, dist, lines)))
        registry.clear_cache()

    yield install
    sys.modules.pop("dup_layouts", None)
    registry.clear_cache()


@pytest.mark.parametrize("preset, backbone, handler", FAMILIES)
def test_builtins_plan_without_installed_metadata(
    no_installed_metadata, preset, backbone, handler
):
    if isinstance(preset, str):
        preset = str(REAL_PRESETS / preset)
    result = keras_hub_autodist.plan(preset, MESH)
    assert (result.backbone_class, result.architecture) == (backbone, handler)
    assert registry.architecture_sources() == {
        name: "built-in" for name in registry.BUILTIN_ARCHITECTURES
    }


def test_source_checkout_plans_in_a_fresh_process(tmp_path):
    """`PYTHONPATH=<checkout>` and no entry points at all: every built-in
    family plans from the model; a later process plans the same folders
    from the disk cache without importing Keras."""
    code = textwrap.dedent(
        f"""
        import sys
        from importlib import metadata
        metadata.entry_points = lambda **kwargs: []
        import keras_hub_autodist
        names = {[p for p, _, _ in FAMILIES if isinstance(p, str)]!r}
        for name in names:
            plan = keras_hub_autodist.plan(
                {str(REAL_PRESETS)!r} + "/" + name, {MESH!r})
            print(name, plan.architecture)
        print("keras imported:", "keras" in sys.modules)
        """
    )
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "KERAS_HUB_AUTODIST_CACHE": str(tmp_path / "cache"),
    }
    runs = [
        subprocess.run(
            [sys.executable, "-c", code],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        for _ in range(2)
    ]
    for done in runs:
        assert done.returncode == 0, done.stderr
        assert "gemma3_1b gemma3" in done.stdout and "llama3_8b llama" in done.stdout
    first, second = (done.stdout for done in runs)
    assert "keras imported: True" in first  # built abstractly by keras-hub
    assert "keras imported: False" in second  # read from the disk cache
    assert first.replace("True", "False") == second


def test_unsupported_error_lists_the_builtins_without_metadata(no_installed_metadata):
    with pytest.raises(
        UnsupportedArchitectureError,
        match=rf"no layout for GPT2Backbone\. Supported backbones: {BUILTINS}\. "
        r".*Received: ",
    ):
        registry.architecture_for(type("GPT2Backbone", (), {}))


def test_plugin_named_like_a_builtin_warns_and_the_builtin_wins(plugins):
    plugins("dup-layouts", "GemmaBackbone = dup_layouts:OTHER")
    with pytest.warns(
        UserWarning,
        match=r"two architectures are registered for 'GemmaBackbone'.*"
        r"Using keras_hub_autodist\.architectures\.gemma:GEMMA \(built-in\)",
    ):
        assert registry.architecture_by_name("GemmaBackbone") is GEMMA
    assert registry.architecture_sources()["GemmaBackbone"] == "built-in"


def test_two_plugins_with_one_name_warn_and_the_first_wins(plugins):
    plugins("second-layouts", "OtherBackbone = dup_layouts:SECOND")
    plugins("first-layouts", "OtherBackbone = dup_layouts:OTHER")
    with pytest.warns(
        UserWarning,
        match=r"for 'OtherBackbone': dup_layouts:OTHER \(plugin first-layouts\) "
        r"and dup_layouts:SECOND \(plugin second-layouts\)\. Using "
        r"dup_layouts:OTHER",
    ):
        assert registry.architecture_by_name("OtherBackbone").name == "other"


def test_an_entry_point_naming_the_builtin_itself_is_no_conflict(plugins):
    # e.g. the metadata of an older install of this package.
    plugins(
        "stale-copy", "GemmaBackbone = keras_hub_autodist.architectures.gemma:GEMMA"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert registry.architecture_by_name("GemmaBackbone") is GEMMA


def test_a_broken_plugin_warns_and_the_error_names_it(plugins):
    plugins("broken-layouts", "BrokenBackbone = dup_layouts:DOES_NOT_EXIST")
    with pytest.warns(UserWarning, match=r"'BrokenBackbone'.*failed to load"):
        with pytest.raises(
            UnsupportedArchitectureError,
            match=rf"Supported backbones: {BUILTINS}\. Failed to load \(see the "
            r"warnings\): "
            r"BrokenBackbone = dup_layouts:DOES_NOT_EXIST \(AttributeError",
        ):
            registry.architecture_for(type("BrokenBackbone", (), {}))
    # Planning other families is unaffected.
    assert keras_hub_autodist.plan(str(REAL_PRESETS / "gemma_2b"), MESH).rows


def test_builtins_are_not_in_pyproject_entry_points():
    """Registered in code only, so an installed copy can't disagree."""
    text = (ROOT / "pyproject.toml").read_text()
    for value in registry.BUILTIN_ARCHITECTURES.values():
        assert value not in text
