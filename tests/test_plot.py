"""plan.plot(): the planned memory per device and one weight's shards."""

import pytest
from real_presets import REAL_PRESETS

import keras_hub_autodist
from keras_hub_autodist import ArgumentError
from keras_hub_autodist.fitting.plot import device_slices

pytest.importorskip("matplotlib")


def _plan():
    return keras_hub_autodist.plan(
        str(REAL_PRESETS / "gemma_2b"), {"batch": 2, "model": 4}
    )


def test_each_device_gets_its_slice_of_the_weight():
    plan = _plan()
    row = next(r for r in plan.rows if r.path.endswith("0/attention/query/kernel"))
    slices = device_slices(plan, row)
    assert len(slices) == 8
    heads = row.shape[0] // 4
    # The query heads split over 'model', the same on both rows of 'batch'.
    assert slices[(0, 1)] == f"[{heads}:{2 * heads}, :, :]" == slices[(1, 1)]
    assert len(set(slices.values())) == 4


def test_plot_draws_memory_and_the_shards():
    plan = _plan()
    figure = plan.plot("decoder_block_0/attention/query/kernel")
    memory, mesh = figure.axes
    assert len(memory.patches) == 16  # 8 devices, weights and training
    texts = [t.get_text() for t in mesh.texts]
    assert len(texts) == 8 and texts[0].startswith("device 0\n[0:")
    assert "query/kernel" in mesh.get_title()


def test_plot_names_an_unknown_weight():
    with pytest.raises(ArgumentError, match="Received: weight='nope'"):
        _plan().plot("nope")
