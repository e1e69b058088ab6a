"""LoRA fine-tuning, save and reload, and greedy generation on a mesh."""

import os

import keras
import keras_hub
import numpy as np
import pytest
import tiny_presets

import keras_hub_autodist

MESH = {"batch": 2, "model": 4}


def batch(lm, seed=0):
    x = tiny_presets.token_batch(8, lm.backbone.vocabulary_size, seed=seed)
    return x, np.roll(x["token_ids"], -1, axis=1)


def lora_run(preset, **mesh_kwargs):
    lm = keras_hub.models.CausalLM.from_preset(preset, preprocessor=None, **mesh_kwargs)
    keras.utils.set_random_seed(7)  # same LoRA initial values in both runs
    lm.backbone.enable_lora(4)
    optimizer = keras.optimizers.Adam(1e-2)  # built by the user before compile
    lm.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    before = {w.path: np.asarray(w.value) for w in lm.backbone.weights}
    x, y = batch(lm)
    history = lm.fit(x, y, batch_size=4, epochs=3, verbose=0, shuffle=False)
    after = {w.path: np.asarray(w.value) for w in lm.backbone.weights}
    return lm, history.history["loss"], before, after


@pytest.mark.parametrize("name", ["gemma_mqa", "llama3_untied"])
def test_lora_fine_tuning_on_a_mesh(tiny_presets_dir, name):
    preset = tiny_presets_dir[name]
    lm, losses, before, after = lora_run(preset, device_mesh=MESH)
    _, ref_losses, _, _ = lora_run(preset)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    changed = {p for p in before if not np.array_equal(before[p], after[p])}
    assert changed and all("lora_kernel" in p for p in changed)
    assert any(p.endswith("lora_kernel_a") for p in changed) or any(
        p.endswith("lora_kernel_b") for p in changed
    )
    _, plan = keras_hub_autodist.distribution_of(lm)
    layouts = plan.layout_map(
        keras_hub_autodist.distribution_of(lm).distribution.device_mesh
    )
    for weight in lm.backbone.weights:
        if "lora_kernel" in weight.path:
            expected = layouts[weight.path].axes
            actual = tuple(weight.value.sharding.spec) + (None,) * (
                len(weight.shape) - len(weight.value.sharding.spec)
            )
            assert actual == expected, weight.path
    assert keras.distribution.distribution() is None


def weights_of(lm):
    return {w.path: np.asarray(w.value) for w in lm.backbone.weights}


def logits_of(lm, x):
    return np.asarray(lm(x))


@pytest.mark.parametrize("reload_mesh", [MESH, {"model": 2, "batch": 4}, None])
def test_save_from_a_mesh_and_reload(tiny_presets_dir, tmp_path, reload_mesh):
    preset = tiny_presets_dir["gemma2_gqa"]
    lm = keras_hub.models.CausalLM.from_preset(preset, device_mesh=MESH)
    lm.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(True))
    x, y = batch(lm)
    preprocessed = {"token_ids": x["token_ids"], "padding_mask": x["padding_mask"]}
    lm.preprocessor = None
    lm.train_on_batch(preprocessed, y)
    target = tmp_path / "tuned"
    lm.save_to_preset(str(target))
    kwargs = {"device_mesh": reload_mesh} if reload_mesh else {}
    again = keras_hub.models.CausalLM.from_preset(
        str(target), preprocessor=None, **kwargs
    )
    saved, loaded = weights_of(lm), weights_of(again)
    assert saved.keys() == loaded.keys()
    for path in saved:
        np.testing.assert_array_equal(saved[path], loaded[path], err_msg=path)
    np.testing.assert_allclose(
        logits_of(again, preprocessed), logits_of(lm, preprocessed), atol=1e-5
    )
    assert sorted(os.listdir(tmp_path)) == ["tuned"]  # no staging folder left behind


def test_a_failed_save_leaves_the_target_untouched(
    tiny_presets_dir, tmp_path, monkeypatch
):
    lm = keras_hub.models.CausalLM.from_preset(
        tiny_presets_dir["gemma_mqa"], device_mesh=MESH
    )
    target = tmp_path / "out"

    def broken_save(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(lm.preprocessor, "save_to_preset", broken_save)
    with pytest.raises(OSError, match="disk full"):
        lm.save_to_preset(str(target))
    assert not target.exists() and os.listdir(tmp_path) == []

    target.mkdir()
    (target / "keep.txt").write_text("old")
    with pytest.raises(OSError, match="disk full"):
        lm.save_to_preset(str(target))
    assert os.listdir(target) == ["keep.txt"]
    monkeypatch.undo()
    lm.save_to_preset(preset_dir=str(target))
    assert {"config.json", "model.weights.h5", "keep.txt"} <= set(os.listdir(target))


def greedy(lm, prompt):
    out = lm.generate(prompt, max_length=8, stop_token_ids=None)
    return np.asarray(out["token_ids"])


@pytest.mark.parametrize("strategy", ["tp", "fsdp"])
@pytest.mark.parametrize("mesh", [{"batch": 2, "model": 4}, {"batch": 4, "model": 2}])
@pytest.mark.parametrize("name", ["gemma_mqa", "llama3_tied"])
def test_generate_under_each_strategy(tiny_presets_dir, name, mesh, strategy):
    preset = tiny_presets_dir[name]
    single = keras_hub.models.CausalLM.from_preset(preset, preprocessor=None)
    sharded = keras_hub.models.CausalLM.from_preset(
        preset, preprocessor=None, device_mesh=mesh, strategy=strategy
    )
    x, _ = batch(single, seed=3)
    mask = np.zeros_like(x["padding_mask"])
    mask[:, :3] = 1
    prompt = {"token_ids": x["token_ids"] * mask, "padding_mask": mask}
    for lm in (single, sharded):
        lm.compile(sampler="greedy")
    np.testing.assert_array_equal(greedy(sharded, prompt), greedy(single, prompt))
