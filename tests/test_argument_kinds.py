"""Arguments of the wrong kind are refused up front, with the package's
error naming the argument, what it received and what it takes.

`compiled_memory` checks each argument's kind (`compile_arguments`) and a
task class against the plan's backbone before reading or compiling
anything; `get_layout_map` refuses keywords that are not planning options;
`plan()` and `from_preset(device_mesh=...)` check theirs in `PlanOptions`.
"""

import keras
import keras_hub
import pytest

import keras_hub_autodist
from keras_hub_autodist.errors import ArgumentError
from keras_hub_autodist.errors import AutodistError
from keras_hub_autodist.errors import ModelClassError

MESH = {"batch": 2, "model": 4}


@pytest.fixture(scope="module")
def llama_plan(tiny_presets_dir):
    return keras_hub_autodist.plan(tiny_presets_dir["llama3_untied"], MESH)


WRONG_COMPILE_ARGUMENTS = [
    ("plan", "a plan", ArgumentError),
    ("plan", {"mesh": MESH}, ArgumentError),
    ("device", ["t4"], ArgumentError),
    ("device", 5, ArgumentError),
    ("gradient_accumulation_steps", 0, ArgumentError),
    ("gradient_accumulation_steps", 2.0, ArgumentError),
    ("model_class", "Llama3CausalLM", ModelClassError),
    ("model_class", object(), ModelClassError),
    ("model_class", keras_hub.models.Llama3Backbone, ModelClassError),
    ("model_class", keras_hub.models.GemmaBackbone, ModelClassError),
    ("model_class", keras_hub.models.Backbone, ModelClassError),
    ("model_class", keras.layers.Dense, ModelClassError),
    ("model_class", keras_hub.models.GemmaCausalLM, ModelClassError),
]


def _case_id(name, value) -> str:
    """A case's id, the same in every process (pytest-xdist's workers
    compare them): a class by its name, a bare object without its address."""
    if isinstance(value, type):
        return f"{name}={value.__name__}"
    if type(value) is object:
        return f"{name}=object()"
    return f"{name}={value!r}"


@pytest.mark.parametrize(
    "name, value, error",
    WRONG_COMPILE_ARGUMENTS,
    ids=[_case_id(name, value) for name, value, _ in WRONG_COMPILE_ARGUMENTS],
)
def test_compiled_memory_names_an_argument_of_the_wrong_kind(
    llama_plan, name, value, error, monkeypatch
):
    from keras_hub_autodist.fitting import compiled_step

    def never(*args, **kwargs):
        raise AssertionError("the arguments are checked before the mesh")

    monkeypatch.setattr(compiled_step, "compile_mesh", never)
    arguments = {"plan": llama_plan, "batch_size": 2, "sequence_length": 8}
    arguments[name] = value
    with pytest.raises(error) as raised:
        keras_hub_autodist.compiled_memory(**arguments)
    message = str(raised.value)
    assert isinstance(raised.value, AutodistError)
    assert f"`{name}`" in message and f"Received: {name}=" in message, message


def test_a_backbone_class_as_model_class_names_its_task(llama_plan):
    with pytest.raises(ModelClassError, match=r"pass keras_hub.models.Llama3CausalLM"):
        keras_hub_autodist.compiled_memory(
            llama_plan, 2, 8, model_class=keras_hub.models.Llama3Backbone
        )


def test_a_task_class_of_the_plans_backbone_is_taken(llama_plan):
    from keras_hub_autodist.fitting.compile_arguments import check_argument_kinds
    from keras_hub_autodist.fitting.compile_arguments import check_model_class

    for model_class in (None, keras_hub.models.Llama3CausalLM):
        check_argument_kinds(plan=llama_plan, device="v5e", model_class=model_class)
        check_model_class(model_class, llama_plan)


def test_get_layout_map_refuses_a_keyword_that_is_no_planning_option(
    tiny_presets_dir,
):
    mesh = keras.distribution.DeviceMesh((2, 4), ("batch", "model"))
    with pytest.raises(ArgumentError, match=r"Received: strategies=") as raised:
        keras_hub_autodist.get_layout_map(
            tiny_presets_dir["llama3_untied"], mesh, strategies="tp"
        )
    assert "get_layout_map" in str(raised.value)
