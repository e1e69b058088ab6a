"""Gemma 3 with its vision tower: every weight is planned (the sharded
forward pass and training with images are in
integration/test_gemma3_vision_matrix.py)."""

import keras_hub
import tiny_presets

from keras_hub_autodist.architectures.gemma3 import GEMMA3
from keras_hub_autodist.shapes import architecture_weights


def test_every_vision_weight_matches_one_rule():
    backbone = tiny_presets.gemma3_vision_backbone(**tiny_presets.GEMMA3_VISION_TEXT)
    config = backbone.get_config()
    planned = {
        w.path: w.logical_axes
        for w in architecture_weights(GEMMA3, config, keras_hub.models.Gemma3Backbone)
    }
    assert set(planned) == {w.path for w in backbone.weights}
    assert planned[
        "image_encoder/encoder_block_0/multi_head_attention/query_proj/kernel"
    ] == ("embed", "heads")
