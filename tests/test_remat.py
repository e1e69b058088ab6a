"""`remat="full"`: each decoder block recomputed in the backward pass."""

import keras
import keras_hub
import numpy as np
import pytest
from equivalence import batch_for

import keras_hub_autodist
from keras_hub_autodist import PlanError
from keras_hub_autodist.planning.remat import block_paths

MESH = {"batch": 2, "model": 4}


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


def test_a_keras_mode_over_whole_blocks_says_what_to_use(tiny_presets_dir):
    preset = tiny_presets_dir["gemma_mqa"]
    plan = keras_hub_autodist.plan(
        preset, MESH, remat={"mode": "larger_than", "output_size_threshold": 1}
    )
    with pytest.raises(PlanError, match=r"Use `remat='full'`"):
        keras_hub_autodist.compiled_memory(plan, 2, 64, "sgd")
