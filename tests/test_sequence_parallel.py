"""Sequence parallelism: residual-stream activations sharded on the sequence."""

import jax
import keras
import keras_hub
import numpy as np
import pytest
import tiny_presets
from equivalence import step_state

import keras_hub_autodist
from bench import hlo
from keras_hub_autodist import MeshError
from keras_hub_autodist import PlanError
from keras_hub_autodist import StrategyError
from keras_hub_autodist import UnsupportedArchitectureError
from keras_hub_autodist.architectures.gemma import GEMMA

MESH = {"batch": 2, "model": 4}
BATCH = 4


def batch(preset, sequence_length=8):
    info = keras_hub_autodist.reading.presets.read_preset_config(preset)
    x = tiny_presets.token_batch(
        BATCH, info.config["vocabulary_size"], sequence_length=sequence_length
    )
    return x, np.roll(x["token_ids"], -1, axis=1)


def train(preset, steps=3, sequence_length=8, **mesh_kwargs):
    lm = keras_hub.models.CausalLM.from_preset(preset, preprocessor=None, **mesh_kwargs)
    lm.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        sampler="greedy",
    )
    x, y = batch(preset, sequence_length)
    losses = [
        float(lm.train_on_batch(x, y, return_dict=True)["loss"]) for _ in range(steps)
    ]
    weights = {w.path: np.asarray(w.value) for w in lm.backbone.weights}
    return lm, losses, weights


def step_collectives(lm, preset):
    """Collectives of the compiled train step of a bound model."""
    distribution = keras_hub_autodist.distribution_of(lm).distribution
    x, y = batch(preset)
    with distribution.scope():
        state = step_state(lm)
        layout = distribution.get_data_layout(x["token_ids"].shape).backend_layout
        data = jax.device_put((x, y, None), layout)
        text = jax.jit(lm.train_step).lower(state, data).compile().as_text()
    return {op: found["count"] for op, found in hlo.collectives(text).items()}


def generate_tokens(lm, preset):
    x, _ = batch(preset)
    mask = np.zeros_like(x["padding_mask"])
    mask[:, :3] = 1
    prompt = {"token_ids": x["token_ids"] * mask, "padding_mask": mask}
    return np.asarray(
        lm.generate(prompt, max_length=8, stop_token_ids=None)["token_ids"]
    )


def assert_training_matches_one_device(preset, sequence_length):
    """Sequence-parallel training equals one device; returns both models."""
    lm, losses, weights = train(
        preset,
        sequence_length=sequence_length,
        device_mesh=MESH,
        sequence_parallel=True,
    )
    single, ref_losses, ref_weights = train(preset, sequence_length=sequence_length)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert weights.keys() == ref_weights.keys()
    for path, value in weights.items():
        np.testing.assert_allclose(value, ref_weights[path], atol=1e-5, err_msg=path)
    assert keras_hub_autodist.distribution_of(lm).plan.sequence_parallel
    return lm, single


def test_training_matches_one_device_with_fewer_all_reduces(tiny_presets_dir):
    """6 tokens, which don't divide the model axis (JAX pads the uneven
    shards), and the collectives against tensor parallelism alone."""
    preset = tiny_presets_dir["llama3_untied"]
    lm, _ = assert_training_matches_one_device(preset, sequence_length=6)
    sp = step_collectives(lm, preset)
    tp_lm = keras_hub.models.CausalLM.from_preset(
        preset, preprocessor=None, device_mesh=MESH
    )
    tp_lm.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    tp_lm.train_on_batch(*batch(preset))
    tp = step_collectives(tp_lm, preset)
    # Tensor parallelism alone all-reduces the row-parallel outputs; with
    # sequence parallelism the residual stream is all-gathered before the
    # column-parallel projections (two per block, two blocks) and far fewer
    # all-reduces remain. XLA's CPU backend emits no reduce-scatter
    # instruction for either.
    assert sp["all-gather"] >= 2 * 2, sp
    assert sp["all-reduce"] <= tp["all-reduce"] * 0.6, (sp, tp)


def test_a_key_matching_weights_is_refused(tiny_presets_dir):
    mesh = keras.distribution.DeviceMesh(
        (2, 4), ("batch", "model"), keras.distribution.list_devices()
    )
    plan = keras_hub_autodist.plan(
        tiny_presets_dir["gemma_mqa"], mesh, sequence_parallel=True
    )
    plan = plan.replace(sequence_parallel_outputs=(r"decoder_block_\d+/.*",))
    with pytest.raises(PlanError, match="must match layer outputs .* only"):
        plan.layout_map(mesh)


def test_plan_keys_summary_and_model_axis_of_one(tiny_presets_dir):
    preset = tiny_presets_dir["llama3_untied"]
    off = keras_hub_autodist.plan(preset, MESH)
    assert not off.sequence_parallel and off.activation_layouts() == {}
    assert "sequence parallel: off" in off.summary()
    on = keras_hub_autodist.plan(preset, MESH, sequence_parallel=True)
    assert on.activation_layouts()["sequence_output_layernorm/output"] == (
        "batch",
        "model",
        None,
    )
    assert "sequence parallel: on: 5 residual-stream layer outputs" in on.summary()
    # The residual stream is split over the model axis in the estimate.
    assert on.activation_bytes_per_device(8, 64) < off.activation_bytes_per_device(
        8, 64
    )
    single = keras_hub_autodist.plan(
        preset, {"batch": 8, "model": 1}, sequence_parallel=True
    )
    assert single.activation_layouts() == {}
    assert "model axis (model) has one device" in single.summary()


def test_sequence_parallel_must_be_a_bool(tiny_presets_dir):
    with pytest.raises(StrategyError, match="Received: sequence_parallel='yes'"):
        keras_hub_autodist.plan(
            tiny_presets_dir["gemma_mqa"], MESH, sequence_parallel="yes"
        )


def test_a_family_without_outputs_is_refused(tiny_presets_dir, monkeypatch):
    monkeypatch.setattr(GEMMA, "sequence_parallel_outputs", ())
    with pytest.raises(UnsupportedArchitectureError, match="no sequence-parallel"):
        keras_hub_autodist.plan(
            tiny_presets_dir["gemma_mqa"], MESH, sequence_parallel=True
        )


def test_sequence_parallel_needs_a_device_mesh(tiny_presets_dir):
    with pytest.raises(MeshError, match="sequence_parallel= only apply with"):
        keras_hub.models.CausalLM.from_preset(
            tiny_presets_dir["gemma_mqa"], sequence_parallel=True
        )


def test_fsdp_pins_residual_outputs_to_the_batch_axis(tiny_presets_dir):
    """Under fsdp the residual stream stays on the batch axis (weights are
    gathered, activations not resharded); sequence parallelism, when on,
    takes precedence; a batch axis of one pins nothing."""
    preset = tiny_presets_dir["llama3_untied"]
    key = "sequence_output_layernorm/output"
    fsdp = keras_hub_autodist.plan(preset, MESH, strategy="fsdp")
    assert fsdp.activation_layouts()[key] == ("batch", None, None)
    assert len(fsdp.activation_layouts()) == 5
    assert "sequence parallel: off" in fsdp.summary()
    layout_map = fsdp.layout_map(
        keras.distribution.DeviceMesh(
            (2, 4), ("batch", "model"), keras.distribution.list_devices()
        )
    )
    assert tuple(layout_map[key].axes) == ("batch", None, None)
    both = keras_hub_autodist.plan(
        preset, MESH, strategy="fsdp", sequence_parallel=True
    )
    assert both.activation_layouts()[key] == ("batch", "model", None)
    assert keras_hub_autodist.plan(preset, MESH).activation_layouts() == {}
    one = keras_hub_autodist.plan(preset, {"batch": 1, "model": 8}, strategy="fsdp")
    assert one.activation_layouts() == {}
    # The estimate splits the residual stream only under sequence parallelism.
    assert fsdp.activation_bytes_per_device(8, 64) > both.activation_bytes_per_device(
        8, 64
    )
