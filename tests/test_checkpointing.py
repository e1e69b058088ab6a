"""Checkpoints of bound models restore everything, or refuse to.

Each case trains a tiny Gemma with Adam on 8 virtual CPU devices and compares
with an uninterrupted run of the same model on the same data. The default
session runs one case of each kind; other meshes and formats are `slow`.
"""

import os
import warnings

import jax
import keras
import keras_hub
import numpy as np
import pytest
import tiny_presets

import keras_hub_autodist
from keras_hub_autodist import RestoreError
from keras_hub_autodist import ResumableCheckpoint
from keras_hub_autodist import compat

MESH = {"batch": 2, "model": 4}
OTHER_MESH = {"batch": 4, "model": 2}
BATCH = 8
ROWS = 32  # 4 batches per epoch
MIXED = "Detected a mix of local"


def one_device_mesh():
    return keras.distribution.DeviceMesh((1, 1), ["batch", "model"], jax.devices()[:1])


@pytest.fixture(scope="module")
def preset(tiny_presets_dir):
    return tiny_presets_dir["gemma_mqa"]


def data(preset):
    info = keras_hub_autodist.reading.presets.read_preset_config(preset)
    x = tiny_presets.token_batch(ROWS, info.config["vocabulary_size"])
    return x, np.roll(x["token_ids"], -1, axis=1)


def bound(preset, mesh=MESH, optimizer=None, **compile_kwargs):
    lm = keras_hub.models.CausalLM.from_preset(
        preset, preprocessor=None, device_mesh=mesh
    )
    lm.compile(
        # Built before compile on purpose: its iteration and learning rate
        # are created off the mesh.
        optimizer=optimizer or keras.optimizers.Adam(1e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        **compile_kwargs,
    )
    return lm


def fit(lm, preset, epochs=1, callbacks=()):
    x, y = data(preset)
    lm.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=list(callbacks),
    )


def state(lm):
    """Every weight and optimizer value, by path (the optimizer's own name,
    numbered per process, left out)."""
    found = {w.path: np.asarray(w.value) for w in lm.weights}
    for v in lm.optimizer.variables:
        found["optimizer/" + v.path.split("/", 1)[1]] = np.asarray(v.value)
    return found


def assert_same_state(actual, expected, atol=0.0):
    assert actual.keys() == expected.keys()
    for path, value in expected.items():
        np.testing.assert_allclose(actual[path], value, atol=atol, err_msg=path)


class StopAfter(keras.callbacks.Callback):
    """Stops training after `batches` batches, as a kill would."""

    def __init__(self, batches):
        super().__init__()
        self.batches = batches
        self.seen = 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen >= self.batches:
            self.model.stop_training = True


def test_no_mixed_sharding_warning_on_one_device(preset):
    assert_no_mixed_sharding_warning(preset, one_device_mesh())


def assert_no_mixed_sharding_warning(preset, mesh):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lm = bound(preset, mesh, metrics=["accuracy"])
        fit(lm, preset)
        x, y = data(preset)
        lm.evaluate(x, y, batch_size=BATCH, verbose=0)
    assert not [w for w in caught if MIXED in str(w.message)]
    for variable in lm.optimizer.variables + lm.metrics_variables:
        assert isinstance(variable.value.sharding, jax.sharding.NamedSharding)
        assert compat.variable_layout(variable) is not None, variable.path


def assert_load_weights_restores_everything(preset, tmp_path, optimizer_built_by):
    path = str(tmp_path / "run.weights.h5")
    reference = bound(preset)
    fit(reference, preset)
    reference.save_weights(path)
    saved = state(reference)
    fit(reference, preset)

    resumed = bound(preset)
    if optimizer_built_by == "the user":
        # What users do so that Keras' own load_weights keeps the state.
        resumed.optimizer.build(resumed.trainable_variables)
    resumed.load_weights(path)
    assert int(resumed.optimizer.iterations) == 4
    assert_same_state(state(resumed), saved)
    fit(resumed, preset)  # "incompatible devices" before the layouts lasted
    assert_same_state(state(resumed), state(reference))


def test_compile_load_weights_fit_restores_everything(preset, tmp_path):
    assert_load_weights_restores_everything(preset, tmp_path, "load_weights")


def test_weights_only_file_into_a_trained_optimizer_is_refused(preset, tmp_path):
    path = str(tmp_path / "fresh.weights.h5")
    bound(preset).save_weights(path)  # the optimizer was never built
    trained = bound(preset)
    fit(trained, preset)
    with pytest.raises(RestoreError, match="no optimizer state"):
        trained.load_weights(path)
    fresh = bound(preset)
    fresh.load_weights(path)  # nothing to lose: the optimizer is fresh too
    assert int(fresh.optimizer.iterations) == 0


def orbax_run(preset, directory, batches):
    lm = bound(preset)
    checkpoint = ResumableCheckpoint(directory, save_freq=1, max_to_keep=2)
    fit(lm, preset, epochs=2, callbacks=[checkpoint, StopAfter(batches)])
    return lm


@pytest.fixture(scope="module")
def uninterrupted(preset):
    lm = bound(preset)
    fit(lm, preset, epochs=2)
    return state(lm)


def assert_resumes_within_an_epoch(preset, tmp_path, uninterrupted, mesh):
    directory = str(tmp_path / "ckpt")
    orbax_run(preset, directory, batches=5)  # epoch 1, batch 1
    assert sorted(os.listdir(directory)) == ["4", "5"]
    lm = bound(preset, MESH if mesh == "same" else OTHER_MESH)
    checkpoint = ResumableCheckpoint(directory, save_freq=1, max_to_keep=2)
    fit(lm, preset, epochs=2, callbacks=[checkpoint])
    assert checkpoint.resumed_from == os.path.join(directory, "5")
    assert int(lm.optimizer.iterations) == 8  # no batch trained twice
    assert_same_state(state(lm), uninterrupted, atol=0 if mesh == "same" else 1e-6)


class Interrupted(Exception):
    """Raised by `InterruptAfter`; ends `fit` without `on_train_end`."""


class InterruptAfter(StopAfter):
    """Ends training after `batches` batches by raising, as a crash would:
    `BackupAndRestore` keeps its backup only when training did not finish."""

    def on_train_batch_end(self, batch, logs=None):
        super().on_train_batch_end(batch, logs)
        if self.model.stop_training:
            raise Interrupted(f"after {self.seen} batches")


def assert_backup_and_restore_resumes(preset, tmp_path, uninterrupted, mesh):
    directory = str(tmp_path / "backup")
    with pytest.raises(Interrupted):
        fit(
            bound(preset),
            preset,
            epochs=2,
            callbacks=[keras.callbacks.BackupAndRestore(directory), InterruptAfter(6)],
        )
    lm = bound(preset, MESH if mesh == "same" else OTHER_MESH)
    trained = StopAfter(batches=float("inf"))  # counts the batches only
    backup = keras.callbacks.BackupAndRestore(directory)
    fit(lm, preset, epochs=2, callbacks=[backup, trained])
    # The backup of epoch 1 was restored, and epoch 2 trained once from it
    # (a run from scratch would reach the same state in 8 batches).
    assert trained.seen == 4
    assert int(lm.optimizer.iterations) == 8
    assert_same_state(state(lm), uninterrupted, atol=0 if mesh == "same" else 1e-6)


def test_resumable_checkpoint_counts_batches():
    with pytest.raises(RestoreError, match="number of batches"):
        ResumableCheckpoint("unused", save_freq="epoch")


def test_the_private_attributes_compat_uses_exist(preset):
    lm = bound(preset)
    variable = lm.optimizer.iterations
    assert hasattr(variable, "_layout") and hasattr(variable, "_value")
    assert hasattr(lm, "_initial_epoch")
    checkpoint = ResumableCheckpoint("unused", save_freq=1)
    assert compat.orbax_unsaved_batches(checkpoint) == 0
    assert hasattr(checkpoint, "_total_batches_seen")
    assert hasattr(checkpoint, "_last_batch_seen")
