"""A weight file replaced, deleted or rewritten while a model loads from it:
the model holds exactly one version of it, or the load raises a clear error.

Each test changes the file from inside the load, right after the first
weight reached its devices."""

import os
import shutil

import h5py
import hf_checkpoints
import keras_hub
import numpy as np
import pytest
import safetensors.numpy
import tiny_presets
from test_loading import backbone_preset

import keras_hub_autodist
from keras_hub_autodist import compat
from keras_hub_autodist import loading

MESH = {"batch": 2, "model": 4}


@pytest.fixture(scope="module")
def versions(tmp_path_factory):
    """Two versions of a Keras preset and of a Hugging Face checkpoint, with
    the same shapes and different values."""
    root = tmp_path_factory.mktemp("file_changes")
    keras_old = backbone_preset(root / "keras_old", tiny_presets.GEMMA_MQA, seed=0)
    keras_new = backbone_preset(root / "keras_new", tiny_presets.GEMMA_MQA, seed=1)
    hf_old = hf_checkpoints.llama3(root / "hf_old")
    hf_new = str(root / "hf_new")
    shutil.copytree(hf_old, hf_new)
    tensors = safetensors.numpy.load_file(os.path.join(hf_new, "model.safetensors"))
    tensors = {name: values + 1 for name, values in tensors.items()}
    safetensors.numpy.save_file(tensors, os.path.join(hf_new, "model.safetensors"))
    return {
        "keras": (keras_old, keras_new, "model.weights.h5"),
        "transformers": (hf_old, hf_new, "model.safetensors"),
    }


def reference(path):
    backbone = keras_hub.models.Backbone.from_preset(path)
    return {v.path: np.asarray(v.value) for v in backbone.weights}


def change_after_first_weight(monkeypatch, change):
    """Run `change()` once, right after the first weight is put."""
    put = loading._Session.put
    done = []

    def put_then_change(session, source, variable):
        result = put(session, source, variable)
        if not done:
            done.append(True)
            change()
        return result

    monkeypatch.setattr(loading._Session, "put", put_then_change)
    return done


def change_as_keras_opens(monkeypatch, path, change):
    """Run `change()` once, right after the HDF5 file at `path` is first
    opened (by Keras' weight store), before any weight is read from it."""
    done = []

    class File(h5py.File):
        def __init__(self, name, *args, **kwargs):
            super().__init__(name, *args, **kwargs)
            if not done and os.fspath(name) == path:
                done.append(True)
                change()

    monkeypatch.setattr(h5py, "File", File)
    return done


def replace_atomically(path, new_file):
    """Replace `path` by a copy of `new_file` as a download or an atomic save
    does: written beside it, then renamed over it."""
    staged = path + ".tmp"
    shutil.copyfile(new_file, staged)
    os.replace(staged, path)


def loading_copy(versions, format, tmp_path):
    old, new, weights = versions[format]
    path = tmp_path / "preset"
    shutil.copytree(old, path)
    return str(path), os.path.join(new, weights), str(path / weights)


@pytest.mark.parametrize("format", ["keras", "transformers"])
def test_a_file_replaced_while_loading_loads_one_version(
    versions, format, tmp_path, monkeypatch
):
    path, new_file, weights = loading_copy(versions, format, tmp_path)
    old_values, new_values = (
        reference(versions[format][0]),
        reference(versions[format][1]),
    )

    done = change_after_first_weight(
        monkeypatch, lambda: replace_atomically(weights, new_file)
    )
    try:
        backbone = keras_hub.models.Backbone.from_preset(path, device_mesh=MESH)
    except keras_hub_autodist.WeightFileChangedError as error:
        assert "Received" in str(error)
        return
    assert done
    loaded = {v.path: np.asarray(v.value) for v in backbone.weights}
    same_as_old = all(np.array_equal(loaded[k], old_values[k]) for k in loaded)
    same_as_new = all(np.array_equal(loaded[k], new_values[k]) for k in loaded)
    assert same_as_old or same_as_new, "a mix of two versions of the file"


@pytest.mark.parametrize("format", ["keras", "transformers"])
def test_a_file_deleted_while_loading_still_loads(
    versions, format, tmp_path, monkeypatch
):
    path, _, weights = loading_copy(versions, format, tmp_path)
    expected = reference(versions[format][0])
    done = change_after_first_weight(monkeypatch, lambda: os.remove(weights))
    backbone = keras_hub.models.Backbone.from_preset(path, device_mesh=MESH)
    assert done and not os.path.exists(weights)
    for variable in backbone.weights:
        np.testing.assert_array_equal(
            np.asarray(variable.value), expected[variable.path]
        )


@pytest.mark.parametrize("change", ["replace", "delete"])
def test_an_h5_file_changed_as_keras_opens_it_loads_what_keras_opened(
    versions, change, tmp_path, monkeypatch
):
    path, new_file, weights = loading_copy(versions, "keras", tmp_path)
    expected = reference(versions["keras"][0])

    done = change_as_keras_opens(
        monkeypatch,
        weights,
        (lambda: replace_atomically(weights, new_file))
        if change == "replace"
        else lambda: os.remove(weights),
    )
    backbone = keras_hub.models.Backbone.from_preset(path, device_mesh=MESH)
    assert done
    for variable in backbone.weights:
        np.testing.assert_array_equal(
            np.asarray(variable.value), expected[variable.path], err_msg=variable.path
        )


@pytest.mark.parametrize("format", ["keras", "transformers"])
def test_a_file_rewritten_in_place_while_loading_is_an_error(
    versions, format, tmp_path, monkeypatch
):
    path, new_file, weights = loading_copy(versions, format, tmp_path)

    def rewrite():
        with open(new_file, "rb") as source, open(weights, "r+b") as target:
            target.write(source.read())
        stat = os.stat(weights)
        # A later modification time even on a file system with coarse clocks.
        os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))

    change_after_first_weight(monkeypatch, rewrite)
    with pytest.raises(
        keras_hub_autodist.WeightFileChangedError,
        match=r"was modified while a model was loaded.*Received: size",
    ):
        keras_hub.models.Backbone.from_preset(path, device_mesh=MESH)
    assert loading.active_sessions() == 0
    assert compat.installed_patches() == {}
