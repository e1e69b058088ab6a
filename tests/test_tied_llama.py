"""A tied Llama 3 saved with `save_to_preset` loads back, bound or not.

keras-hub 0.32's `LlamaBackbone.get_config` leaves out
`tie_word_embeddings`: plain keras-hub saves a tied Llama (Llama 3.2 1B and
3B are tied) with a config that reads as untied, and can't load it back.
With the plugin active (`compat.upstream`), such a preset loads as its
weights file says, with and without `device_mesh=`, and every save writes a
config that keras-hub without the plugin loads.
"""

import contextlib
import json
import os

import keras
import keras_hub
import numpy as np
import pytest
import tiny_presets

import keras_hub_autodist
from keras_hub_autodist.reading import presets

MESH = {"batch": 2, "model": 4}

# Llama 3.2's shape, tiny: grouped key/value heads and its rope scaling.
LLAMA32 = dict(
    vocabulary_size=64,
    num_layers=2,
    num_query_heads=8,
    num_key_value_heads=2,
    hidden_dim=32,
    intermediate_dim=64,
    rope_max_wavelength=500000.0,
    rope_frequency_adjustment_factor=32.0,
    rope_low_freq_factor=1.0,
    rope_high_freq_factor=4.0,
    rope_pretraining_sequence_length=8192,
)


@contextlib.contextmanager
def plain_keras_hub():
    """keras-hub without the plugin (its bugs included)."""
    keras_hub_autodist.deactivate()
    try:
        yield
    finally:
        keras_hub_autodist.activate()


def inputs(count=4, seed=0):
    return tiny_presets.token_batch(count, LLAMA32["vocabulary_size"], seed=seed)


def logits(model, x):
    return np.asarray(model.predict(x, verbose=0))


def llama32(tied, task):
    keras.utils.set_random_seed(7)
    backbone = keras_hub.models.Llama3Backbone(**LLAMA32, tie_word_embeddings=tied)
    if task:
        return keras_hub.models.Llama3CausalLM(backbone=backbone, preprocessor=None)
    return backbone


def saved_by_plain_keras_hub(folder, tied, task):
    """A Llama 3.2-shaped preset saved by keras-hub without the plugin, and
    the logits of the model saved."""
    with plain_keras_hub():
        model = llama32(tied, task)
        model.save_to_preset(str(folder))
    with open(os.path.join(folder, "config.json")) as file:
        saved = json.load(file)["config"]
    assert "tie_word_embeddings" not in saved  # the upstream bug, as met
    return str(folder), model


def first_token_logits(backbone_or_task, x):
    if isinstance(backbone_or_task, keras_hub.models.Backbone):
        return np.asarray(backbone_or_task(x))
    return logits(backbone_or_task, x)


@pytest.mark.parametrize("task", [True, False], ids=["causal_lm", "backbone"])
def test_a_tied_llama_saved_by_plain_keras_hub_loads_with_and_without_a_mesh(
    tmp_path, task
):
    folder, saved = saved_by_plain_keras_hub(tmp_path / "tied", True, task)
    with plain_keras_hub(), pytest.raises(ValueError, match="token_embedding"):
        keras_hub.models.Backbone.from_preset(folder)  # keras-hub alone fails
    cls = keras_hub.models.CausalLM if task else keras_hub.models.Backbone
    x = inputs()
    expected = first_token_logits(saved, x)
    for mesh in ({}, {"device_mesh": MESH}):
        kwargs = {"preprocessor": None} if task else {}
        loaded = cls.from_preset(folder, **kwargs, **mesh)
        backbone = loaded.backbone if task else loaded
        assert backbone.tie_word_embeddings, mesh
        np.testing.assert_allclose(
            first_token_logits(loaded, x), expected, atol=1e-5, err_msg=str(mesh)
        )


def test_an_untied_llama_saved_by_plain_keras_hub_still_loads_untied(tmp_path):
    folder, saved = saved_by_plain_keras_hub(tmp_path / "untied", False, True)
    x = inputs(seed=1)
    for mesh in ({}, {"device_mesh": MESH}):
        loaded = keras_hub.models.CausalLM.from_preset(
            folder, preprocessor=None, **mesh
        )
        assert not loaded.backbone.tie_word_embeddings, mesh
        np.testing.assert_allclose(logits(loaded, x), logits(saved, x), atol=1e-5)


def test_planning_reads_tying_from_the_weights(tmp_path):
    """The plan is of the model that loads: no reverse embeddings."""
    tied, _ = saved_by_plain_keras_hub(tmp_path / "tied", True, False)
    untied, _ = saved_by_plain_keras_hub(tmp_path / "untied", False, False)
    assert presets.read_local_config(tied).config["tie_word_embeddings"] is True
    assert presets.read_local_config(untied).config["tie_word_embeddings"] is False
    for folder, reversed_rows in ((tied, 0), (untied, 1)):
        plan = keras_hub_autodist.plan(folder, MESH)
        rows = [row for row in plan.rows if "reverse_embeddings" in row.path]
        assert len(rows) == reversed_rows, folder


def test_a_bound_tied_llama_saves_what_plain_keras_hub_loads(tmp_path):
    folder, _ = saved_by_plain_keras_hub(tmp_path / "tied", True, True)
    bound = keras_hub.models.CausalLM.from_preset(
        folder, preprocessor=None, device_mesh=MESH
    )
    x = inputs(seed=2)
    expected = logits(bound, x)
    bound.save_to_preset(str(tmp_path / "resaved"))
    for name in ("config.json", "task.json"):
        with open(tmp_path / "resaved" / name) as file:
            assert '"tie_word_embeddings": true' in file.read(), name
    with plain_keras_hub():
        reloaded = keras_hub.models.CausalLM.from_preset(
            str(tmp_path / "resaved"), preprocessor=None
        )
        assert reloaded.backbone.tie_word_embeddings
        np.testing.assert_allclose(logits(reloaded, x), expected, atol=1e-5)


def test_the_fixes_come_and_go_with_the_plugin():
    backbone = llama32(True, False)
    assert backbone.get_config()["tie_word_embeddings"] is True
    with plain_keras_hub():
        assert "tie_word_embeddings" not in backbone.get_config()
    assert backbone.get_config()["tie_word_embeddings"] is True
