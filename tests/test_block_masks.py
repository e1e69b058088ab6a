"""The decoder block hands its attention layer the padding, not the
`[batch, sequence, sequence]` mask: what the layer computes from the
compact mask equals what it computes from keras-hub's whole one, the
whole one is rebuilt exactly where a layer must take its own path, and no
device of a context mesh holds a square of the sequence."""

import inspect

import jax.numpy as jnp
import keras_hub
import numpy as np
import pytest
import tiny_presets

import keras_hub_autodist
from keras_hub_autodist.attention import block_masks
from keras_hub_autodist.attention import context_attention
from keras_hub_autodist.compat import attention as compat_attention

SEQUENCE = 12


def _padding():
    padding = np.ones((3, SEQUENCE), "int32")
    padding[0, :5] = 0  # left padding: its first queries have no key
    padding[1, 7:] = 0  # right padding
    return padding


def _gemma3_block(window: int):
    module = __import__(
        "keras_hub.src.models.gemma3.gemma3_decoder_block",
        fromlist=["Gemma3DecoderBlock"],
    )
    layer = module.Gemma3DecoderBlock(
        hidden_dim=16,
        intermediate_dim=32,
        head_dim=8,
        num_query_heads=2,
        num_key_value_heads=1,
        use_sliding_window_attention=True,
        sliding_window_size=window,
    )
    layer.build((3, SEQUENCE, 16))
    return layer


def _keras_hub_mask(padding, window):
    """The mask a Gemma 3 block builds for its attention layer (causal and
    key padding), with `window` masked into it as Gemma 4's blocks do."""
    layer = _gemma3_block(window or 4)
    x = np.zeros((3, SEQUENCE, 16), "float32")
    mask = layer._compute_attention_mask(x, padding, None, None, 0)
    if window is not None:
        mask = layer.attention._mask_sliding_window(mask)
    return np.asarray(mask)


@pytest.mark.parametrize("window", [None, 4])
def test_the_compact_mask_answers_the_layers_reduction(window):
    """Gemma's layers zero a query whose row of the mask is all zeros: the
    compact mask gives each query the same answer, with the window in the
    mask (Gemma 4's local layers) and without (Gemma, Gemma 3)."""
    padding = _padding()
    no_key = np.all(_keras_hub_mask(padding, window) == 0, axis=-1, keepdims=True)
    compact = block_masks.query_has_key(padding, window)
    assert compact.shape == (3, SEQUENCE, 1)
    compact_no_key = np.all(np.asarray(compact) == 0, axis=-1, keepdims=True)
    np.testing.assert_array_equal(compact_no_key, no_key)
    assert no_key[0, :5].all() and not no_key[0, 5:].any()


@pytest.mark.parametrize("window", [None, 4])
def test_the_whole_mask_is_rebuilt_as_the_block_builds_it(window):
    padding = _padding()
    expected = _keras_hub_mask(padding, window)
    masks = block_masks.BlockMasks(padding, False, compact=True, window=window)
    rebuilt = block_masks.whole_mask(masks, SEQUENCE, SEQUENCE)
    np.testing.assert_array_equal(np.asarray(rebuilt) > 0.5, expected.astype(bool))


def test_a_layer_on_its_own_path_gets_the_whole_mask_back():
    """Where the block handed over the compact mask and the layer then takes
    its own path (outside any distribution here), its own computation gets
    the mask the block would have built."""
    padding = _padding()
    handoff = block_masks.Handoff()
    handoff.put(block_masks.BlockMasks(padding, False, compact=True, window=None))
    seen = []

    def original(query, key, value, attention_mask, training=False):
        seen.append(attention_mask)
        return query

    reading = compat_attention.AttentionReading(1.0, None, None, 1, 0.0)
    q = jnp.zeros((3, SEQUENCE, 2, 8))
    compact = block_masks.query_has_key(padding, None)
    context_attention._compute_attention(
        original, reading, None, "all_gather", handoff, q, q, q, compact
    )
    masks = block_masks.BlockMasks(padding, False)
    expected = block_masks.whole_mask(masks, SEQUENCE, SEQUENCE)
    np.testing.assert_array_equal(seen[0], expected)
    assert handoff.take() is None  # taken once


def test_every_known_decoder_block_builds_its_mask_as_read():
    """Each block of `DECODER_BLOCKS` exists, and its mask method takes
    (sequence, padding, the other masks, cache, cache index)."""
    for (module, name), block in compat_attention.DECODER_BLOCKS.items():
        kind = getattr(__import__(module, fromlist=[name]), name)
        method = getattr(kind, block.mask_method)
        parameters = list(inspect.signature(method).parameters)
        assert len(parameters) == 1 + 2 + block.other_masks + 2, (name, parameters)
        assert "padding" in parameters[2], (name, parameters)


def test_each_block_hands_its_attention_layer_the_padding(tiny_presets_dir):
    """On a context mesh, every decoder block's mask method is wrapped and
    its attention layer is the one the attention per device replaced."""
    lm = keras_hub.models.CausalLM.from_preset(
        tiny_presets_dir["gemma3_text"],
        preprocessor=None,
        device_mesh={"batch": 2, "context": 4},
    )
    blocks = [
        layer
        for layer in lm.backbone.transformer_layers
        if "_compute_attention_mask" in vars(layer)
    ]
    assert len(blocks) == lm.backbone.num_layers
    method = compat_attention.COMPUTE_ATTENTION_METHOD
    assert all(method in vars(block.attention) for block in blocks)


@pytest.mark.parametrize(
    "backbone_class,config",
    [
        (
            keras_hub.models.GemmaBackbone,
            dict(tiny_presets.GEMMA_SHAPED, vocabulary_size=256),
        ),
        (
            keras_hub.models.Gemma3Backbone,
            dict(tiny_presets.GEMMA3_TEXT, vocabulary_size=256),
        ),
    ],
    ids=["gemma", "gemma3"],
)
def test_no_device_holds_a_square_of_the_sequence(tmp_path, backbone_class, config):
    """A small-vocabulary decoder on context=8, where keras-hub's mask would
    dominate the step: from 8k to 32k tokens each doubling costs at most
    2.2x the compiled peak per device (with the mask's blocks, 2.5x and
    3.9x)."""
    path = tiny_presets.save_preset(tmp_path / "model", backbone_class, config)
    plan = keras_hub_autodist.plan(path, {"batch": 1, "context": 8})
    peaks = [
        keras_hub_autodist.compiled_memory(plan, 1, tokens, "sgd").peak_bytes
        for tokens in (8192, 16384, 32768)
    ]
    ratios = [after / before for before, after in zip(peaks, peaks[1:])]
    assert max(ratios) <= 2.2, (peaks, ratios)
