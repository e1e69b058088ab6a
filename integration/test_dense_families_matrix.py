"""The dense families on every mesh and strategy, from Hugging Face
checkpoints, and with LoRA (tests/test_dense_families.py checks their rule
tables and trains one case).

Each family's tiny preset is a CausalLM without a tokenizer
(`preprocessor=None`), loaded with its own class (see
`tiny_presets.DENSE_FAMILIES`).
"""

import functools

import hf_checkpoints
import keras
import keras_hub
import numpy as np
import pytest
import tiny_presets
from equivalence import assert_laid_out_as_planned
from equivalence import assert_lora_kernels_follow_their_kernels
from equivalence import assert_same_training
from equivalence import batch_for
from equivalence import mesh_id

import keras_hub_autodist
from keras_hub_autodist.registry import architecture_for
from keras_hub_autodist.shapes import architecture_weights

pytestmark = pytest.mark.slow

FAMILIES = sorted(tiny_presets.DENSE_FAMILIES)
MESHES = [
    {"batch": 2, "model": 4},
    {"batch": 4, "model": 2},
    {"batch": 1, "model": 8},
    {"model": 4, "batch": 2},
]


def task_of(name):
    return tiny_presets.DENSE_VARIANTS[name][1]


def family_batch(name, preset):
    """Token ids (and Gemma 4's position ids) with next-token labels."""
    return batch_for(preset, position_ids=name.startswith("gemma4"))


@pytest.mark.parametrize("name", sorted(tiny_presets.DENSE_VARIANTS))
def test_abstract_build_sees_the_built_variables(name):
    cls, _, config = tiny_presets.DENSE_VARIANTS[name]
    backbone = cls(**config)
    specs = architecture_weights(architecture_for(cls), config, cls)
    assert [s.path for s in specs] == [v.path for v in backbone.weights]
    assert [s.shape for s in specs] == [tuple(v.shape) for v in backbone.weights]


# The case tests/test_dense_families.py trains.
DEFAULT_SESSION_CASE = ("qwen2", "batch2-model4", "tp")
TRAINING_CASES = [
    pytest.param(name, mesh, strategy, id=f"{name}-{mesh_id(mesh)}-{strategy}")
    for name in FAMILIES
    for mesh in MESHES
    for strategy in ("tp", "fsdp")
    if (name, mesh_id(mesh), strategy) != DEFAULT_SESSION_CASE
]


@pytest.mark.parametrize("name, mesh, strategy", TRAINING_CASES)
def test_sgd_training_matches_single_device(tiny_presets_dir, name, mesh, strategy):
    preset = tiny_presets_dir[name]
    assert_same_training(
        preset,
        "sgd",
        task=task_of(name),
        batch=family_batch(name, preset),
        device_mesh=mesh,
        strategy=strategy,
    )


# Gemma 4's per-layer inputs make the tiny model ill-conditioned in float32:
# each block RMS-normalizes `per_layer_up_proj(gelu(per_layer_input_gate(x))
# * per_layer_input)`, a vector of only 4 gated features whose RMS is as low
# as 1e-3 for some tokens (median 0.3), which multiplies float32 rounding by
# up to ~1000. One device already shows it without any mesh: evaluating the
# batch one example at a time changes the logits by 3.3e-5 (float32; 4e-7
# in float64), and one SGD step with the batch split into 8 batch-1
# micro-batches (gradient accumulation: data parallelism's arithmetic, no
# devices) moves the weights 3.3e-5 away from the full-batch step, whose
# largest update is 0.32. The meshes differ by 0.6e-5 to 4.1e-5 after that
# step, and plain Keras `DataParallel` (no autodist) by the same 4.1e-5 as
# (8, 1) here. Over 3 steps all of these, the one-device control included
# (1.9e-3), grow a hundredfold, so this compares one step, with a tolerance
# of 3x the one-device control (3e-4 of the largest update).
PER_LAYER_INPUTS_ATOL = 1e-4


@pytest.mark.parametrize(
    "mesh, strategy",
    [
        ({"batch": 8, "model": 1}, "tp"),
        ({"batch": 8, "model": 1}, "fsdp"),
        ({"batch": 1, "model": 8}, "tp"),
        ({"batch": 2, "model": 4}, "fsdp"),
    ],
    ids=lambda v: mesh_id(v) if isinstance(v, dict) else v,
)
def test_gemma4_per_layer_inputs_sgd_step_matches_single_device(
    tiny_presets_dir, mesh, strategy
):
    name = "gemma4_per_layer_inputs"
    preset = tiny_presets_dir[name]
    assert_same_training(
        preset,
        "sgd",
        task=task_of(name),
        batch=family_batch(name, preset),
        steps=1,
        atol=PER_LAYER_INPUTS_ATOL,
        device_mesh=mesh,
        strategy=strategy,
    )


@pytest.mark.parametrize("name", FAMILIES)
def test_adam_losses_match_single_device(tiny_presets_dir, name):
    preset = tiny_presets_dir[name]
    assert_same_training(
        preset,
        "adam",
        task=task_of(name),
        batch=family_batch(name, preset),
        device_mesh={"batch": 2, "model": 4},
        strategy="fsdp",
    )


@pytest.mark.parametrize("name", ["qwen2", "qwen3", "phi3", "smollm3"])
def test_sequence_parallel_training_matches_single_device(tiny_presets_dir, name):
    preset = tiny_presets_dir[name]
    lm = assert_same_training(
        preset,
        "sgd",
        task=task_of(name),
        batch=family_batch(name, preset),
        device_mesh={"batch": 2, "model": 4},
        sequence_parallel=True,
    )
    plan = keras_hub_autodist.distribution_of(lm).plan
    assert plan.sequence_parallel and plan.activation_layouts()


# A tiny Hugging Face checkpoint loads with `device_mesh=` and gives the
# single-device logits.
HF_CASES = {
    "qwen2": (hf_checkpoints.qwen2, {"batch": 2, "model": 4}, "tp"),
    "qwen3": (hf_checkpoints.qwen3, {"model": 2, "batch": 4}, "fsdp"),
    "smollm3": (hf_checkpoints.smollm3, {"batch": 1, "model": 8}, "fsdp"),
    # `model_type="gemma4_text"`: global layers with their own head size and
    # one key head that is also the value's, a key/value-sharing last layer.
    "gemma4": (hf_checkpoints.gemma4, {"batch": 2, "model": 4}, "tp"),
    "gemma4_per_layer_inputs": (
        functools.partial(hf_checkpoints.gemma4, per_layer_inputs=True),
        {"batch": 1, "model": 8},
        "fsdp",
    ),
    # 6 experts: expert parallel over an expert axis of 2.
    "gemma4_moe": (
        functools.partial(hf_checkpoints.gemma4, num_experts=6),
        {"batch": 2, "expert": 2, "model": 2},
        "tp",
    ),
}


def _logits(backbone, x):
    return np.asarray(backbone.token_embedding(backbone(x), reverse=True))


@pytest.mark.parametrize("name", sorted(HF_CASES))
def test_hugging_face_checkpoint_loads_on_a_mesh(tmp_path, name):
    write, mesh, strategy = HF_CASES[name]
    path = write(tmp_path / name)
    single = keras_hub.models.Backbone.from_preset(path)
    sharded = keras_hub.models.Backbone.from_preset(
        path, device_mesh=mesh, strategy=strategy
    )
    cls = tiny_presets.DENSE_VARIANTS[name][0]
    assert type(sharded) is cls
    distribution, plan = keras_hub_autodist.distribution_of(sharded)
    assert plan.architecture == architecture_for(cls).name
    assert any("model" in row.spec for row in plan.rows)
    assert_laid_out_as_planned(sharded, distribution.device_mesh)
    assert len(sharded.weights) == len(single.weights)
    for variable, reference in zip(sharded.weights, single.weights):
        assert variable.path == reference.path
        np.testing.assert_array_equal(
            np.asarray(variable.value), np.asarray(reference.value)
        )
    x, _ = family_batch(name, path)
    np.testing.assert_allclose(
        _logits(sharded, x), _logits(single, x), rtol=1e-5, atol=1e-5
    )


# The task on a Hugging Face Gemma 4 checkpoint, named explicitly (see
# `tiny_presets.DENSE_FAMILIES`): its logits on 8 devices are the
# single-device task's.
def test_gemma4_causal_lm_loads_a_hugging_face_checkpoint_on_a_mesh(tmp_path):
    path = hf_checkpoints.gemma4(tmp_path / "gemma4", per_layer_inputs=True)
    x, _ = family_batch("gemma4_per_layer_inputs", path)
    task = keras_hub.models.Gemma4CausalLM
    single = task.from_preset(path, preprocessor=None)
    sharded = task.from_preset(
        path, preprocessor=None, device_mesh={"batch": 2, "model": 4}, strategy="fsdp"
    )
    assert type(sharded) is task
    distribution, _ = keras_hub_autodist.distribution_of(sharded)
    assert_laid_out_as_planned(sharded.backbone, distribution.device_mesh)
    np.testing.assert_allclose(
        sharded.predict(x, batch_size=8, verbose=0),
        single.predict(x, batch_size=8, verbose=0),
        rtol=1e-5,
        # The checkpoint's 0.05-scale weights give logits below 0.1.
        atol=1e-6,
    )
    assert keras.distribution.distribution() is None


# LoRA: `enable_lora` on the distributed model gives each lora kernel the
# layout of its kernel: `lora_kernel_a` the kernel's input dimensions,
# `lora_kernel_b` its output dimension, so that `a @ b` is laid out like the
# kernel.

# Every kind of kernel of each family. `enable_lora()`'s default targets are
# keras-hub's "query"/"value" layer names, which SmolLM3 (q_proj/v_proj)
# doesn't have: there it would make nothing trainable.
LORA_TARGETS = {
    "qwen2": ["query", "key", "value", "attention_output", "feedforward_gate_dense"],
    "phi3": ["query", "value", "attention_output", "feedforward_output_dense"],
    "smollm3": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "down_proj"],
    "gemma4": ["query", "key", "attention_output", "ffw_gating", "ffw_linear"],
}
LORA_TARGETS["qwen3"] = LORA_TARGETS["qwen2"]
LORA_TARGETS["gemma4_moe"] = LORA_TARGETS["gemma4"]


@pytest.mark.parametrize("name", FAMILIES)
def test_lora_kernels_follow_their_kernels(tiny_presets_dir, name):
    lm = task_of(name).from_preset(
        tiny_presets_dir[name],
        preprocessor=None,
        device_mesh={"batch": 2, "model": 4},
        strategy="fsdp",
    )
    # The LoRA kernels' initial values, whatever ran before in the session.
    keras.utils.set_random_seed(0)
    lm.backbone.enable_lora(4, target_layer_names=LORA_TARGETS[name])
    with_lora, sharded = assert_lora_kernels_follow_their_kernels(lm)
    num_layers = tiny_presets.DENSE_FAMILIES[name][2]["num_layers"]
    assert len(with_lora) >= len(LORA_TARGETS[name]) * (num_layers - 1)
    assert sharded
    lm.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    batch = family_batch(name, tiny_presets_dir[name])
    losses = [lm.train_on_batch(*batch) for _ in range(2)]
    assert np.isfinite(losses).all() and losses[1] < losses[0]
    assert keras.distribution.distribution() is None
