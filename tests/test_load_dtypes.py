"""Dtypes at the door: only float dtypes and mixed policies load, and the
plan's dtype and bytes are those of the model `from_preset` builds."""

import hf_checkpoints
import keras
import keras_hub
import pytest
import tiny_presets
from test_cli import assert_one_line_error
from test_cli import run

import keras_hub_autodist
from keras_hub_autodist.errors import AutodistError
from keras_hub_autodist.errors import DTypeError
from keras_hub_autodist.reading.dtypes import ACCEPTED_DTYPES
from keras_hub_autodist.reading.dtypes import check_dtype

MESH = {"batch": 2, "model": 4}

REFUSED = {
    "int32": "int32",
    "uint8": "uint8",
    "bool": "bool",
    "int8": "int8",
    "string": "string",
    "garbage": "garbage",
    "float": "float",
    "mixed_float32": "mixed_float32",
    "policy-int32": lambda: keras.DTypePolicy("int32"),
    "quantized-policy": lambda: keras.dtype_policies.get("int8_from_float32"),
    "serialized-int32": {
        "module": "keras",
        "class_name": "DTypePolicy",
        "config": {"name": "int32"},
    },
    "number": 32,
}


def _value(kind):
    value = REFUSED[kind]
    return value() if callable(value) else value


@pytest.fixture(scope="module")
def bfloat16_preset(tmp_path_factory):
    # A Keras preset saved in bfloat16, as save_to_preset writes one.
    return tiny_presets.save_preset(
        tmp_path_factory.mktemp("bf16") / "gemma",
        keras_hub.models.GemmaBackbone,
        {**tiny_presets.GEMMA_MQA, "dtype": "bfloat16"},
        task_class=keras_hub.models.GemmaCausalLM,
    )


@pytest.mark.parametrize("kind", sorted(REFUSED))
def test_plan_refuses_every_dtype_but_floats_and_mixed_policies(kind, bfloat16_preset):
    with pytest.raises(DTypeError) as raised:
        keras_hub_autodist.plan(bfloat16_preset, MESH, dtype=_value(kind))
    assert isinstance(raised.value, AutodistError)
    message = str(raised.value)
    assert all(repr(name) in message for name in ACCEPTED_DTYPES), message
    assert "Received: dtype=" in message


@pytest.mark.parametrize("kind", ["int32", "int8", "policy-int32"])
def test_from_preset_refuses_them_before_loading(kind, bfloat16_preset, monkeypatch):
    from keras_hub_autodist import pipeline

    monkeypatch.setattr(
        pipeline, "original_from_preset", lambda cls: pytest.fail("loaded")
    )
    with pytest.raises(DTypeError, match="mixed_bfloat16"):
        keras_hub_autodist.from_preset(
            keras_hub.models.GemmaCausalLM,
            bfloat16_preset,
            device_mesh=MESH,
            dtype=_value(kind),
        )


@pytest.mark.parametrize("dtype", ["string", "int32", "int8"])
def test_the_command_refuses_them_in_one_line(dtype, bfloat16_preset, capsys):
    argv = ["plan", bfloat16_preset, "--mesh", "batch=2", "--dtype", dtype]
    status, _, err = run(argv, capsys)
    assert_one_line_error(status, err, "mixed_bfloat16")


@pytest.mark.parametrize(
    "dtype",
    [
        *ACCEPTED_DTYPES,
        None,
        keras.DTypePolicy("mixed_float16"),
        {
            "module": "keras",
            "class_name": "DTypePolicy",
            "config": {"name": "bfloat16"},
        },
    ],
)
def test_floats_and_mixed_policies_are_accepted(dtype):
    assert check_dtype(dtype) is dtype


def _built_bytes(model):
    backbone = getattr(model, "backbone", model)
    return sum(w.numpy().nbytes for w in backbone.weights if w.trainable)


def _assert_plans_what_loads(model, planned):
    backbone = getattr(model, "backbone", model)
    built = {str(w.dtype) for w in backbone.weights if w.trainable}
    assert built == {planned.dtype}
    assert planned.total_bytes == _built_bytes(model)
    bound = keras_hub_autodist.distribution_of(model).plan
    assert (bound.dtype, bound.total_bytes) == (planned.dtype, planned.total_bytes)


@pytest.mark.parametrize("dtype", [None, "float16", "mixed_bfloat16"])
@pytest.mark.parametrize(
    "model_class", [keras_hub.models.GemmaCausalLM, keras_hub.models.GemmaBackbone]
)
def test_a_keras_preset_is_planned_in_the_dtype_it_loads_in(
    dtype, model_class, bfloat16_preset
):
    # keras-hub builds a preset saved in bfloat16 in Keras' global policy
    # (float32) when no dtype= is passed: so does the plan.
    planned = keras_hub_autodist.plan(bfloat16_preset, MESH, dtype=dtype)
    model = keras_hub_autodist.from_preset(
        model_class, bfloat16_preset, device_mesh=MESH, dtype=dtype
    )
    _assert_plans_what_loads(model, planned)


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_a_hugging_face_preset_is_planned_in_the_dtype_it_loads_in(dtype, tmp_path):
    folder = hf_checkpoints.llama3(tmp_path / "llama")
    planned = keras_hub_autodist.plan(folder, MESH, dtype=dtype)
    model = keras_hub_autodist.from_preset(
        keras_hub.models.LlamaBackbone, folder, device_mesh=MESH, dtype=dtype
    )
    _assert_plans_what_loads(model, planned)


def test_keras_global_policy_is_the_default(bfloat16_preset):
    before = keras.config.dtype_policy()
    keras.config.set_dtype_policy("float16")
    try:
        planned = keras_hub_autodist.plan(bfloat16_preset, MESH)
        model = keras_hub_autodist.from_preset(
            keras_hub.models.GemmaBackbone, bfloat16_preset, device_mesh=MESH
        )
    finally:
        keras.config.set_dtype_policy(before)
    assert planned.dtype == "float16"
    _assert_plans_what_loads(model, planned)


def test_a_config_dict_keeps_its_own_dtype():
    config = {"class_name": "GemmaBackbone", "config": {**tiny_presets.GEMMA_MQA}}
    config["config"]["dtype"] = "bfloat16"
    assert keras_hub_autodist.plan(config, MESH).dtype == "bfloat16"
