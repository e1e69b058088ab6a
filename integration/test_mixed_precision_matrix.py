"""Mixed precision checkpoints on every path, with `mixed_float16` and
`mixed_bfloat16`: Orbax restores and resumes of a wrapped optimizer, and a
resume with a learning-rate schedule (the fast cases are in
tests/test_mixed_precision_checkpoints.py)."""

import os

import keras
import pytest
from test_checkpointing import StopAfter
from test_mixed_precision_checkpoints import POLICIES
from test_mixed_precision_checkpoints import (
    assert_fingerprint_keeps_every_optimizer_variable,
)
from test_mixed_precision_checkpoints import assert_same_state
from test_mixed_precision_checkpoints import (
    assert_weights_file_restores_the_whole_chain,
)
from test_mixed_precision_checkpoints import bound
from test_mixed_precision_checkpoints import fit
from test_mixed_precision_checkpoints import state

from keras_hub_autodist import RestoreError
from keras_hub_autodist import ResumableCheckpoint

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def preset(tiny_presets_dir):
    return tiny_presets_dir["gemma_mqa"]


@pytest.mark.parametrize("dtype", POLICIES)
def test_a_weights_file_restores_the_whole_chain(preset, dtype, tmp_path):
    assert_weights_file_restores_the_whole_chain(preset, dtype, tmp_path)


@pytest.mark.parametrize("dtype", POLICIES)
def test_a_resume_under_mixed_precision_is_exact(preset, dtype, tmp_path):
    uninterrupted = bound(preset, dtype)
    fit(uninterrupted, preset, epochs=2)
    directory = str(tmp_path / "ckpt")
    interrupted = bound(preset, dtype)
    checkpoint = ResumableCheckpoint(directory, save_freq=1, max_to_keep=2)
    fit(interrupted, preset, epochs=2, callbacks=[checkpoint, StopAfter(5)])
    assert sorted(os.listdir(directory)) == ["4", "5"]
    assert_fingerprint_keeps_every_optimizer_variable(interrupted)
    lm = bound(preset, dtype)
    checkpoint = ResumableCheckpoint(directory, save_freq=1, max_to_keep=2)
    fit(lm, preset, epochs=2, callbacks=[checkpoint])
    assert checkpoint.resumed_from == os.path.join(directory, "5")
    assert sorted(os.listdir(directory)) == ["7", "8"]  # each batch once
    assert_same_state(state(lm), state(uninterrupted))


@pytest.mark.parametrize("dtype", POLICIES)
def test_an_orbax_checkpoint_restores_the_whole_optimizer_chain(
    preset, dtype, tmp_path
):
    directory = str(tmp_path / "ckpt")
    reference = bound(preset, dtype)
    fit(reference, preset, callbacks=[ResumableCheckpoint(directory, save_freq=4)])
    assert os.listdir(directory) == ["4"]
    saved = state(reference)
    resumed = bound(preset, dtype)
    resumed.load_weights(directory)
    assert float(resumed.optimizer.learning_rate) == pytest.approx(1e-2)
    assert_same_state(state(resumed), saved)


def test_a_schedule_may_replace_a_constant_rate_on_resume(preset, tmp_path):
    directory = str(tmp_path / "ckpt")
    reference = bound(preset, "float32")
    fit(reference, preset, callbacks=[ResumableCheckpoint(directory, save_freq=4)])
    saved = state(reference)
    schedule = keras.optimizers.schedules.CosineDecay(1e-2, decay_steps=100)
    resumed = bound(preset, "float32", learning_rate=schedule)
    resumed.load_weights(directory)
    assert resumed.optimizer.learning_rate is not None
    assert int(resumed.optimizer.iterations) == 4
    restored = state(resumed)
    # Every slot and the iteration count restored; the rate is the schedule.
    assert "outer/learning_rate" not in restored
    saved.pop("outer/learning_rate")
    assert_same_state(restored, saved)


def test_a_weights_file_refuses_a_schedule_change_saying_why(preset, tmp_path):
    path = str(tmp_path / "run.weights.h5")
    reference = bound(preset, "float32")
    fit(reference, preset)
    reference.save_weights(path)
    schedule = keras.optimizers.schedules.CosineDecay(1e-2, decay_steps=100)
    resumed = bound(preset, "float32", learning_rate=schedule)
    with pytest.raises(RestoreError, match="by position: a learning-rate schedule"):
        resumed.load_weights(path)
