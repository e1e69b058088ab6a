"""Gemma 3 with its vision tower: every weight is planned (the sharded
forward pass and training with images are in
integration/test_gemma3_vision_matrix.py)."""

import keras_hub
import tiny_presets

from keras_hub_autodist.architectures.gemma3 import GEMMA3


def test_every_vision_weight_matches_one_rule():
    backbone = tiny_presets.gemma3_vision_backbone(**tiny_presets.GEMMA3_VISION_TEXT)
    config = backbone.get_config()
    planned = {
        w.path: w.axes for w in GEMMA3.weights(config, keras_hub.models.Gemma3Backbone)
    }
    assert set(planned) == {w.path for w in backbone.weights}
    assert planned[
        "image_encoder/encoder_block_0/multi_head_attention/query_proj/kernel"
    ] == ("embed", "heads")
    assert GEMMA3.shape_hints(config) is None  # the tower's shapes: the model's
