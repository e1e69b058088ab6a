"""Keras' weight stores, replaced for this package's saves only.

The datasets a bound save records (its fingerprint) are written by the store
subclasses of weight_stores.py: into every HDF5 file Keras opens for writing
in the scope's thread, nested with a save from several processes, never into
another thread's save, with every patch removed afterwards. Keras' own walk of
a model's weights (`weights_files.weights_file_datasets`) finds what Keras
writes while those stores are in place. `ResumableCheckpoint` gives the model
back its own train function at the end of `fit`, and when a resume raises.
"""

import threading
import zipfile

import h5py
import numpy as np
import pytest
from test_gathering import small_trained_model

from keras_hub_autodist import RestoreError
from keras_hub_autodist import ResumableCheckpoint
from keras_hub_autodist import compat
from keras_hub_autodist.saving.weight_stores import root_datasets_written
from keras_hub_autodist.saving.weight_stores import weight_stores_writing
from keras_hub_autodist.training import weights_files

NOTES = {"notes": '{"run": 1}'}


def root_texts(file) -> dict:
    """The datasets at the root of an HDF5 file, as text."""
    with h5py.File(file, "r") as f:
        return {
            name: f[name][()].decode()
            for name in f
            if isinstance(f[name], h5py.Dataset)
        }


def written_texts(path) -> list[dict]:
    """`root_texts` of each HDF5 file a save wrote at `path`."""
    if path.suffix == ".keras":
        with zipfile.ZipFile(path) as archive:
            with archive.open(weights_files.KERAS_ARCHIVE_WEIGHTS) as member:
                return [root_texts(member)]
    return [root_texts(f) for f in sorted(path.parent.glob("*.h5"))]


@pytest.mark.parametrize(
    "name, kwargs",
    [
        ("model.weights.h5", {}),
        # Shards of about 100 bytes: the first one gets the datasets.
        ("model.weights.json", {"max_shard_size": 1e-7}),
        ("model.keras", {}),
    ],
)
def test_every_file_keras_opens_for_writing_gets_the_datasets(tmp_path, name, kwargs):
    model = small_trained_model()
    path = tmp_path / name
    with root_datasets_written(NOTES):
        if path.suffix == ".keras":
            model.save(path)
        else:
            model.save_weights(path, **kwargs)
    texts = written_texts(path)
    assert texts[0] == NOTES
    assert all(t == {} for t in texts[1:])
    assert len(texts) > 2 if kwargs else len(texts) == 1
    assert compat.installed_patches() == {}
    # Keras' loader ignores them.
    again = small_trained_model()
    again.load_weights(path)
    for saved, loaded in zip(model.weights, again.weights):
        np.testing.assert_array_equal(loaded.numpy(), saved.numpy())


def test_a_save_in_another_thread_meanwhile_gets_none(tmp_path):
    model = small_trained_model()
    entered, may_save = threading.Event(), threading.Event()
    failures = []

    def save_in_the_scope():
        try:
            with root_datasets_written(NOTES):
                entered.set()
                assert may_save.wait(timeout=30)
                model.save_weights(tmp_path / "scoped.weights.h5")
        except BaseException as error:  # reported by the main thread
            failures.append(error)
            entered.set()

    thread = threading.Thread(target=save_in_the_scope)
    thread.start()
    assert entered.wait(timeout=30)
    assert "h5_store_class" in compat.installed_patches()
    model.save_weights(tmp_path / "other.weights.h5")  # while it is installed
    may_save.set()
    thread.join(timeout=30)
    assert failures == []
    assert root_texts(tmp_path / "scoped.weights.h5") == NOTES
    assert root_texts(tmp_path / "other.weights.h5") == {}
    assert compat.installed_patches() == {}


@pytest.mark.parametrize("outer", ["datasets", "gathering"])
@pytest.mark.parametrize("write", [True, False])
def test_a_save_from_several_processes_writes_them_where_it_writes(
    tmp_path, outer, write
):
    model = small_trained_model()
    walked = []

    def convert(value):
        walked.append(value)
        return value

    scopes = [
        root_datasets_written(NOTES),
        weight_stores_writing(convert, lambda open_file: open_file(), write),
    ]
    if outer == "gathering":
        scopes.reverse()
    with scopes[0], scopes[1]:
        model.save_weights(tmp_path / "model.weights.h5")
    everything = model.weights + model.optimizer.variables
    assert sorted(id(v) for v in walked) == sorted(id(v) for v in everything)
    if write:
        assert root_texts(tmp_path / "model.weights.h5") == NOTES
    else:
        assert list(tmp_path.iterdir()) == []
    assert compat.installed_patches() == {}


def test_keras_walk_finds_what_keras_writes_while_the_stores_are_replaced(tmp_path):
    model = small_trained_model()
    model.save_weights(tmp_path / "model.weights.h5")
    written = weights_files.read_weights_file(str(tmp_path / "model.weights.h5"))
    expected = {k: spec for k, spec in written.layers().items()}
    assert len(expected) == 4  # two kernels, two biases
    with root_datasets_written(NOTES):
        walked = weights_files.weights_file_datasets(model)
    assert {k: (tuple(v.shape), "float32") for k, v in walked.items()} == expected
    assert len(written.optimizer()) == len(model.optimizer.variables)


def test_the_model_gets_its_own_train_function_back(tmp_path):
    model = small_trained_model()
    model.make_train_function()
    own = model.train_function
    params = {"epochs": 1, "steps": 2, "verbose": 0}
    checkpoint = ResumableCheckpoint(tmp_path / "ckpt", save_freq=1)
    checkpoint.set_model(model)
    checkpoint.set_params(params)
    checkpoint.on_train_begin()
    assert model.train_function is not own  # reads the first batch first
    checkpoint.on_train_end()
    assert model.train_function is own
    # A resume that raises (its only checkpoint is empty): Keras then skips
    # `on_train_end`.
    (tmp_path / "ckpt" / "3").mkdir(parents=True)
    refused = ResumableCheckpoint(tmp_path / "ckpt", save_freq=1)
    refused.set_model(model)
    refused.set_params(params)
    with pytest.raises(RestoreError, match="holds no complete Orbax checkpoint"):
        refused.on_train_begin()
    assert model.train_function is own
    assert "train_function" in vars(model)
