"""Configs: the fast reader agrees with keras-hub, bad fields are named."""

import json

import keras_hub
import pytest
import tiny_presets
from real_presets import REAL_PRESETS

import keras_hub_autodist
from keras_hub_autodist import ConfigError
from keras_hub_autodist import DTypeError
from keras_hub_autodist import PresetError
from keras_hub_autodist.architectures import registry
from keras_hub_autodist.planning.options import PlanOptions
from keras_hub_autodist.planning.shapes import validated_weights
from keras_hub_autodist.reading.loaders import cached_kaggle_snapshot
from keras_hub_autodist.reading.presets import read_config
from keras_hub_autodist.reading.presets import read_local_config
from keras_hub_autodist.reading.presets import read_preset_config

GEMMA_HF = {
    "architectures": ["GemmaForCausalLM"],
    "model_type": "gemma",
    "vocab_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 1,
    "hidden_size": 64,
    "intermediate_size": 128,
    "head_dim": 8,
}


def _assert_same(fast, slow):
    """The keras-free reading of a preset is keras-hub's, and plans the
    same weights."""
    assert fast is not None
    assert fast.backbone_class == slow.backbone_cls.__name__
    assert fast.format == slow.format
    assert dict(fast.config) == {
        key: value for key, value in slow.config.items() if key in fast.config
    }
    handler = registry.architecture_for(slow.backbone_cls)
    options = PlanOptions()
    read = validated_weights(handler, fast, handler.config_fields, options)
    built = validated_weights(handler, slow, handler.config_fields, options)
    assert read == built


def test_a_hugging_face_config_is_converted_by_keras_hub_once(
    real_configs, tmp_path, monkeypatch
):
    """There is one conversion of each Hugging Face config, keras-hub's: a
    folder keras-hub has not converted yet is read through it, and the
    conversion kept on disk is what later processes read without it."""
    monkeypatch.setenv("KERAS_HUB_AUTODIST_CACHE", str(tmp_path / "cache"))
    for preset in real_configs:
        assert read_local_config(str(preset)) is None, preset.name
        slow = read_preset_config(str(preset))
        _assert_same(read_local_config(str(preset)), slow)


def test_fast_reader_agrees_with_keras_hub_on_tiny_keras_presets(tiny_presets_dir):
    for name in tiny_presets.CAUSAL_LMS:
        path = tiny_presets_dir[name]
        _assert_same(read_local_config(str(path)), read_preset_config(str(path)))


def test_known_subclasses_match_keras_hub():
    for name, base in registry.KNOWN_SUBCLASSES.items():
        cls = getattr(keras_hub.models, name)
        assert getattr(keras_hub.models, base) in cls.__mro__
        assert registry.architecture_by_name(name) is registry.architecture_for(cls)
    assert registry.architecture_by_name("BertBackbone") is None


def test_unknown_formats_take_keras_hubs_path(tmp_path, monkeypatch):
    monkeypatch.setenv("KERAS_HUB_AUTODIST_CACHE", str(tmp_path / "cache"))
    assert read_local_config("gemma_2b_en") is None  # a built-in name
    assert read_local_config("hf://google/gemma-2b") is None
    qwen = str(REAL_PRESETS / "qwen2.5_7b")
    assert read_local_config(qwen) is None  # not converted by keras-hub yet
    assert read_config(qwen).backbone_cls is keras_hub.models.QwenBackbone
    # keras-hub's conversion is now on disk: read without keras-hub next time.
    again = read_local_config(qwen)
    assert (again.backbone_cls, again.backbone_class) == (None, "QwenBackbone")
    assert again.config == read_config(qwen).config


@pytest.mark.parametrize(
    "name, architecture",
    [("mixtral_8x7b", "mixtral"), ("qwen1.5_moe_a2.7b", "qwen_moe")],
)
def test_real_configs_read_by_keras_hub_plan(name, architecture):
    """No keras-free conversion: keras-hub reads them, the model gives shapes."""
    plan = keras_hub_autodist.plan(str(REAL_PRESETS / name), {"batch": 2})
    assert plan.architecture == architecture


def _folder(tmp_path, config):
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


@pytest.mark.parametrize(
    "change, match",
    [
        ({"num_hidden_layers": -1}, r"`num_layers=-1`; it must be a positive"),
        ({"hidden_size": 0}, r"`hidden_dim=0`; it must be a positive"),
        ({"num_key_value_heads": 0}, r"`num_key_value_heads=0`"),
        ({"intermediate_size": "big"}, r"intermediate_size|intermediate_dim"),
        ({"head_dim": "8"}, r"`head_dim='8'`; it must be a positive integer"),
        ({"num_key_value_heads": 3}, r"`num_query_heads=8` is not a multiple of"),
        ({"head_dim": None}, r"Fix `head_dim`.*Received: head_dim=None"),
        ({"num_hidden_layers": True}, r"`num_layers=True`"),
    ],
)
def test_bad_hf_fields_are_named(tmp_path, change, match):
    preset = _folder(tmp_path, {**GEMMA_HF, **change})
    with pytest.raises(ConfigError, match=match) as info:
        keras_hub_autodist.plan(preset, {"batch": 2})
    assert repr(preset) in str(info.value) or "preset=" in str(info.value)


def test_missing_hf_field_is_named(tmp_path):
    config = dict(GEMMA_HF)
    del config["num_attention_heads"]
    preset = _folder(tmp_path, config)
    with pytest.raises(ConfigError, match=r"has no `num_attention_heads`.*Received"):
        keras_hub_autodist.plan(preset, {"batch": 2})
    # keras-hub's own converter path says the same.
    with pytest.raises(ConfigError, match=r"has no `num_attention_heads`"):
        read_preset_config(preset)


def test_missing_keras_field_is_named(tmp_path):
    config = {
        "module": "keras_hub.src.models.gemma.gemma_backbone",
        "class_name": "GemmaBackbone",
        "registered_name": "keras_hub>GemmaBackbone",
        "config": {"vocabulary_size": 256, "num_layers": 2, "hidden_dim": 64},
    }
    preset = _folder(tmp_path, config)
    with pytest.raises(
        ConfigError, match=r"has no `(num_query_heads|intermediate_dim)"
    ):
        keras_hub_autodist.plan(preset, {"batch": 2})
    config["config"] = ["not", "a", "mapping"]
    preset = _folder(tmp_path, config)
    with pytest.raises(ConfigError, match=r"`config` entry.*must be a mapping"):
        keras_hub_autodist.plan(preset, {"batch": 2})


@pytest.mark.parametrize("dtype", [123, "float33", ["bfloat16"]])
def test_bad_dtype_is_a_package_error(dtype):
    with pytest.raises(DTypeError, match=r"Received: dtype="):
        keras_hub_autodist.plan(
            str(REAL_PRESETS / "gemma_2b"), {"batch": 2}, dtype=dtype
        )


def test_kaggle_handles_stay_inside_the_cache():
    for handle in (
        "kaggle://keras/gemma/keras/../../../../etc",
        "kaggle://keras/../keras/gemma_2b_en/2",
        "kaggle://keras//keras/gemma_2b_en/2",
    ):
        with pytest.raises(PresetError, match="Each segment of a Kaggle handle"):
            cached_kaggle_snapshot(handle)
        with pytest.raises(PresetError, match=r"Received: preset='kaggle://"):
            keras_hub_autodist.plan(handle, {"batch": 2})
