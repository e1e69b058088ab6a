"""`from_preset(..., device_mesh=...)` against one device: every tiny preset on
every mesh, with every pair of strategy and optimizer values covered
(tests/test_from_preset.py runs one case per mesh)."""

import keras
import keras_hub
import numpy as np
import pytest
import tiny_presets
from equivalence import MESHES
from equivalence import assert_covers_every_pair
from equivalence import assert_same_generate
from equivalence import assert_same_training
from equivalence import batch_for
from equivalence import greedy_tokens
from equivalence import mesh_id
from equivalence import pairwise_cases
from test_from_preset import ROTATION
from test_from_preset import assert_batch_is_sharded_inside_train_step

import keras_hub_autodist

pytestmark = pytest.mark.slow

PRESETS = sorted(tiny_presets.CAUSAL_LMS)
# The runs tests/test_from_preset.py makes.
DEFAULT_SESSION_CASES = [
    (name, mesh_id(mesh), strategy, "sgd")
    for name, mesh, strategy in (case.values for case in ROTATION)
]
CASES = [
    pytest.param(*case, id=f"{case[0]}-{mesh_id(case[1])}-{case[2]}-{case[3]}")
    for case in pairwise_cases(PRESETS, MESHES, skip=DEFAULT_SESSION_CASES)
]


def test_the_cases_cover_every_pair():
    assert_covers_every_pair(PRESETS, MESHES)


@pytest.mark.parametrize("name, mesh, strategy, optimizer", CASES)
def test_training_matches_single_device(
    tiny_presets_dir, name, mesh, strategy, optimizer
):
    assert_same_training(
        tiny_presets_dir[name], optimizer, device_mesh=mesh, strategy=strategy
    )


@pytest.mark.parametrize(
    "name, mesh",
    [
        ("gemma_mqa", {"batch": 1, "model": 8}),
        ("gemma2_gqa", {"batch": 2, "model": 2, "x": 2}),
    ],
    ids=["gemma_mqa", "gemma2_gqa"],
)
def test_greedy_generate_matches_single_device(tiny_presets_dir, name, mesh):
    assert_same_generate(tiny_presets_dir[name], mesh)


@pytest.mark.parametrize(
    "mesh", [{"batch": 4, "model": 2}, {"model": 2, "batch": 4}], ids=mesh_id
)
def test_batch_is_sharded_on_batch_axis_inside_train_step(tiny_presets_dir, mesh):
    assert_batch_is_sharded_inside_train_step(tiny_presets_dir["llama3_untied"], mesh)


def test_two_models_on_two_meshes(tiny_presets_dir):
    preset = tiny_presets_dir["gemma3_text"]
    first = keras_hub.models.CausalLM.from_preset(
        preset, preprocessor=None, device_mesh={"batch": 2, "model": 4}
    )
    second = keras_hub.models.CausalLM.from_preset(
        preset, preprocessor=None, device_mesh={"model": 2, "batch": 4}
    )
    x, y = batch_for(preset)
    for lm in (first, second):
        lm.compile(
            optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(True)
        )
    losses = [
        float(m.train_on_batch(x, y, return_dict=True)["loss"])
        for m in (first, second, first, second)
    ]
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-5)
    np.testing.assert_allclose(losses[2], losses[3], rtol=1e-5)
    for lm, names in ((first, ("batch", "model")), (second, ("model", "batch"))):
        assert tuple(lm.backbone.weights[0].value.sharding.mesh.axis_names) == names


def test_quantize_runs_in_the_models_scope(tiny_presets_dir):
    preset = tiny_presets_dir["llama3_untied"]
    single = keras_hub.models.CausalLM.from_preset(preset, preprocessor=None)
    sharded = keras_hub.models.CausalLM.from_preset(
        preset, preprocessor=None, device_mesh={"batch": 2, "model": 4}
    )
    for lm in (single, sharded):
        lm.quantize("int8")
        lm.compile(sampler="greedy")
    assert keras.distribution.distribution() is None
    mesh_devices = set(
        keras_hub_autodist.distribution_of(
            sharded
        ).distribution.device_mesh.backend_mesh.devices.flat
    )
    for weight in sharded.backbone.weights:
        assert set(weight.value.sharding.device_set) == mesh_devices, weight.path
    np.testing.assert_array_equal(
        greedy_tokens(sharded, preset), greedy_tokens(single, preset)
    )
