"""Every option is declared once (`options.OPTIONS`); every list of keywords
and every signature that takes them agrees with that declaration."""

import ast
import dataclasses
import inspect
import pathlib

import keras_hub
import pytest

import keras_hub_autodist
from keras_hub_autodist import pipeline
from keras_hub_autodist import plugin
from keras_hub_autodist.fitting import planner
from keras_hub_autodist.planning import options

ROOT = pathlib.Path(__file__).resolve().parents[1]
DECLARED = {o.name: o.default for o in options.OPTIONS}


def _keywords(function, skip):
    return {
        name: parameter.default
        for name, parameter in inspect.signature(function).parameters.items()
        if parameter.kind is parameter.KEYWORD_ONLY and name not in skip
    }


def test_plan_options_are_the_planning_options():
    fields = {f.name: f.default for f in dataclasses.fields(options.PlanOptions)}
    assert fields == {name: DECLARED[name] for name in options.PLANNING_KEYWORDS}


def test_plan_takes_the_planning_options():
    assert _keywords(planner.plan, skip={"num_devices", "batch_size"}) == {
        name: DECLARED[name] for name in options.PLANNING_KEYWORDS
    }


def test_from_preset_takes_the_distribution_options():
    assert _keywords(pipeline.from_preset, skip={"device_mesh"}) == {
        name: DECLARED[name] for name in options.DISTRIBUTION_KEYWORDS
    }


def test_the_documentation_from_preset_gains_names_each_option():
    for name in ("device_mesh",) + options.DISTRIBUTION_KEYWORDS:
        assert f" {name}: " in plugin.DEVICE_MESH_DOC, name


def test_the_startup_hooks_guard_rejects_every_distribution_keyword():
    """The hook can't import the package (it must stay light): its copy of
    the keywords is read from its source."""
    source = (ROOT / "startup" / "keras_hub_autodist_hook.py").read_text()
    [keywords] = [
        ast.literal_eval(node.value)
        for node in ast.parse(source).body
        if isinstance(node, ast.Assign) and node.targets[0].id == "MESH_KEYWORDS"
    ]
    assert keywords == ("device_mesh",) + options.DISTRIBUTION_KEYWORDS


@pytest.mark.parametrize("name, value", [("lora_rank", 4), ("device_memory", 2**30)])
def test_from_preset_refuses_an_option_of_plan_alone_with_what_to_do(
    tiny_presets_dir, name, value
):
    with pytest.raises(keras_hub_autodist.ArgumentError, match=rf"Received: {name}="):
        keras_hub.models.Backbone.from_preset(
            tiny_presets_dir["gemma_mqa"],
            device_mesh={"batch": 2, "model": 4},
            **{name: value},
        )


# --- remat= is checked whole --------------------------------------------------

ACCEPTED_REMAT = [
    None,
    "full",
    "dots",
    "larger_than",
    {"mode": "full"},
    {"mode": "dots"},
    {"mode": "larger_than"},
    {"mode": "larger_than", "output_size_threshold": 2**20},
    {"mode": "list_of_layers", "layer_names": ["mlp"]},
    {"mode": "list_of_layers", "layer_names": ("mlp", "attention")},
]
REFUSED_REMAT = {
    "keras-argument-misnamed": {"mode": "larger_than", "threshold": 1024},
    "unknown-key-under-full": {"mode": "full", "layers": ["mlp"]},
    "threshold-under-full": {"mode": "full", "output_size_threshold": 8},
    "threshold-under-dots": {"mode": "dots", "output_size_threshold": 8},
    "alias-of-full": "block_inputs",
    "offload-not-offered": "offload_dots",
    "names-under-larger-than": {"mode": "larger_than", "layer_names": ["mlp"]},
    "threshold-a-string": {"mode": "larger_than", "output_size_threshold": "big"},
    "threshold-zero": {"mode": "larger_than", "output_size_threshold": 0},
    "threshold-a-bool": {"mode": "larger_than", "output_size_threshold": True},
    "threshold-a-float": {"mode": "larger_than", "output_size_threshold": 1e3},
    "names-missing": {"mode": "list_of_layers"},
    "names-empty": {"mode": "list_of_layers", "layer_names": []},
    "names-a-string": {"mode": "list_of_layers", "layer_names": "mlp"},
    "names-not-strings": {"mode": "list_of_layers", "layer_names": [3]},
    "list-mode-bare": "list_of_layers",
    "no-mode": {"output_size_threshold": 8},
    "mode-unknown": {"mode": "most"},
    "mode-not-a-string": {"mode": ["full"]},
    "name-unknown": "most",
    "a-list": ["full"],
    "a-bool": True,
}


@pytest.mark.parametrize("remat", ACCEPTED_REMAT)
def test_every_accepted_remat_form_passes(remat):
    assert options.PlanOptions(remat=remat).remat is remat


@pytest.mark.parametrize("kind", sorted(REFUSED_REMAT))
def test_every_other_remat_is_refused_at_the_door(kind):
    remat = REFUSED_REMAT[kind]
    with pytest.raises(keras_hub_autodist.PlanError) as raised:
        options.PlanOptions(remat=remat)
    message = str(raised.value)
    assert f"Received: remat={remat!r}" in message
    assert "{'mode': 'larger_than', 'output_size_threshold': 2**20}" in message


def test_from_preset_refuses_a_wrong_remat_before_loading(monkeypatch, tmp_path):
    monkeypatch.setattr(
        pipeline, "original_from_preset", lambda cls: pytest.fail("loaded")
    )
    with pytest.raises(keras_hub_autodist.PlanError, match="'threshold'"):
        keras_hub_autodist.from_preset(
            keras_hub.models.GemmaCausalLM,
            str(tmp_path),
            device_mesh={"batch": 2},
            remat={"mode": "larger_than", "threshold": 1024},
        )
