"""Resumes that train, refuse or speak, each from a copy of one interrupted
run's checkpoints (the cases that need no training are in
test_checkpoint_fingerprints.py):

- another batch size (or batches per epoch) than the interrupted run's is
  refused before anything is trained;
- a resume prints and logs where it resumed and trains the batches left, to
  the state of an uninterrupted run; a finished run says so and its
  `History` still holds the last epoch's metrics;
- a damaged newest checkpoint is skipped, moved aside, and the resumed run
  ends where an uninterrupted one does.
"""

import glob
import logging
import os
import shutil

import keras
import numpy as np
import pytest
import tiny_presets
from test_checkpointing import StopAfter
from test_checkpointing import assert_same_state
from test_checkpointing import bound
from test_checkpointing import preset  # noqa: F401 (a fixture)
from test_checkpointing import state

import keras_hub_autodist
from keras_hub_autodist import RestoreError
from keras_hub_autodist import ResumableCheckpoint

pytestmark = pytest.mark.slow

SAMPLES = 8
BATCH = 2  # 4 batches per epoch
EPOCHS = 2


def samples(preset):  # noqa: F811
    info = keras_hub_autodist.reading.presets.read_preset_config(preset)
    x = tiny_presets.token_batch(SAMPLES, info.config["vocabulary_size"])
    return x, np.roll(x["token_ids"], -1, axis=1)


def train(lm, preset, directory, batch_size=BATCH, callbacks=(), **kwargs):  # noqa: F811
    """`fit` with a `ResumableCheckpoint` saving every batch into `directory`
    (None: without one); the checkpoint and the `History`."""
    x, y = kwargs.pop("x", None), None
    if x is None:
        x, y = samples(preset)
    checkpoint = None
    if directory is not None:
        keep = kwargs.pop("max_to_keep", None)
        checkpoint = ResumableCheckpoint(directory, save_freq=1, max_to_keep=keep)
    history = lm.fit(
        x,
        y,
        batch_size=batch_size,
        shuffle=False,
        callbacks=[c for c in (checkpoint, *callbacks) if c is not None],
        **{"epochs": EPOCHS, "verbose": 0, **kwargs},
    )
    return checkpoint, history


class CountBatches(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.trained = 0

    def on_train_batch_end(self, batch, logs=None):
        self.trained += bool(logs)  # a skipped batch logs nothing


@pytest.fixture(scope="module")
def interrupted(preset, tmp_path_factory):  # noqa: F811
    """The checkpoints (steps 1 to 5) of a run stopped after 5 batches:
    epoch 2, batch 1. Each test resumes from a copy."""
    directory = str(tmp_path_factory.mktemp("interrupted") / "ckpt")
    train(bound(preset), preset, directory, callbacks=[StopAfter(5)])
    assert sorted(os.listdir(directory)) == ["1", "2", "3", "4", "5"]
    return directory


@pytest.fixture(scope="module")
def uninterrupted(preset):  # noqa: F811
    """The state after the same 2 epochs, never stopped."""
    lm = bound(preset)
    train(lm, preset, None)
    return state(lm)


def copy_of(directory, tmp_path) -> str:
    copy = str(tmp_path / "ckpt")
    shutil.copytree(directory, copy)
    return copy


def test_another_batch_size_is_refused(preset, interrupted, tmp_path):  # noqa: F811
    directory = copy_of(interrupted, tmp_path)
    saved = sorted(os.listdir(directory))
    lm = bound(preset)
    # Batches of 4: 2 per epoch, another position for 5 batches done.
    with pytest.raises(RestoreError) as raised:
        train(lm, preset, directory, batch_size=4)
    message = str(raised.value)
    assert "4 batches per epoch, this run's 2" in message
    assert "Use batch_size=2, as the interrupted run did" in message
    assert int(lm.optimizer.iterations) == 0  # refused before the restore
    # The same batches per epoch with batches of 1 (which the bound task pads
    # to the 2 rows of the batch axis): refused too.
    with pytest.raises(RestoreError, match="batch size 2, this run's 1") as raised:
        train(lm, preset, directory, batch_size=1, steps_per_epoch=4)
    assert "Nothing was trained" in str(raised.value)
    assert int(lm.optimizer.iterations) == 0
    # A dataset's batch size known only from its first batch: refused there,
    # before its first step, so the model is left as it was before `fit`
    # (the restore the callback had made is undone with the rest).
    import tensorflow as tf

    dataset = tf.data.Dataset.from_tensor_slices(samples(preset)).batch(4).repeat()
    with pytest.raises(RestoreError, match="batch size 2, this run's 4") as raised:
        train(lm, preset, directory, batch_size=None, x=dataset, steps_per_epoch=4)
    assert "Nothing was trained" in str(raised.value)
    # Every value is still readable (fit had taken them off the variables),
    # and none was changed by the refused call.
    assert state(lm)["optimizer/iteration"] == 0
    assert sorted(os.listdir(directory)) == saved


def test_resume_speaks_and_a_finished_run_keeps_its_history(
    preset,  # noqa: F811
    interrupted,
    uninterrupted,
    tmp_path,
    capsys,
    caplog,
):
    directory = copy_of(interrupted, tmp_path)
    caplog.set_level(logging.INFO, logger="keras_hub_autodist")
    lm = bound(preset)
    counted = CountBatches()
    _, history = train(lm, preset, directory, callbacks=[counted], verbose=2)
    line = f"resumed from step 5 (epoch 2, batch 1) of {directory}"
    assert line in capsys.readouterr().out.splitlines()
    assert line in caplog.messages
    assert counted.trained == 3  # the batches left, each once
    assert_same_state(state(lm), uninterrupted)
    # Run again, finished: nothing to do, and the same last epoch's metrics,
    # restored from the checkpoint into a new model.
    caplog.clear()
    lm = bound(preset)
    _, finished = train(lm, preset, directory, verbose=1)
    done = "training already complete at step 8: nothing to do"
    assert done in capsys.readouterr().out.splitlines()
    assert done in caplog.messages
    assert finished.history["loss"] == [history.history["loss"][-1]]
    assert finished.history.keys() == history.history.keys()
    assert int(lm.optimizer.iterations) == 8
    # verbose=0: logged only.
    caplog.clear()
    train(lm, preset, directory)
    assert capsys.readouterr().out == ""
    assert done in caplog.messages


def test_a_damaged_newest_checkpoint_is_skipped_and_training_ends_the_same(
    preset,  # noqa: F811
    interrupted,
    uninterrupted,
    tmp_path,
):
    directory = copy_of(interrupted, tmp_path)
    data_files = os.path.join(directory, "5", "pytree", "**", "d", "*")
    for name in glob.glob(data_files, recursive=True):
        with open(name, "r+b") as f:
            f.truncate(os.path.getsize(name) // 2)
    lm = bound(preset)
    with pytest.warns(UserWarning, match=r"checkpoint\(s\) 5 .* restored step 4"):
        checkpoint, _ = train(lm, preset, directory, max_to_keep=2)
    assert checkpoint.resumed_from == os.path.join(directory, "4")
    # Step 5 was saved again beside the damaged one, kept under another name.
    assert sorted(os.listdir(directory)) == ["5.damaged", "7", "8"]
    assert_same_state(state(lm), uninterrupted)
