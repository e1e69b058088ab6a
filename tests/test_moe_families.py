"""Mixtures of experts: the Mixtral, Qwen-MoE and Qwen3-MoE rule tables, their
plans, and training / loading on 8 devices against one device."""

import hf_checkpoints
import keras
import keras_hub
import numpy as np
import pytest
import tiny_presets
from equivalence import BATCH_SIZE
from equivalence import assert_laid_out_as_planned
from equivalence import assert_same_training
from equivalence import batch_for
from equivalence import without_counters
from tiny_presets import MIXTRAL
from tiny_presets import QWEN_MOE
from tiny_presets import moe_preset_name

import keras_hub_autodist
from keras_hub_autodist.architectures.registry import architecture_for
from keras_hub_autodist.planning.shapes import architecture_weights

COVERAGE = [
    pytest.param("mixtral", {}, id="mixtral"),
    pytest.param("qwen_moe", {}, id="qwen_moe"),
    # A sparse step of 2 gives dense MLP layers (`qwen_moe_mlp_<n>`): every
    # layer in keras-hub 0.32, which passes no `layer_index` to Qwen-MoE
    # decoders, every other layer once it does. The rules cover both.
    pytest.param("qwen_moe", {"decoder_sparse_step": 2}, id="qwen_moe-dense"),
    pytest.param("qwen_moe", {"tie_word_embeddings": True}, id="qwen_moe-tied"),
    pytest.param("qwen3_moe", {}, id="qwen3_moe"),
]


def backbone_cls(family):
    return tiny_presets.MOE_FAMILIES[family][0]


@pytest.mark.parametrize("family, overrides", COVERAGE)
def test_rule_table_covers_every_variable_exactly_once(family, overrides):
    cls = backbone_cls(family)
    config = {**tiny_presets.MOE_FAMILIES[family][2], **overrides}
    handler = architecture_for(cls)
    specs = architecture_weights(handler, config, cls)
    # A real build later in the process: keras-hub counts MoE blocks (and
    # Qwen-MoE's dense MLPs) per process, so its paths differ from the
    # abstract build's; the rules must match both. (The abstract build may
    # come from the disk cache, made in another process with its counters:
    # build again until the paths differ, as a later build's do.)
    for _ in range(3):
        model = cls(**config)
        paths = [v.path for v in model.weights]
        if paths != [s.path for s in specs]:
            break
    assert [without_counters(p) for p in paths] == [
        without_counters(s.path) for s in specs
    ]
    assert paths != [s.path for s in specs]
    for path, variable, spec in zip(paths, model.weights, specs):
        assert [r.pattern for r in handler.matching_rules(path)] == [spec.pattern]
        assert tuple(variable.shape) == spec.shape
    if "decoder_sparse_step" in overrides:
        assert any("qwen_moe_mlp" in s.path for s in specs)


def test_expert_kernels_and_routers_get_their_logical_axes():
    cls = backbone_cls("qwen_moe")
    axes = {
        without_counters(s.path).split("/", 1)[1]: s.logical_axes
        for s in architecture_weights(architecture_for(cls), QWEN_MOE, cls)
        if s.path.startswith("transformer_layer_0/")
    }
    block = "qwen_sparse_moe_block"
    assert axes[f"{block}/experts/expert_feedforward_gate_dense"] == (
        "expert",
        "embed",
        "mlp",
    )
    assert axes[f"{block}/experts/expert_feedforward_output_dense"] == (
        "expert",
        "mlp",
        "embed",
    )
    assert axes[f"{block}/sparse_feedforward_gate_dense/kernel"] == (
        "embed",
        "unsharded",
    )
    assert axes[f"{block}/shared_expert_gate_dense/kernel"] == ("embed", "unsharded")


# --- Plans and training: tiny Keras presets of each family. -----------------


@pytest.fixture(scope="module")
def moe_presets(tiny_presets_dir):
    """`(family, num_experts)` -> a tiny CausalLM preset (no preprocessor)."""
    return lambda family, experts: tiny_presets_dir[moe_preset_name(family, experts)]


def expert_rows(plan):
    return [row for row in plan.rows if "expert" in row.logical_axes]


def test_plan_experts_that_divide_the_model_axis(moe_presets):
    plan = keras_hub_autodist.plan(
        moe_presets("mixtral", 8), {"batch": 2, "model": 4}, strategy="tp"
    )
    rows = expert_rows(plan)
    assert len(rows) == 3 * MIXTRAL["num_layers"]
    for row in rows:
        assert row.spec == ("model", None, None) and row.note == ""
    routers = [r for r in plan.rows if "unsharded" in r.logical_axes]
    assert routers and all(r.spec == (None, None) for r in routers)


def test_plan_experts_that_do_not_divide_the_model_axis(moe_presets):
    plan = keras_hub_autodist.plan(
        moe_presets("qwen_moe", 6), {"batch": 2, "model": 4}, strategy="tp"
    )
    rows = {without_counters(r.path): r for r in expert_rows(plan)}
    experts = "transformer_layer_0/qwen_sparse_moe_block/experts/"
    gate = rows[experts + "expert_feedforward_gate_dense"]
    assert gate.spec == (None, None, "model")
    assert gate.note == (
        "num_experts=6 does not divide by model=4: sharded "
        "moe_intermediate_dim=32 over 'model' instead"
    )
    out = rows[experts + "expert_feedforward_output_dense"]
    assert out.spec == (None, "model", None)
    assert "sharded moe_intermediate_dim=16 over 'model' instead" in out.note
    assert all(r.note for r in plan.fallbacks if "expert" in r.logical_axes)


def test_plan_on_a_mesh_with_an_expert_axis(moe_presets):
    mesh = keras.distribution.DeviceMesh(
        (2, 2, 2), ("batch", "expert", "model"), keras.distribution.list_devices()
    )
    plan = keras_hub_autodist.plan(moe_presets("mixtral", 8), mesh, strategy="tp")
    assert plan.mesh_axes.expert_axis == "expert"
    assert plan.batch_axis == "batch"
    assert "expert axis: expert" in plan.summary()
    for row in expert_rows(plan):
        assert row.spec[0] == "expert" and "model" in row.spec
    others = [r for r in plan.rows if "expert" not in r.logical_axes]
    assert all("expert" not in r.spec for r in others)


# --- Training and loading on 8 devices against one. -------------------------


EXPERT_MESH = {"batch": 2, "expert": 2, "model": 2}


# One case here (experts that don't divide the model axis: tensor
# parallelism inside each expert, and Qwen-MoE's shared expert); the others
# in integration/test_moe_families_matrix.py.


def test_sgd_training_matches_single_device(moe_presets):
    assert_same_training(
        moe_presets("qwen_moe", 6), device_mesh={"batch": 2, "model": 4}, strategy="tp"
    )


def assert_hugging_face_checkpoint_matches_single_device(path, family, experts, mesh):
    """A tiny Hugging Face MoE checkpoint predicts on `mesh` as on one device."""
    preset = hf_checkpoints.MOE_WRITERS[family](path, experts)
    x, _ = batch_for(preset)
    single = keras_hub.models.CausalLM.from_preset(preset, preprocessor=None)
    expected = single.predict(x, batch_size=BATCH_SIZE, verbose=0)
    sharded = keras_hub.models.CausalLM.from_preset(
        preset, preprocessor=None, device_mesh=mesh
    )
    np.testing.assert_allclose(
        sharded.predict(x, batch_size=BATCH_SIZE, verbose=0), expected, atol=1e-5
    )
    assert_laid_out_as_planned(sharded)


def test_hugging_face_checkpoint_matches_single_device(tmp_path):
    assert_hugging_face_checkpoint_matches_single_device(
        tmp_path / "mixtral", "mixtral", 6, {"batch": 2, "model": 4}
    )
