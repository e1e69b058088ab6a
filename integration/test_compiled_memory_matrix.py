"""`LayoutPlan.compiled_memory` on more meshes and models, its closed-form
calibration on CPU, and the accelerator bench's tiny run (the fast cases are
in tests/test_compiled_memory.py)."""

import keras
import keras_hub
import pytest
from test_compiled_memory import BATCH
from test_compiled_memory import SEQ
from test_compiled_memory import _gemma_config
from test_compiled_memory import _mesh
from test_compiled_memory import assert_matches_the_step_compiled_with_real_weights

import keras_hub_autodist
from keras_hub_autodist import MeshError
from keras_hub_autodist import PlanError
from keras_hub_autodist.fitting import step_memory
from keras_hub_autodist.fitting.compiled_step import CompiledMemory
from keras_hub_autodist.fitting.compiled_step import compiled_memory

pytestmark = pytest.mark.slow


def test_matches_the_step_compiled_with_real_weights_fsdp(tiny_presets_dir):
    assert_matches_the_step_compiled_with_real_weights(
        tiny_presets_dir["llama3_untied"],
        keras_hub.models.Llama3CausalLM,
        (4, 2),
        "fsdp",
    )


def test_one_device_mesh_and_a_config_dict(tiny_presets_dir):
    config = {"class_name": "GemmaBackbone", "config": dict(_gemma_config())}
    plan = keras_hub_autodist.plan(config, _mesh((1, 1)), dtype="bfloat16")
    memory = compiled_memory(plan, 2, SEQ, preset=config)
    assert memory.devices == 1
    assert 3 * plan.max_device_bytes <= memory.argument_bytes
    with pytest.raises(PlanError, match=r"pass what you planned as preset="):
        compiled_memory(plan, 2, SEQ)


def test_leaves_the_users_optimizer_unbuilt(tiny_presets_dir):
    plan = keras_hub_autodist.plan(tiny_presets_dir["gemma_mqa"], _mesh((2, 4)))
    optimizer = keras.optimizers.Adam(1e-3)
    count = len(optimizer.variables)
    memory = compiled_memory(plan, BATCH, SEQ, optimizer)
    assert not optimizer.built and len(optimizer.variables) == count
    assert memory.optimizer == "adam"


@pytest.mark.parametrize("shape", [(1, 1), (2, 4)])
def test_cpu_estimate_within_15_percent_of_the_compiled_step(shape):
    config = {
        "class_name": "GemmaBackbone",
        "config": dict(
            vocabulary_size=4096,
            num_layers=2,
            num_query_heads=4,
            num_key_value_heads=1,
            hidden_dim=128,
            intermediate_dim=512,
            head_dim=32,
        ),
    }
    plan = keras_hub_autodist.plan(config, _mesh(shape), strategy="tp")
    compiled = compiled_memory(plan, 8, 128, preset=config)
    estimate = step_memory.step_estimate(plan, 8, 128, platform="cpu")
    assert 0.85 < estimate.total_bytes / compiled.peak_bytes < 1.15


def test_compiles_for_the_planned_shape_over_all_devices(tiny_presets_dir):
    plan = keras_hub_autodist.plan(
        tiny_presets_dir["gemma_mqa"], {"batch": 2, "model": 4}
    )
    with pytest.raises(MeshError, match=r"Received: device_mesh=\{'batch'"):
        compiled_memory(plan, BATCH, SEQ, device_mesh={"batch": 2, "model": 4})
    given = compiled_memory(plan, BATCH, SEQ, device_mesh=_mesh((2, 4)))
    assert isinstance(given, CompiledMemory) and given.devices == 8
    assert compiled_memory(plan, BATCH, SEQ) == given
