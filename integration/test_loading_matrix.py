"""Sharded loading of every format on every mesh under every strategy, and
int8-quantized presets (tests/test_loading.py rotates formats and strategies
over the meshes)."""

import keras_hub
import numpy as np
import pytest
import tiny_presets
from test_loading import ROTATION
from test_loading import assert_load_equals_single_device_and_follows_the_plan
from test_loading import presets  # noqa: F401 (a fixture)
from test_loading import references  # noqa: F401 (a fixture)

import keras_hub_autodist

pytestmark = pytest.mark.slow

MATRIX = [
    (format, shape, strategy)
    for format in ("keras", "transformers")
    for shape in [(1, 8), (2, 4), (4, 2), (8, 1)]
    for strategy in ["tp", "fsdp"]
    if (format, shape, strategy) not in ROTATION
]


@pytest.mark.parametrize("format,shape,strategy", MATRIX)
def test_load_equals_single_device_and_follows_the_plan(
    presets,  # noqa: F811
    references,  # noqa: F811
    format,
    shape,
    strategy,
):
    assert_load_equals_single_device_and_follows_the_plan(
        presets[format], references[format], shape, strategy, format
    )


def int8_gemma_backbone(**config):
    backbone = keras_hub.models.GemmaBackbone(**config)
    backbone.quantize("int8")
    return backbone


def test_int8_quantized_preset(tmp_path):
    """Loads like keras-hub where keras-hub loads it, else a clear error.

    keras-hub 0.32 can't reload a quantized backbone saved with
    `save_to_preset`, even on one device: the plugin then says what to do.
    """
    path = tiny_presets.save_preset(
        tmp_path / "int8", int8_gemma_backbone, tiny_presets.GEMMA_MQA
    )
    try:
        single = keras_hub.models.Backbone.from_preset(path)
    except ValueError:
        single = None
    if single is None:
        with pytest.raises(
            keras_hub_autodist.PresetError,
            match=r'quantized preset.*quantize\("int8"\).*Received: preset=',
        ):
            keras_hub.models.Backbone.from_preset(
                path, device_mesh={"batch": 2, "model": 4}
            )
        return
    sharded = keras_hub.models.Backbone.from_preset(
        path, device_mesh={"batch": 2, "model": 4}
    )
    assert any(v.dtype == "int8" for v in sharded.weights)
    for mine, theirs in zip(sharded.weights, single.weights):
        np.testing.assert_array_equal(np.asarray(mine.value), np.asarray(theirs.value))
