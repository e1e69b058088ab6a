"""Mixtures of experts: the Mixtral, Qwen-MoE and Qwen3-MoE rule tables, their
plans, and training / loading on 8 devices against one device."""

import re

import hf_checkpoints
import keras
import keras_hub
import numpy as np
import pytest
from test_dense_families import _spec
from test_from_preset import BATCH
from test_from_preset import batch_for
from test_from_preset import mesh_id
from test_from_preset import optimizer_for

import keras_hub_autodist
from keras_hub_autodist.registry import architecture_for

MIXTRAL = dict(
    vocabulary_size=64,
    num_layers=2,
    num_query_heads=4,
    num_key_value_heads=2,
    hidden_dim=32,
    intermediate_dim=48,
    num_experts=6,
    top_k=2,
)
QWEN_MOE = dict(
    vocabulary_size=64,
    num_layers=2,
    num_query_heads=4,
    num_key_value_heads=2,
    hidden_dim=32,
    intermediate_dim=48,
    moe_intermediate_dim=16,
    shared_expert_intermediate_dim=24,
    num_experts=6,
    top_k=2,
)
QWEN3_MOE = dict(
    vocabulary_size=64,
    num_layers=3,
    num_query_heads=4,
    num_key_value_heads=2,
    hidden_dim=32,
    intermediate_dim=48,
    moe_intermediate_dim=16,
    head_dim=8,
    num_experts=6,
    top_k=2,
    mlp_only_layers=[1],
)

# (backbone class, task class, config) of each tiny family.
FAMILIES = {
    "mixtral": ("MixtralBackbone", "MixtralCausalLM", MIXTRAL),
    "qwen_moe": ("QwenMoeBackbone", "QwenMoeCausalLM", QWEN_MOE),
    "qwen3_moe": ("Qwen3MoeBackbone", "Qwen3MoeCausalLM", QWEN3_MOE),
}
COVERAGE = [
    pytest.param("mixtral", {}, id="mixtral"),
    pytest.param("qwen_moe", {}, id="qwen_moe"),
    # keras-hub 0.32 passes no `layer_index` to Qwen-MoE decoders, so a
    # sparse step of 2 makes every layer a dense MLP (`qwen_moe_mlp_<n>`).
    pytest.param("qwen_moe", {"decoder_sparse_step": 2}, id="qwen_moe-dense"),
    pytest.param("qwen_moe", {"tie_word_embeddings": True}, id="qwen_moe-tied"),
    pytest.param("qwen3_moe", {}, id="qwen3_moe"),
]


def backbone_cls(family):
    return getattr(keras_hub.models, FAMILIES[family][0])


def without_counters(path):
    """A variable path without keras-hub's process-wide layer counters."""
    return re.sub(r"(moe_block|moe_mlp)_\d+", r"\1", path)


@pytest.mark.parametrize("family, overrides", COVERAGE)
def test_rule_table_covers_every_variable_exactly_once(family, overrides):
    cls = backbone_cls(family)
    config = {**FAMILIES[family][2], **overrides}
    handler = architecture_for(cls)
    specs = handler.weights(config, cls)
    # A real build later in the process: keras-hub counts MoE blocks (and
    # Qwen-MoE's dense MLPs) per process, so its paths differ from the
    # abstract build's; the rules must match both.
    model = cls(**config)
    paths = [v.path for v in model.weights]
    assert [without_counters(p) for p in paths] == [
        without_counters(s.path) for s in specs
    ]
    assert paths != [s.path for s in specs]
    for path, variable, spec in zip(paths, model.weights, specs):
        assert [r.pattern for r in handler.matching_rules(path)] == [spec.pattern]
        assert tuple(variable.shape) == spec.shape
    if "decoder_sparse_step" in overrides:
        assert not any("expert" in s.axes for s in specs)
        assert any("qwen_moe_mlp" in s.path for s in specs)


def test_expert_kernels_and_routers_get_their_logical_axes():
    cls = backbone_cls("qwen_moe")
    axes = {
        without_counters(s.path).split("/", 1)[1]: s.axes
        for s in architecture_for(cls).weights(QWEN_MOE, cls)
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


def moe_preset(path, family, num_experts, seed=0):
    """Save a tiny CausalLM of `family` with `num_experts` experts (no
    preprocessor) as a Keras preset."""
    backbone_name, task_name, config = FAMILIES[family]
    keras.utils.set_random_seed(seed)
    backbone = getattr(keras_hub.models, backbone_name)(
        **{**config, "num_experts": num_experts}
    )
    task = getattr(keras_hub.models, task_name)(backbone=backbone, preprocessor=None)
    task.save_to_preset(str(path))
    return str(path)


class _Presets(dict):
    """`(family, num_experts)` → a tiny preset, saved on first use."""

    def __init__(self, root):
        super().__init__()
        self.root = root

    def __missing__(self, key):
        family, experts = key
        self[key] = moe_preset(self.root / f"{family}_{experts}", family, experts)
        return self[key]


@pytest.fixture(scope="module")
def moe_presets(tmp_path_factory):
    return _Presets(tmp_path_factory.mktemp("moe_presets"))


def expert_rows(plan):
    return [row for row in plan.rows if "expert" in row.logical_axes]


def test_plan_experts_that_divide_the_model_axis(moe_presets):
    plan = keras_hub_autodist.plan(
        moe_presets["mixtral", 8], {"batch": 2, "model": 4}, strategy="tp"
    )
    rows = expert_rows(plan)
    assert len(rows) == 3 * MIXTRAL["num_layers"]
    for row in rows:
        assert row.spec == ("model", None, None) and row.note == ""
    routers = [r for r in plan.rows if "unsharded" in r.logical_axes]
    assert routers and all(r.spec == (None, None) for r in routers)


def test_plan_experts_that_do_not_divide_the_model_axis(moe_presets):
    plan = keras_hub_autodist.plan(
        moe_presets["qwen_moe", 6], {"batch": 2, "model": 4}, strategy="tp"
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
    plan = keras_hub_autodist.plan(moe_presets["mixtral", 8], mesh, strategy="tp")
    assert plan.mesh_axes.expert_axis == "expert"
    assert plan.batch_axis == "batch"
    assert "expert axis: expert" in plan.summary()
    for row in expert_rows(plan):
        assert row.spec[0] == "expert" and "model" in row.spec
    others = [r for r in plan.rows if "expert" not in r.logical_axes]
    assert all("expert" not in r.spec for r in others)


# --- Training and loading on 8 devices against one. -------------------------


def train(preset, optimizer="sgd", steps=3, **mesh_kwargs):
    """`test_from_preset.train`, with the weights as a list in model order:
    keras-hub's layer counters name MoE blocks differently in each model."""
    lm = keras_hub.models.CausalLM.from_preset(preset, preprocessor=None, **mesh_kwargs)
    lm.compile(
        optimizer=optimizer_for(optimizer),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    x, y = batch_for(preset)
    losses = [
        float(lm.train_on_batch(x, y, return_dict=True)["loss"]) for _ in range(steps)
    ]
    weights = [(w.path, np.asarray(w.value)) for w in lm.backbone.weights]
    return lm, losses, weights


_references = {}


def reference(preset, optimizer):
    if (preset, optimizer) not in _references:
        _references[preset, optimizer] = train(preset, optimizer)[1:]
    return _references[preset, optimizer]


def assert_same_training(preset, optimizer="sgd", **mesh_kwargs):
    """Losses and weights after 3 steps equal a single-device run, with
    `test_from_preset`'s tolerances, and every variable is laid out as its
    layout-map key says."""
    lm, losses, weights = train(preset, optimizer, **mesh_kwargs)
    ref_losses, ref_weights = reference(preset, optimizer)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    if optimizer == "sgd":
        assert [without_counters(p) for p, _ in weights] == [
            without_counters(p) for p, _ in ref_weights
        ]
        for (path, value), (_, ref) in zip(weights, ref_weights):
            np.testing.assert_allclose(value, ref, atol=1e-5, err_msg=path)
    assert_laid_out_as_planned(lm)
    assert keras.distribution.distribution() is None
    return lm


def assert_laid_out_as_planned(lm):
    """Each variable's sharding is its layout-map key's layout (looked up by
    pattern: the plan's paths come from another build than the model's)."""
    distribution, plan = keras_hub_autodist.distribution_of(lm)
    layout_map = plan.layout_map(distribution.device_mesh)
    for variable in lm.backbone.weights:
        layout = layout_map[variable.path]
        assert layout is not None, variable.path
        spec = tuple(variable.value.sharding.spec) + (None,) * len(variable.shape)
        assert spec[: len(variable.shape)] == tuple(layout.axes), variable.path


EXPERT_MESH = {"batch": 2, "expert": 2, "model": 2}
SLOW = pytest.mark.slow
# The default session trains one case (experts that don't divide the model
# axis: tensor parallelism inside each expert, and Qwen-MoE's shared expert);
# the integration session (`slow`) runs the others.
TRAINING_CASES = [
    pytest.param("qwen_moe", 6, {"batch": 2, "model": 4}, "tp"),
    pytest.param("mixtral", 6, {"batch": 2, "model": 4}, "tp", marks=SLOW),
    pytest.param("qwen_moe", 6, {"model": 8, "batch": 1}, "fsdp", marks=SLOW),
    # 8 experts on model=4 and 8: expert parallelism.
    pytest.param("qwen_moe", 8, {"batch": 2, "model": 4}, "fsdp", marks=SLOW),
    pytest.param("mixtral", 8, {"batch": 1, "model": 8}, "tp", marks=SLOW),
    # A mesh with an expert axis.
    pytest.param("mixtral", 8, EXPERT_MESH, "tp", marks=SLOW),
    pytest.param("qwen_moe", 8, EXPERT_MESH, "fsdp", marks=SLOW),
    pytest.param("mixtral", 6, EXPERT_MESH, "fsdp", marks=SLOW),
]


@pytest.mark.parametrize(
    "family, experts, mesh, strategy",
    TRAINING_CASES,
    ids=lambda v: mesh_id(v) if isinstance(v, dict) else str(v),
)
def test_sgd_training_matches_single_device(
    moe_presets, family, experts, mesh, strategy
):
    assert_same_training(
        moe_presets[family, experts], device_mesh=mesh, strategy=strategy
    )


@pytest.mark.slow
def test_adam_losses_match_single_device(moe_presets):
    assert_same_training(
        moe_presets["mixtral", 6], "adam", device_mesh=EXPERT_MESH, strategy="fsdp"
    )


@pytest.mark.parametrize(
    "family, experts, mesh",
    [
        pytest.param("mixtral", 6, {"batch": 2, "model": 4}),
        pytest.param("mixtral", 8, EXPERT_MESH, marks=SLOW),
        pytest.param("qwen2_moe", 6, {"batch": 1, "model": 8}, marks=SLOW),
        pytest.param("qwen2_moe", 8, {"batch": 2, "model": 4}, marks=SLOW),
        pytest.param("qwen3_moe", 6, {"batch": 2, "model": 4}, marks=SLOW),
        pytest.param("qwen3_moe", 8, EXPERT_MESH, marks=SLOW),
    ],
    ids=lambda v: mesh_id(v) if isinstance(v, dict) else str(v),
)
def test_hugging_face_checkpoint_matches_single_device(tmp_path, family, experts, mesh):
    preset = hf_checkpoints.MOE_WRITERS[family](tmp_path / family, experts)
    x, _ = batch_for(preset)
    single = keras_hub.models.CausalLM.from_preset(preset, preprocessor=None)
    expected = single.predict(x, batch_size=BATCH, verbose=0)
    sharded = keras_hub.models.CausalLM.from_preset(
        preset, preprocessor=None, device_mesh=mesh
    )
    np.testing.assert_allclose(
        sharded.predict(x, batch_size=BATCH, verbose=0), expected, atol=1e-5
    )
    assert_laid_out_as_planned(sharded)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mixtral", "qwen_moe"])
def test_lora_kernels_follow_their_kernels(moe_presets, family):
    lm = keras_hub.models.CausalLM.from_preset(
        moe_presets[family, 6], preprocessor=None, device_mesh={"batch": 2, "model": 4}
    )
    lm.backbone.enable_lora(4)  # keras-hub's default targets: query and value
    with_lora = [
        layer
        for layer in lm.backbone._flatten_layers()
        if getattr(layer, "lora_enabled", False)
    ]
    assert with_lora
    for layer in with_lora:
        kernel = _spec(layer._kernel)
        a, b = _spec(layer.lora_kernel_a), _spec(layer.lora_kernel_b)
        assert a == kernel[:-1] + (None,), (layer.lora_kernel_a.path, a, kernel)
        assert b == (None, kernel[-1]), (layer.lora_kernel_b.path, b, kernel)
    lm.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    x, y = batch_for(moe_presets[family, 6])
    losses = [lm.train_on_batch(x, y) for _ in range(2)]
    assert np.isfinite(losses).all() and losses[1] < losses[0]
    assert keras.distribution.distribution() is None


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mixtral", "qwen_moe"])
def test_sequence_parallel_training_matches_single_device(moe_presets, family):
    """The residual stream outside the MoE blocks is split on the sequence
    over the model axis; training still equals one device."""
    lm = assert_same_training(
        moe_presets[family, 8],
        device_mesh={"batch": 2, "model": 4},
        sequence_parallel=True,
    )
    plan = keras_hub_autodist.distribution_of(lm).plan
    assert set(plan.activation_layouts().values()) == {("batch", "model", None)}
