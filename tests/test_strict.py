"""Every weight of the built model matches exactly one rule of the plan."""

import dataclasses
import json
import shutil
import types

import keras_hub
import numpy as np
import pytest

import keras_hub_autodist
from keras_hub_autodist import MeshError
from keras_hub_autodist import PlanError
from keras_hub_autodist.architectures.base import Rule
from keras_hub_autodist.architectures.gemma import GEMMA
from keras_hub_autodist.errors import UnplannedWeightError
from keras_hub_autodist.errors import UnplannedWeightWarning
from keras_hub_autodist.errors import WeightShapeError


@pytest.fixture(scope="module")
def backbone_preset(tiny_presets_dir):
    """A bare GemmaBackbone preset (8 query heads, 1 key/value head)."""
    return tiny_presets_dir["gemma_backbone"]


@pytest.fixture(scope="module")
def causal_lm_preset(tiny_presets_dir):
    return tiny_presets_dir["gemma_mqa"]


def _set_query_heads(node, heads):
    """Set `num_query_heads` of every GemmaBackbone config inside `node`."""
    if isinstance(node, dict):
        if node.get("class_name") == "GemmaBackbone":
            node["config"]["num_query_heads"] = heads
        for value in node.values():
            _set_query_heads(value, heads)
    elif isinstance(node, list):
        for value in node:
            _set_query_heads(value, heads)


def test_task_json_disagreeing_with_config_json(causal_lm_preset, tmp_path):
    """config.json plans 8 query heads; task.json builds 4."""
    copy = tmp_path / "lm"
    shutil.copytree(causal_lm_preset, copy)
    task = json.loads((copy / "task.json").read_text())
    _set_query_heads(task, 4)
    (copy / "task.json").write_text(json.dumps(task))
    with pytest.raises(
        WeightShapeError,
        match=r"'decoder_block_0/attention/query/kernel' of GemmaBackbone is built "
        r"with shape \(4, 32, 8\), but the plan.*gives it \(8, 32, 8\) \(dimension "
        r"0 \(heads, set by `num_query_heads`\): planned 8, built 4\).*task\.json"
        r".*config\.json.*Received: built shape \(4, 32, 8\), planned shape "
        r"\(8, 32, 8\)",
    ):
        keras_hub.models.GemmaCausalLM.from_preset(
            str(copy), device_mesh={"batch": 1, "model": 8}
        )


@pytest.fixture
def gemma_without_final_norm(monkeypatch):
    """The Gemma rule table without the final norm's rule."""
    monkeypatch.setattr(
        GEMMA,
        "rules",
        tuple(r for r in GEMMA.rules if r.pattern != "final_normalization/scale"),
    )


def test_an_unplanned_weight_is_an_error(backbone_preset, gemma_without_final_norm):
    with pytest.raises(
        UnplannedWeightError,
        match=r"1 weights of GemmaBackbone match no rule of the 'gemma' "
        r"architecture: final_normalization/scale \(32,\)\. Add a rule.*"
        r"`strict=False`.*Received: 1 unmatched, 0 ambiguous",
    ):
        keras_hub.models.Backbone.from_preset(
            backbone_preset, device_mesh={"batch": 2, "model": 4}
        )
    with pytest.raises(UnplannedWeightError, match="final_normalization/scale"):
        keras_hub_autodist.plan(backbone_preset, {"batch": 2, "model": 4})


def test_strict_false_warns_and_replicates(backbone_preset, gemma_without_final_norm):
    with pytest.warns(
        UnplannedWeightWarning,
        match=r"1 weights of GemmaBackbone match no rule of the 'gemma' "
        r"architecture and stay replicated.*final_normalization/scale",
    ):
        backbone = keras_hub.models.Backbone.from_preset(
            backbone_preset, device_mesh={"batch": 2, "model": 4}, strict=False
        )
    norm = next(w for w in backbone.weights if w.path == "final_normalization/scale")
    assert norm.value.sharding.is_fully_replicated
    reference = keras_hub.models.Backbone.from_preset(backbone_preset)
    expected = next(
        w for w in reference.weights if w.path == "final_normalization/scale"
    )
    np.testing.assert_array_equal(np.asarray(norm.value), np.asarray(expected.value))


def test_a_weight_matching_two_rules_is_an_error(backbone_preset, monkeypatch):
    overlapping = Rule(
        r"decoder_block_\d+/attention/(query|any)/kernel",
        ("heads", "embed", "head_dim"),
    )
    monkeypatch.setattr(GEMMA, "rules", GEMMA.rules + (overlapping,))
    with pytest.raises(
        UnplannedWeightError,
        match=r"match several rules of the 'gemma' architecture "
        r"\(decoder_block_0/attention/query/kernel matches .*Make the rules "
        r"disjoint.*Received: 0 unmatched, 2 ambiguous",
    ):
        keras_hub.models.Backbone.from_preset(
            backbone_preset, device_mesh={"batch": 2, "model": 4}, strict=False
        )


def test_strict_needs_a_device_mesh(backbone_preset):
    with pytest.raises(
        MeshError, match=r"strict= only apply with `device_mesh=`.*'strict': False"
    ):
        keras_hub.models.Backbone.from_preset(backbone_preset, strict=False)
    with pytest.raises(PlanError, match=r"Received: strict='no'"):
        keras_hub_autodist.from_preset(
            keras_hub.models.Backbone,
            backbone_preset,
            device_mesh={"batch": 2, "model": 4},
            strict="no",
        )


def test_weight_check_of_a_plan_without_loading(backbone_preset):
    plan = keras_hub_autodist.plan(backbone_preset, {"batch": 2, "model": 4})
    check = plan.weight_check()
    check.created("decoder_block_1/attention/key/kernel", (1, 32, 8))
    with pytest.raises(WeightShapeError, match=r"planned shape \(1, 32, 8\)"):
        check.created("decoder_block_1/attention/key/kernel", (2, 32, 8))
    # LoRA kernels get rules too.
    assert check.matching_keys("decoder_block_1/attention/key/lora_kernel_a")


def test_a_weight_with_another_path_is_checked_through_its_key(backbone_preset):
    """keras-hub names MoE blocks from a process-wide counter, so built paths
    can differ from the abstract build's: the shape is checked through the
    one layout key the path matches."""
    plan = keras_hub_autodist.plan(backbone_preset, {"batch": 2, "model": 4})
    check = plan.weight_check()
    check.created("decoder_block_7/ffw_linear/kernel", (32, 32))  # same shape
    with pytest.raises(
        WeightShapeError,
        match=r"'decoder_block_7/ffw_linear/kernel' of GemmaBackbone is built "
        r"with shape \(48, 32\).*Received: built shape \(48, 32\), planned shape "
        r"\(32, 32\)",
    ):
        check.created("decoder_block_7/ffw_linear/kernel", (48, 32))
    # The built model is checked the same way, after loading.
    path = "decoder_block_7/ffw_linear/kernel"
    check.built([types.SimpleNamespace(path=path, shape=(32, 32))])
    with pytest.raises(WeightShapeError, match=r"built shape \(48, 32\), planned"):
        check.built([types.SimpleNamespace(path=path, shape=(48, 32))])


def test_a_key_over_weights_of_several_shapes_checks_only_named_paths(
    backbone_preset,
):
    """One key can cover weights of two shapes (Gemma 4's global layers have
    their own head size). A path the plan does not name can't be told which
    shape it should have: only its key is checked."""
    plan = keras_hub_autodist.plan(backbone_preset, {"batch": 2, "model": 4})
    first = next(r for r in plan.rows if r.path.endswith("ffw_linear/kernel"))
    wider = dataclasses.replace(first, shape=(48, 32))
    plan = plan.replace(rows=[wider if r is first else r for r in plan.rows])
    check = plan.weight_check()
    other = "decoder_block_7/ffw_linear/kernel"
    assert check.matching_keys(other) == [first.pattern]
    check.created(other, (48, 32))
    check.created(other, (32, 32))
    with pytest.raises(WeightShapeError, match=r"planned shape \(48, 32\)"):
        check.created(first.path, (32, 32))
