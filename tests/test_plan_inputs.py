"""`plan()` and `get_layout_map()` take a preset, a config dict or a model."""

import json
import os
import pathlib

import keras
import keras_hub
import pytest
import tiny_presets
from real_presets import REAL_PRESETS

import keras_hub_autodist
from keras_hub_autodist import ConfigError
from keras_hub_autodist import PresetError
from keras_hub_autodist import UnsupportedArchitectureError
from keras_hub_autodist.errors import PlanInputError

MESH = {"batch": 2, "model": 4}
GEMMA_KERAS_CONFIG = {
    "module": "keras_hub.src.models.gemma.gemma_backbone",
    "class_name": "GemmaBackbone",
    "config": {**tiny_presets.GEMMA_MQA, "dtype": "float32", "name": "gemma"},
    "registered_name": "keras_hub>GemmaBackbone",
}


def layout(result):
    return [(r.path, r.shape, r.spec) for r in result.rows]


# A Hugging Face GPT-2 config: keras-hub converts it, no handler lays it out.
GPT2_CONFIG = {
    "model_type": "gpt2",
    "vocab_size": 64,
    "n_layer": 2,
    "n_head": 4,
    "n_embd": 32,
    "n_positions": 16,
    "resid_pdrop": 0.0,
}


def config_json(name):
    return json.loads((REAL_PRESETS / name / "config.json").read_text())


def test_a_path_object_plans_like_its_string():
    path = REAL_PRESETS / "gemma_2b"
    assert layout(keras_hub_autodist.plan(path, MESH)) == layout(
        keras_hub_autodist.plan(str(path), MESH)
    )


def test_a_relative_path_object_is_a_folder_not_a_preset_name(monkeypatch):
    monkeypatch.chdir(REAL_PRESETS)
    result = keras_hub_autodist.plan(pathlib.Path("gemma_2b"), MESH)
    assert result.preset == os.path.join(".", "gemma_2b")
    assert result.backbone_class == "GemmaBackbone"


def test_a_keras_config_json_dict_plans_like_the_folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(GEMMA_KERAS_CONFIG))
    from_dict = keras_hub_autodist.plan(GEMMA_KERAS_CONFIG, MESH)
    assert from_dict.preset == "<config dict>"
    assert layout(from_dict) == layout(keras_hub_autodist.plan(str(tmp_path), MESH))


@pytest.mark.parametrize("name", ["llama3_8b", "gemma3_1b"])
def test_a_hugging_face_config_dict_plans_like_the_folder(name):
    raw = config_json(name)
    from_dict = keras_hub_autodist.plan(raw, MESH)
    assert from_dict.preset == "<Hugging Face config dict>"
    folder = keras_hub_autodist.plan(str(REAL_PRESETS / name), MESH)
    assert layout(from_dict) == layout(folder)
    assert raw == config_json(name)  # the caller's dict is not modified


def test_a_hugging_face_dict_goes_through_keras_hubs_converter():
    with pytest.raises(
        UnsupportedArchitectureError,
        match=r"no layout for GPT2Backbone.*Received: backbone class",
    ):
        keras_hub_autodist.plan(dict(GPT2_CONFIG), MESH)
    with pytest.raises(
        UnsupportedArchitectureError,
        match=r"no converter for Hugging Face model_type='nope'.*Received: preset=",
    ):
        keras_hub_autodist.plan({"model_type": "nope"}, MESH)


def test_a_registered_subclass_is_resolved_by_keras():
    @keras.saving.register_keras_serializable(package="planner_tests")
    class MyGemmaBackbone(keras_hub.models.GemmaBackbone):
        pass

    raw = dict(GEMMA_KERAS_CONFIG, registered_name="planner_tests>MyGemmaBackbone")
    result = keras_hub_autodist.plan(raw, MESH)
    assert (result.backbone_class, result.architecture) == ("MyGemmaBackbone", "gemma")
    with pytest.raises(
        PlanInputError,
        match=r"No class is registered with Keras as 'nobody>X'.*Received: "
        r"registered_name='nobody>X'",
    ):
        keras_hub_autodist.plan(dict(raw, registered_name="nobody>X"), MESH)


@pytest.fixture(scope="module")
def gemma_backbone():
    keras.utils.set_random_seed(0)
    return keras_hub.models.GemmaBackbone(**tiny_presets.GEMMA_MQA)


def weights_of(backbone):
    return sorted((w.path, tuple(w.shape)) for w in backbone.weights)


def test_a_backbone_instance(gemma_backbone):
    result = keras_hub_autodist.plan(gemma_backbone, MESH)
    assert result.preset == "<GemmaBackbone instance>"
    assert sorted((r.path, r.shape) for r in result.rows) == weights_of(gemma_backbone)
    assert "<GemmaBackbone instance> (GemmaBackbone, gemma)" in result.summary()


def test_a_task_instance_plans_its_backbone(gemma_backbone):
    task = keras_hub.models.GemmaCausalLM(gemma_backbone, preprocessor=None)
    result = keras_hub_autodist.plan(task, MESH)
    assert result.preset == "<GemmaCausalLM instance>"
    assert layout(result) == layout(keras_hub_autodist.plan(gemma_backbone, MESH))


def test_get_config_with_its_class(gemma_backbone):
    expected = layout(keras_hub_autodist.plan(gemma_backbone, MESH))
    for class_name in ("GemmaBackbone", keras_hub.models.GemmaBackbone):
        raw = {"class_name": class_name, "config": gemma_backbone.get_config()}
        result = keras_hub_autodist.plan(raw, MESH)
        assert result.preset == "<config dict>"
        assert layout(result) == expected


def test_a_class_name_is_resolved_among_keras_hubs_backbones():
    config = dict(tiny_presets.LLAMA3, tie_word_embeddings=False)
    result = keras_hub_autodist.plan(
        {"class_name": "Llama3Backbone", "config": config}, MESH
    )
    assert result.architecture == "llama"
    # Without a handler by name, keras-hub's class is looked up (its MRO
    # may still have a handler); here it has none.
    with pytest.raises(
        UnsupportedArchitectureError,
        match=r"no layout for GPT2Backbone.*Received: backbone class "
        r"keras_hub\.src\.models\.gpt2",
    ):
        keras_hub_autodist.plan({"class_name": "GPT2Backbone", "config": {}}, MESH)
    with pytest.raises(
        PlanInputError,
        match=r"keras-hub has no backbone class named 'NoSuchBackbone'.*"
        r"Received: class_name='NoSuchBackbone'",
    ):
        keras_hub_autodist.plan({"class_name": "NoSuchBackbone", "config": {}}, MESH)


def test_a_tied_llama_instance_keeps_what_get_config_forgets():
    backbone = keras_hub.models.Llama3Backbone(
        **tiny_presets.LLAMA3, tie_word_embeddings=True
    )
    result = keras_hub_autodist.plan(backbone, MESH)
    assert sorted((r.path, r.shape) for r in result.rows) == weights_of(backbone)
    assert not any("reverse_embeddings" in r.path for r in result.rows)


def test_get_layout_map_of_an_instance(gemma_backbone):
    mesh = keras.distribution.DeviceMesh(
        (2, 4), ("batch", "model"), keras.distribution.list_devices()
    )
    layout_map = keras_hub_autodist.get_layout_map(gemma_backbone, mesh)
    assert layout_map["decoder_block_1/attention/query/kernel"].axes == (
        "model",
        None,
        None,
    )
    from_path = keras_hub_autodist.get_layout_map(REAL_PRESETS / "gemma_2b", mesh)
    assert from_path["token_embedding/embeddings"] is not None


@pytest.mark.parametrize(
    "bad, message",
    [
        (42, r"take a preset .*Received: preset=42 of type int"),
        (
            b"./gemma_2b",
            r"take a preset .*Received: preset=b'./gemma_2b' of type bytes",
        ),
        (
            keras_hub.models.GemmaBackbone,
            r"take a preset .*Received: preset=<class .*GemmaBackbone'> of type",
        ),
        (
            dict(tiny_presets.GEMMA_MQA),
            r"say which backbone.*\{'class_name': 'GemmaBackbone', 'config': "
            r"backbone\.get_config\(\)\}.*Received: a dict with keys "
            r"\['head_dim', 'hidden_dim'",
        ),
        (
            {"class_name": 3, "config": {}},
            r"`class_name` names the backbone class.*Received: class_name=3",
        ),
    ],
)
def test_other_inputs_are_package_errors(bad, message):
    with pytest.raises(PlanInputError, match=message) as caught:
        keras_hub_autodist.plan(bad, MESH)
    assert isinstance(caught.value, (PresetError, TypeError))


def test_a_class_dict_without_a_config_mapping():
    with pytest.raises(
        ConfigError,
        match=r"holds the backbone's arguments under `config`.*Received: "
        r"config=None in preset='<config dict>'",
    ):
        keras_hub_autodist.plan({"class_name": "GemmaBackbone"}, MESH)
