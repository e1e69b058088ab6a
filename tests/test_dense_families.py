"""The dense families added with the rule tables: Qwen 2/2.5, Qwen 3, Phi-3,
SmolLM3 and Gemma 4, each with a tiny real model.

For each family: the rule table covers every variable of the built model
exactly once, an unmatched variable is reported, and training on 8 devices
equals one device (one case here; every family, mesh and strategy, Hugging
Face loading and LoRA in integration/test_dense_families_matrix.py).
"""

import re

import keras_hub
import pytest
import tiny_presets
from equivalence import assert_same_training
from real_presets import REAL_PRESETS

import keras_hub_autodist
from keras_hub_autodist.architectures.gemma4 import GEMMA4
from keras_hub_autodist.architectures.phi3 import PHI3
from keras_hub_autodist.architectures.qwen import QWEN
from keras_hub_autodist.architectures.qwen import QWEN3
from keras_hub_autodist.architectures.smollm3 import SMOLLM3
from keras_hub_autodist.errors import UnplannedWeightError
from keras_hub_autodist.errors import UnplannedWeightWarning
from keras_hub_autodist.registry import architecture_for
from keras_hub_autodist.shapes import architecture_weights

# Each backbone class's rule table.
TABLES = {
    keras_hub.models.QwenBackbone: QWEN,
    keras_hub.models.Qwen3Backbone: QWEN3,
    keras_hub.models.Phi3Backbone: PHI3,
    keras_hub.models.SmolLM3Backbone: SMOLLM3,
    keras_hub.models.Gemma4Backbone: GEMMA4,
}
# name -> (backbone class, rule table, tiny config).
FAMILIES = {
    name: (cls, TABLES[cls], config)
    for name, (cls, _, config) in tiny_presets.DENSE_FAMILIES.items()
}
VARIANTS = {
    name: (cls, TABLES[cls], config)
    for name, (cls, _, config) in tiny_presets.DENSE_VARIANTS.items()
}


def _mesh_id(mesh):
    return "-".join(f"{k}{v}" for k, v in mesh.items())


# (a) The rule table covers every variable exactly once.


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_rule_table_covers_every_variable_once(name):
    cls, table, config = VARIANTS[name]
    assert architecture_for(cls) is table
    specs = architecture_weights(table, config, cls)
    paths = [spec.path for spec in specs]
    # keras-hub builds SmolLM3's `o_proj` and `rotary_emb` outside their
    # layer's name scope: the same path in every layer.
    repeated = {path for path in paths if paths.count(path) > 1}
    assert repeated <= {"o_proj/kernel", "rotary_emb/inv_freq"}
    for spec in specs:
        matching = [r for r in table.rules if re.fullmatch(r.pattern, spec.path)]
        assert len(matching) == 1, spec.path
        assert spec.logical_axes == matching[0].axes
    assert len(table.rules) <= 15


def test_every_rule_is_used_by_some_variant():
    for table in {id(t): t for _, t, _ in VARIANTS.values()}.values():
        used = {
            spec.pattern
            for cls, other, config in VARIANTS.values()
            if other is table
            for spec in architecture_weights(other, config, cls)
        }
        assert used == {rule.pattern for rule in table.rules}, table.name


def _with_extra_variable(cls):
    class WithExtra(cls):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.extra_scale = self.add_weight(
                shape=(3,), initializer="ones", name="extra_scale"
            )

    WithExtra.__name__ = f"Extra{cls.__name__}"
    return WithExtra


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_an_unmatched_variable_is_reported(name):
    cls, table, config = FAMILIES[name]
    extra = _with_extra_variable(cls)
    with pytest.raises(
        UnplannedWeightError,
        match=rf"1 weights of Extra{cls.__name__} match no rule of the "
        rf"'{table.name}' architecture: \S*extra_scale \(3,\)",
    ):
        architecture_weights(table, config, extra)
    with pytest.warns(UnplannedWeightWarning, match="extra_scale"):
        specs = architecture_weights(table, config, extra, strict=False)
    (spec,) = [s for s in specs if s.path.endswith("extra_scale")]
    assert spec.logical_axes == ("unsharded",)


# The planner's per-device targets on the real Qwen 2.5 0.5B config (7B is in
# real_presets.PLANNED_REAL_PRESETS with the others): tp <= 1.10 x total / model
# axis; fsdp <= 1.05 x total / devices, except on a (256, 1) mesh: JAX shards
# evenly only, and neither the vocabulary (151936), the hidden size (896),
# the heads (14, 2) nor head_dim (64) divide by 256.


@pytest.mark.parametrize("model_size", [1, 2, 4, 8])
def test_qwen2_5_0_5b_tp_target(model_size):
    plan = keras_hub_autodist.plan(
        str(REAL_PRESETS / "qwen2.5_0.5b"),
        {"batch": 1, "model": model_size},
        strategy="tp",
    )
    assert plan.architecture == "qwen"
    assert plan.max_device_bytes <= 1.10 * plan.total_bytes / model_size


@pytest.mark.parametrize(
    "mesh",
    [{"batch": 8, "model": 1}, {"batch": 8, "model": 8}, {"batch": 32, "model": 8}],
    ids=_mesh_id,
)
def test_qwen2_5_0_5b_fsdp_target(mesh):
    devices = mesh["batch"] * mesh["model"]
    plan = keras_hub_autodist.plan(
        str(REAL_PRESETS / "qwen2.5_0.5b"), mesh, strategy="fsdp"
    )
    assert plan.max_device_bytes <= 1.05 * plan.total_bytes / devices


def test_qwen2_5_0_5b_on_256_data_parallel_devices():
    plan = keras_hub_autodist.plan(
        str(REAL_PRESETS / "qwen2.5_0.5b"),
        {"batch": 256, "model": 1},
        strategy="fsdp",
    )
    assert plan.max_device_bytes > 1.05 * plan.total_bytes / 256
    # As good as even sharding allows: a weight stays whole only when none of
    # its dimensions divides by 256, and its note says so.
    whole = [r for r in plan.rows if "batch" not in r.spec]
    assert {r.path for r in whole} >= {"token_embedding/embeddings"}
    for row in whole:
        assert all(size % 256 for size in row.shape), row
        assert "divides by batch=256: replicated over 'batch'" in row.note, row
    split = [r for r in plan.rows if "batch" in r.spec]
    assert split and all(r.device_bytes * 256 == r.bytes for r in split)


# Training on 8 devices equals one device: one heavy case here; every
# family, mesh and strategy in the integration session.


def test_sgd_training_matches_single_device(tiny_presets_dir):
    name = "qwen2"
    assert_same_training(
        tiny_presets_dir[name],
        "sgd",
        task=tiny_presets.DENSE_FAMILIES[name][1],
        device_mesh={"batch": 2, "model": 4},
        strategy="tp",
    )
