"""Sequence parallelism: generation after sequence-parallel training, and the
layer-output keys of every tiny family (tests/test_sequence_parallel.py
trains one case and checks the plans)."""

import re

import keras
import keras_hub
import numpy as np
import pytest
from test_sequence_parallel import MESH
from test_sequence_parallel import assert_training_matches_one_device
from test_sequence_parallel import batch
from test_sequence_parallel import generate_tokens

import keras_hub_autodist

pytestmark = pytest.mark.slow


def test_training_then_generate_matches_one_device(tiny_presets_dir):
    """8 tokens on a 4-way model axis, then generate (one token per step,
    resharded over the model axis)."""
    preset = tiny_presets_dir["gemma_mqa"]
    lm, single = assert_training_matches_one_device(preset, sequence_length=8)
    np.testing.assert_array_equal(
        generate_tokens(lm, preset), generate_tokens(single, preset)
    )


def test_layer_outputs_and_weights_never_share_keys(tiny_presets_dir):
    """Each sequence-parallel key names real layer outputs and no weight;
    no weight key matches a layer output."""
    mesh = keras.distribution.DeviceMesh(
        (2, 4), ("batch", "model"), keras.distribution.list_devices()
    )
    for name in ("gemma2_gqa", "gemma3_text", "llama3_untied"):
        preset = tiny_presets_dir[name]
        outputs = set()
        recorder = keras.distribution.ModelParallel(
            layout_map=keras.distribution.LayoutMap(mesh), batch_dim_name="batch"
        )
        # The paths Keras looks up for layer outputs during a call.
        recorder.get_tensor_layout = outputs.add
        with recorder.scope():
            lm = keras_hub.models.CausalLM.from_preset(preset, preprocessor=None)
            lm(batch(preset)[0])
        assert "token_embedding/output" in outputs
        plan = keras_hub_autodist.plan(lm, MESH, sequence_parallel=True)
        activations = plan.activation_layouts()
        assert activations and set(activations.values()) == {("batch", "model", None)}
        check = plan.weight_check()
        for key in activations:
            assert any(re.fullmatch(key, path) for path in outputs), (name, key)
            assert not [w.path for w in lm.weights if re.fullmatch(key, w.path)]
        for path in outputs:
            assert check.matching_keys(path) == [], (name, path)
        for weight in lm.backbone.weights:
            assert len(check.matching_keys(weight.path)) == 1, weight.path
