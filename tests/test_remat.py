"""`remat="full"`: each decoder block recomputed in the backward pass."""

import json
import pathlib

import keras
import keras_hub
import numpy as np
import pytest
from equivalence import batch_for
from test_compile_targets import needs_tpu_compiler

import keras_hub_autodist
from keras_hub_autodist import PlanError
from keras_hub_autodist import compiled_memory
from keras_hub_autodist.planning.remat import block_paths

MESH = {"batch": 2, "model": 4}
PRESETS = pathlib.Path(__file__).parent / "data" / "presets"
# Gemma 3 1B's Hugging Face config, made small, with heads of 128 (the
# TPU's lanes).
GEMMA3_TEXT = {
    **json.loads((PRESETS / "gemma3_1b" / "config.json").read_text()),
    "vocab_size": 2048,
    "num_attention_heads": 2,
    "intermediate_size": 1024,
    "head_dim": 128,
    "query_pre_attn_scalar": 128,
}


def trained(preset, remat):
    lm = keras_hub.models.CausalLM.from_preset(
        preset, preprocessor=None, device_mesh=MESH, remat=remat
    )
    lm.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    x, y = batch_for(preset, sequence_length=16)
    losses = [
        float(lm.train_on_batch(x, y, return_dict=True)["loss"]) for _ in range(3)
    ]
    return lm, losses, (x, y)


@pytest.mark.parametrize("name", ["gemma_mqa", "llama3_untied"])
def test_full_remat_trains_as_without_and_recomputes_each_block(tiny_presets_dir, name):
    preset = tiny_presets_dir[name]
    plain, plain_losses, _ = trained(preset, None)
    lm, losses, (x, y) = trained(preset, "full")
    np.testing.assert_allclose(losses, plain_losses, rtol=1e-6)
    for weight, reference in zip(lm.backbone.weights, plain.backbone.weights):
        np.testing.assert_allclose(
            np.asarray(weight.value), np.asarray(reference.value), atol=1e-6
        )
    plan = keras_hub_autodist.distribution_of(lm).plan
    assert len(block_paths(plan)) == 2


def test_full_remat_lowers_the_compiled_peak_of_the_same_step(tiny_presets_dir):
    """The step built as a load builds it, compiled for the local backend:
    with `"full"` each block keeps its input alone, so the peak falls
    (XLA's CPU backend drops `jax.checkpoint`'s barrier; the recomputation
    must still wait for the cotangent)."""
    preset = tiny_presets_dir["gemma_mqa"]
    peaks = {
        remat: keras_hub_autodist.compiled_memory(
            keras_hub_autodist.plan(preset, MESH, remat=remat), 2, 512, "sgd"
        ).peak_bytes
        for remat in (None, "full")
    }
    assert peaks["full"] < 0.8 * peaks[None], peaks


@needs_tpu_compiler
def test_full_remat_keeps_about_each_blocks_input_on_a_tpu(tmp_path):
    """Compiled for a v5e chip, each block more costs about its input (and
    its weights): the TPU compiler does not fuse the residual stream's sums
    across the recomputed blocks, which kept several float32 copies of the
    stream per block (6.7 inputs a block here, 2.6 with the blocks'
    outputs behind a barrier)."""
    sequence, hidden = 16384, 256
    peaks = {}
    for layers in (2, 4):
        preset = tmp_path / f"gemma3_{layers}"
        preset.mkdir()
        config = dict(GEMMA3_TEXT, num_hidden_layers=layers, hidden_size=hidden)
        (preset / "config.json").write_text(json.dumps(config))
        plan = keras_hub_autodist.plan(
            str(preset),
            {"batch": 1, "model": 1},
            dtype="bfloat16",
            lora_rank=4,
            remat="full",
            device_memory="v5e",
        )
        peaks[layers] = compiled_memory(plan, 1, sequence, "adam").peak_bytes
    block_input = sequence * hidden * 2
    assert (peaks[4] - peaks[2]) / 2 < 4 * block_input, peaks


def test_a_keras_mode_over_whole_blocks_says_what_to_use(tiny_presets_dir):
    preset = tiny_presets_dir["gemma_mqa"]
    plan = keras_hub_autodist.plan(
        preset, MESH, remat={"mode": "larger_than", "output_size_threshold": 1}
    )
    with pytest.raises(PlanError, match=r"Use `remat='full'`"):
        keras_hub_autodist.compiled_memory(plan, 2, 64, "sgd")
