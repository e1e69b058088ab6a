"""Saving from several processes, checked in one: the process that writes
and the ones that don't walk the same values in the same order, only the
writer writes, and a failure before the first weight file reaches the others.

integration/test_multihost_checkpoints.py runs the same saves in 2 processes.
"""

import os
import tempfile

import keras
import keras_hub
import numpy as np
import pytest
from jax.experimental import multihost_utils

from keras_hub_autodist import binding
from keras_hub_autodist import compat
from keras_hub_autodist import gathering
from keras_hub_autodist.errors import MultiprocessSaveError
from keras_hub_autodist.errors import SaveTargetError
from keras_hub_autodist.weight_stores import weight_stores_writing

MESH = {"batch": 2, "model": 4}


def small_trained_model():
    inputs = keras.Input((3,))
    outputs = keras.layers.Dense(2)(keras.layers.Dense(4)(inputs))
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.Adam(), loss="mse")
    model.train_on_batch(np.ones((2, 3)), np.ones((2, 2)))
    return model


def values_walked(model, folder, write, extension, **save_kwargs):
    """The variables a save hands its weight stores, in order."""
    walked = []

    def convert(value):
        walked.append(value)
        return value

    folder.mkdir()
    with weight_stores_writing(convert, lambda open_file: open_file(), write):
        model.save_weights(folder / f"model.weights.{extension}", **save_kwargs)
    return walked


# One file (`H5IOStore`), and shards of about 100 bytes (`ShardedH5IOStore`).
@pytest.mark.parametrize(
    "extension, save_kwargs", [("h5", {}), ("json", {"max_shard_size": 1e-7})]
)
def test_a_process_that_writes_nothing_walks_the_values_of_the_writer(
    tmp_path, extension, save_kwargs
):
    model = small_trained_model()
    written = values_walked(model, tmp_path / "written", True, extension, **save_kwargs)
    discarded = values_walked(
        model, tmp_path / "discarded", False, extension, **save_kwargs
    )

    assert [id(v) for v in discarded] == [id(v) for v in written]
    everything = model.weights + model.optimizer.variables
    assert sorted(id(v) for v in written) == sorted(id(v) for v in everything)
    assert os.listdir(tmp_path / "discarded") == []
    assert len(os.listdir(tmp_path / "written")) > (2 if save_kwargs else 0)

    again = small_trained_model()
    again.load_weights(tmp_path / "written" / f"model.weights.{extension}")
    for saved, loaded in zip(everything, again.weights + again.optimizer.variables):
        np.testing.assert_array_equal(loaded.numpy(), saved.numpy())


def test_keras_is_restored_after_the_scope_even_on_error(tmp_path):
    store_class = compat.h5_io_store()
    optimizer_save = keras.optimizers.Optimizer.save_own_variables
    model = small_trained_model()

    def failing(value):
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        with weight_stores_writing(failing, lambda open_file: open_file()):
            model.save_weights(tmp_path / "model.weights.h5")
    assert compat.h5_io_store() is store_class
    assert keras.optimizers.Optimizer.save_own_variables is optimizer_save


def test_an_array_on_this_process_is_left_to_keras():
    variable = keras.Variable(np.ones((2, 2)))
    assert gathering.host_array(variable) is variable
    assert gathering.host_array(3) == 3
    assert not gathering.several_processes()


@pytest.fixture
def bound_lm(tiny_presets_dir):
    return keras_hub.models.CausalLM.from_preset(
        tiny_presets_dir["gemma_mqa"], preprocessor=None, device_mesh=MESH
    )


@pytest.fixture
def two_processes(monkeypatch, tmp_path):
    """Make a bound model's saves behave as in process `index` of 2; their
    temporary files go into `tmp_path/scratch`."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    monkeypatch.setattr(binding, "several_processes", lambda: True)

    def process(index):
        monkeypatch.setattr(gathering, "_writes_here", lambda: index == 0)
        return scratch

    return process


def test_only_the_writer_writes_and_the_others_leave_nothing(
    bound_lm, two_processes, tmp_path
):
    scratch = two_processes(1)
    bound_lm.save_to_preset(tmp_path / "preset")
    bound_lm.save_weights(tmp_path / "model.weights.h5")
    bound_lm.save(tmp_path / "model.keras")
    assert sorted(os.listdir(tmp_path)) == ["scratch"]
    assert os.listdir(scratch) == []

    two_processes(0)
    bound_lm.save_to_preset(tmp_path / "preset")
    bound_lm.save_weights(tmp_path / "model.weights.h5")
    expected = {w.path: np.asarray(w.value) for w in bound_lm.weights}
    again = keras_hub.models.CausalLM.from_preset(
        str(tmp_path / "preset"), preprocessor=None
    )
    for weight in again.weights:
        np.testing.assert_array_equal(weight.numpy(), expected[weight.path])
    assert sorted(os.listdir(tmp_path)) == ["model.weights.h5", "preset", "scratch"]


def test_a_writer_that_fails_before_writing_tells_the_others(
    bound_lm, two_processes, tmp_path, monkeypatch
):
    two_processes(0)
    told = []
    allgather = multihost_utils.process_allgather

    def recording(value, tiled=False):
        told.append(int(value))
        return allgather(value, tiled=tiled)

    monkeypatch.setattr(multihost_utils, "process_allgather", recording)
    (tmp_path / "a_file").write_text("not a folder")
    with pytest.raises(SaveTargetError, match="not a folder"):
        bound_lm.save_to_preset(tmp_path / "a_file")
    assert told == [0]


def test_the_others_stop_when_the_writer_failed(
    bound_lm, two_processes, tmp_path, monkeypatch
):
    two_processes(1)
    monkeypatch.setattr(
        multihost_utils,
        "process_allgather",
        lambda value, tiled=False: np.array([0, int(value)]),
    )
    with pytest.raises(MultiprocessSaveError, match=r"Process\(es\) \[0\] of"):
        bound_lm.save_weights(tmp_path / "model.weights.h5")
    assert not (tmp_path / "model.weights.h5").exists()


def test_hugging_face_hub_targets_are_refused(bound_lm, two_processes):
    two_processes(0)
    with pytest.raises(SaveTargetError, match="Received: 'hf://user/model'"):
        bound_lm.save("hf://user/model")
