import sys
import textwrap

import keras_hub
import pytest
from real_presets import REAL_PRESETS

import keras_hub_autodist
from keras_hub_autodist import UnsupportedArchitectureError
from keras_hub_autodist import cli
from keras_hub_autodist.architectures import registry
from keras_hub_autodist.architectures.gemma import GEMMA
from keras_hub_autodist.architectures.llama import LLAMA


class ToyBackbone(keras_hub.models.Backbone):
    pass


class ToySubBackbone(ToyBackbone):
    pass


@pytest.fixture
def toy_plugin(tmp_path, monkeypatch):
    """A third-party package, installed as metadata on sys.path."""
    (tmp_path / "toy_layouts.py").write_text(
        textwrap.dedent(
            """
            from keras_hub_autodist.architectures.base import Architecture
            from keras_hub_autodist.architectures.base import rule_table

            class Toy(Architecture):
                name = "toy"
                rules = rule_table(("emb/embeddings", ("vocab", "embed")))
                config_fields = {"vocab": "vocabulary_size"}
            """
        )
    )
    info = tmp_path / "toy_layouts-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: toy-layouts\nVersion: 0.1\n"
    )
    (info / "entry_points.txt").write_text(
        "[keras_hub_autodist.architectures]\n"
        "ToyBackbone = toy_layouts:Toy\n"
        "BrokenBackbone = toy_layouts:DoesNotExist\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    registry.clear_cache()
    yield
    sys.modules.pop("toy_layouts", None)
    registry.clear_cache()


def test_builtins_are_registered():
    assert {
        "GemmaBackbone",
        "Gemma3Backbone",
        "LlamaBackbone",
        "MistralBackbone",
    } <= set(registry.registered_architectures())
    assert registry.architecture_for(keras_hub.models.GemmaBackbone) is GEMMA


def test_lookup_follows_mro():
    assert registry.architecture_for(keras_hub.models.Llama3Backbone) is LLAMA


def test_third_party_handler_through_entry_points(toy_plugin):
    handler = registry.architecture_for(ToySubBackbone)
    assert handler.name == "toy"
    variables = [keras_hub_autodist.Weight("emb/embeddings", shape=(8, 4))]
    [weight] = handler.match_variables(variables, "ToySubBackbone")
    assert (weight.shape, weight.logical_axes) == ((8, 4), ("vocab", "embed"))


def test_broken_plugin_warns_and_is_skipped(toy_plugin):
    class BrokenBackbone(keras_hub.models.Backbone):
        pass

    with pytest.warns(UserWarning, match="'BrokenBackbone'.*failed to load"):
        with pytest.raises(
            UnsupportedArchitectureError, match="no layout for BrokenBackbone"
        ):
            registry.architecture_for(BrokenBackbone)


def test_unsupported_error_lists_installed_and_docs():
    with pytest.raises(
        UnsupportedArchitectureError,
        match=r"Supported backbones: .*GemmaBackbone.*keras_hub_autodist.architectures",
    ):
        registry.architecture_for(keras_hub.models.BertBackbone)


def test_console_script_is_in_installed_metadata():
    from importlib import metadata

    scripts = {ep.name for ep in metadata.entry_points(group="console_scripts")}
    assert "keras-hub-autodist" in scripts


def test_cli_prints_table_and_totals(capsys):
    preset = str(REAL_PRESETS / "gemma_2b")
    assert (
        cli.main(["plan", preset, "--mesh", "batch=2,model=4", "--strategy", "fsdp"])
        == 0
    )
    out = capsys.readouterr().out
    assert "decoder_block_*/attention/key/kernel" in out
    assert "strategy: fsdp (requested)" in out and "per device:" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["plan", "x", "--mesh", "batch"], "--mesh takes name=size pairs"),
        (
            ["plan", "x", "--mesh", "batch=2", "--strategy", "zero"],
            "invalid choice: 'zero'",
        ),
        (["plan", "/no/such/preset", "--mesh", "batch=8"], "No such folder: "),
        (["plan", "PRESET", "--mesh", "batch=2,model=4,x=1,y=1"], "have no role"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
    ],
)
def test_cli_errors_are_one_line_with_status_2(argv, message, capsys):
    argv = [a.replace("PRESET", str(REAL_PRESETS / "gemma_2b")) for a in argv]
    try:
        status = cli.main(argv)
    except SystemExit as exit_:
        status = exit_.code
    err = capsys.readouterr().err
    assert status == 2
    assert message in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_lookup_by_class_name_without_keras_hub():
    assert registry.architecture_by_name("GemmaBackbone") is GEMMA
    assert registry.architecture_by_name("Llama3Backbone") is LLAMA
    assert registry.architecture_by_name("GPT2Backbone") is None
