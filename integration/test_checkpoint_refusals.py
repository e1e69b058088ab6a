"""Resumes that train, refuse or speak (the cases that need no training are
in tests/test_checkpoint_fingerprints.py).

- another batch size (or batches per epoch) than the interrupted run's is
  refused before anything is trained;
- a resume prints and logs where it resumed, a finished run says so and its
  `History` still holds the last epoch's metrics;
- a damaged newest checkpoint is skipped, moved aside, and the resumed run
  ends where an uninterrupted one does.
"""

import glob
import logging
import os

import keras
import numpy as np
import pytest
import tiny_presets
from test_checkpointing import StopAfter
from test_checkpointing import assert_same_state
from test_checkpointing import bound
from test_checkpointing import fit
from test_checkpointing import preset  # noqa: F401 (a fixture)
from test_checkpointing import state
from test_checkpointing import uninterrupted  # noqa: F401 (a fixture)

import keras_hub_autodist
from keras_hub_autodist import RestoreError
from keras_hub_autodist import ResumableCheckpoint

pytestmark = pytest.mark.slow

SAMPLES = 8


def samples(preset):  # noqa: F811
    info = keras_hub_autodist.presets.read_preset_config(preset)
    x = tiny_presets.token_batch(SAMPLES, info.config["vocabulary_size"])
    return x, np.roll(x["token_ids"], -1, axis=1)


def train(lm, preset, directory, batch_size, callbacks=(), **kwargs):  # noqa: F811
    x, y = samples(preset)
    checkpoint = ResumableCheckpoint(directory, save_freq=1, max_to_keep=None)
    history = lm.fit(
        x,
        y,
        batch_size=batch_size,
        shuffle=False,
        callbacks=[checkpoint, *callbacks],
        **{"epochs": 1, "verbose": 0, **kwargs},
    )
    return checkpoint, history


class CountBatches(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.trained = 0

    def on_train_batch_end(self, batch, logs=None):
        self.trained += bool(logs)  # a skipped batch logs nothing


def test_another_batch_size_is_refused(preset, tmp_path):  # noqa: F811
    # 8 samples in batches of 2, stopped after 3 batches.
    directory = str(tmp_path / "ckpt")
    train(bound(preset), preset, directory, batch_size=2, callbacks=[StopAfter(3)])
    saved = sorted(os.listdir(directory))
    # Batches of 4: 2 per epoch, another position for 3 batches done.
    lm = bound(preset)
    with pytest.raises(RestoreError) as raised:
        train(lm, preset, directory, batch_size=4)
    message = str(raised.value)
    assert "4 batches per epoch, this run's 2" in message
    assert "Use batch_size=2, as the interrupted run did" in message
    assert int(lm.optimizer.iterations) == 0  # refused before the restore
    assert sorted(os.listdir(directory)) == saved
    # The same batches per epoch with other batches: refused at the first.
    other = tmp_path / "other"
    train(
        bound(preset),
        preset,
        str(other),
        batch_size=2,
        steps_per_epoch=2,
        epochs=2,
        callbacks=[StopAfter(3)],
    )
    with pytest.raises(RestoreError, match="batch size 2, this run's 4") as raised:
        train(bound(preset), preset, str(other), 4, steps_per_epoch=2, epochs=2)
    assert "Nothing was trained" in str(raised.value)
    # The interrupted run's batches resume: the one batch left is trained.
    lm = bound(preset)
    counted = CountBatches()
    train(lm, preset, directory, batch_size=2, callbacks=[counted])
    assert counted.trained == 1 and int(lm.optimizer.iterations) == 4


def test_resume_speaks_and_a_finished_run_keeps_its_history(
    preset,  # noqa: F811
    tmp_path,
    capsys,
    caplog,
):
    directory = str(tmp_path / "ckpt")
    lm = bound(preset)
    train(lm, preset, directory, 2, epochs=2, callbacks=[StopAfter(5)])
    capsys.readouterr()
    caplog.set_level(logging.INFO, logger="keras_hub_autodist")
    _, history = train(bound(preset), preset, directory, 2, epochs=2, verbose=2)
    line = f"resumed from step 5 (epoch 2, batch 1) of {directory}"
    assert line in capsys.readouterr().out.splitlines()
    assert line in caplog.messages
    # Run again, finished: nothing to do, and the same last epoch's metrics.
    caplog.clear()
    lm = bound(preset)
    _, finished = train(lm, preset, directory, 2, epochs=2, verbose=1)
    done = "training already complete at step 8: nothing to do"
    assert done in capsys.readouterr().out.splitlines()
    assert done in caplog.messages
    assert finished.history["loss"] == [history.history["loss"][-1]]
    assert finished.history.keys() == history.history.keys()
    assert int(lm.optimizer.iterations) == 8
    # verbose=0: logged only.
    caplog.clear()
    train(bound(preset), preset, directory, 2, epochs=2)
    assert capsys.readouterr().out == ""
    assert done in caplog.messages


def test_a_damaged_newest_checkpoint_is_skipped_and_training_ends_the_same(
    preset,  # noqa: F811
    tmp_path,
    uninterrupted,  # noqa: F811
):
    directory = str(tmp_path / "ckpt")
    lm = bound(preset)
    checkpoint = ResumableCheckpoint(directory, save_freq=1, max_to_keep=2)
    fit(lm, preset, epochs=2, callbacks=[checkpoint, StopAfter(5)])
    assert sorted(os.listdir(directory)) == ["4", "5"]
    data_files = os.path.join(directory, "5", "pytree", "**", "d", "*")
    for name in glob.glob(data_files, recursive=True):
        with open(name, "r+b") as f:
            f.truncate(os.path.getsize(name) // 2)
    lm = bound(preset)
    checkpoint = ResumableCheckpoint(directory, save_freq=1, max_to_keep=2)
    with pytest.warns(UserWarning, match=r"checkpoint\(s\) 5 .* restored step 4"):
        fit(lm, preset, epochs=2, callbacks=[checkpoint])
    assert checkpoint.resumed_from == os.path.join(directory, "4")
    # Step 5 was saved again beside the damaged one, kept under another name.
    assert sorted(os.listdir(directory)) == ["5.damaged", "7", "8"]
    assert_same_state(state(lm), uninterrupted)
