"""`ResumableCheckpoint` stops on SIGTERM or a time limit, and a resumed run
equals one that never stopped: weights, optimizer, the epoch's logged metrics
and Keras' global random stream.

A tiny Gemma with Adam trains 2 epochs of 4 batches on 8 virtual CPU devices;
each case stops it mid-epoch, resumes it with a fresh callback on the same
folder, and compares with the uninterrupted run (bit-exact: same mesh).
"""

import os
import signal
import threading
import types

import keras
import pytest
from test_checkpointing import BATCH
from test_checkpointing import assert_same_state
from test_checkpointing import bound
from test_checkpointing import data
from test_checkpointing import preset  # noqa: F401 (a fixture)
from test_checkpointing import state

from keras_hub_autodist import RestoreError
from keras_hub_autodist import ResumableCheckpoint
from keras_hub_autodist.training import global_random
from keras_hub_autodist.training import stopping
from keras_hub_autodist.training.stopping import StopRequest

EPOCHS = 2
METRICS = ["accuracy"]


class DrawGlobalRandom(keras.callbacks.Callback):
    """Draws from Keras' global seed generator before each batch, as an
    eager augmentation or a noisy schedule would; keeps (epoch, batch) ->
    number."""

    def __init__(self):
        super().__init__()
        self.draws = {}
        self.epoch = None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        self.draws[(self.epoch, batch)] = float(keras.random.uniform(()))


class SigtermAt(keras.callbacks.Callback):
    """Sends this process SIGTERM while batch `batch` of epoch `epoch` trains."""

    def __init__(self, epoch, batch):
        super().__init__()
        self.at = (epoch, batch)
        self.epoch = None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if (self.epoch, batch) == self.at:
            os.kill(os.getpid(), signal.SIGTERM)


class SigtermHandlerDuringFit(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        self.handler = signal.getsignal(signal.SIGTERM)


def run(preset, callbacks, seed):  # noqa: F811
    """Train for `EPOCHS` with `callbacks`, Keras' global random state seeded
    with `seed` (another seed stands for a new process)."""
    keras.utils.set_random_seed(seed)
    # Create the global generator now: its seed is drawn from Python's
    # `random`, which loading and Orbax also draw from.
    keras.random.uniform(())
    lm = bound(preset, metrics=METRICS)
    draws = DrawGlobalRandom()
    x, y = data(preset)
    history = lm.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=EPOCHS,
        shuffle=False,
        verbose=0,
        callbacks=[*callbacks, draws],
    )
    return lm, history.history, draws.draws


@pytest.fixture(scope="module")
def reference(preset):  # noqa: F811
    lm, history, draws = run(preset, [], seed=0)
    return state(lm), history, draws


def resume_and_compare(preset, directory, reference, resumed_at):  # noqa: F811
    """Resume from the one checkpoint in `directory` in a run seeded
    otherwise, and compare it from `resumed_at` (epoch, batch) on with the
    uninterrupted `reference`."""
    (step,) = os.listdir(directory)
    checkpoint = ResumableCheckpoint(directory, save_freq=100, save_on_sigterm=False)
    handler = SigtermHandlerDuringFit()
    before = signal.getsignal(signal.SIGTERM)
    lm, history, draws = run(preset, [checkpoint, handler], seed=1)
    assert handler.handler is before  # save_on_sigterm=False: left alone
    assert checkpoint.resumed_from == os.path.join(directory, step)

    expected_state, expected_history, expected_draws = reference
    assert_same_state(state(lm), expected_state)
    epoch = resumed_at[0]
    for name, values in history.items():  # the whole epoch, not its tail
        assert values == expected_history[name][epoch:], name
    after = {k: v for k, v in expected_draws.items() if k >= resumed_at}
    assert {k: draws[k] for k in after} == after


@pytest.fixture
def sigterm_handler():
    """A Python SIGTERM handler for the test, the previous one put back."""
    received = []
    previous = signal.signal(signal.SIGTERM, lambda *_: received.append(True))
    yield received
    signal.signal(signal.SIGTERM, previous)


def test_sigterm_saves_the_batch_stops_and_resumes_exactly(
    preset,  # noqa: F811
    tmp_path,
    reference,
    sigterm_handler,
):
    directory = str(tmp_path / "ckpt")
    before = signal.getsignal(signal.SIGTERM)
    checkpoint = ResumableCheckpoint(directory, save_freq=100)
    handler = SigtermHandlerDuringFit()
    lm, _, _ = run(preset, [checkpoint, SigtermAt(1, 1), handler], seed=0)
    assert handler.handler is not before  # the callback's own, during fit
    assert signal.getsignal(signal.SIGTERM) is before  # put back at the end
    assert sigterm_handler == []  # the notice went to the callback
    assert int(lm.optimizer.iterations) == 6  # stopped after epoch 1, batch 1
    assert os.listdir(directory) == ["6"]  # saved at the end of that batch
    resume_and_compare(preset, directory, reference, resumed_at=(1, 2))


def test_time_limit_stops_after_the_batch_past_it_and_resumes_exactly(
    preset,  # noqa: F811
    tmp_path,
    reference,
    monkeypatch,
):
    ticks = iter(range(100))  # one second per look at the clock
    clock = types.SimpleNamespace(monotonic=lambda: float(next(ticks)))
    monkeypatch.setattr(stopping, "time", clock)
    directory = str(tmp_path / "ckpt")
    checkpoint = ResumableCheckpoint(
        directory, save_freq=100, time_limit=2.5, save_on_sigterm=False
    )
    lm, _, _ = run(preset, [checkpoint], seed=0)
    # Started at 0 s; the ends of batches 0, 1, 2 read 1, 2, 3 s.
    assert int(lm.optimizer.iterations) == 3
    assert os.listdir(directory) == ["3"]
    monkeypatch.undo()
    resume_and_compare(preset, directory, reference, resumed_at=(0, 3))


def test_a_second_sigterm_goes_to_the_previous_handler(sigterm_handler):
    request = StopRequest(on_sigterm=True)
    request.start()
    try:
        signal.raise_signal(signal.SIGTERM)
        assert request.sigterm_received and sigterm_handler == []
        signal.raise_signal(signal.SIGTERM)  # the run is stuck: stop it
        assert sigterm_handler == [True]
    finally:
        request.finish()


def test_no_sigterm_handler_off_the_main_thread(sigterm_handler):
    before = signal.getsignal(signal.SIGTERM)
    request = StopRequest(on_sigterm=True)
    errors = []

    def start():
        try:
            request.start()
        except Exception as error:  # Python refuses handlers off the main thread
            errors.append(error)

    thread = threading.Thread(target=start)
    thread.start()
    thread.join()
    assert errors == []
    assert signal.getsignal(signal.SIGTERM) is before
    request.finish()
    assert signal.getsignal(signal.SIGTERM) is before


def test_time_limit_none_never_stops():
    request = StopRequest(on_sigterm=False, time_limit=None)
    request.start()
    assert not request.should_stop(batches_trained=10**6)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"time_limit": -1}, "time_limit=-1"),
        ({"time_limit": "1h"}, "time_limit='1h'"),
        ({"check_freq": 0}, "stop_check_freq=0"),
        ({"check_freq": 1.5}, "stop_check_freq=1.5"),
    ],
)
def test_bad_stop_options_are_refused(kwargs, match):
    with pytest.raises(RestoreError, match=match):
        StopRequest(**kwargs)


def test_global_random_state_round_trip():
    keras.utils.set_random_seed(3)
    keras.random.uniform(())
    saved = global_random.saved_form()
    expected = float(keras.random.uniform(()))
    keras.utils.set_random_seed(4)  # another process's state
    global_random.restore(saved)
    assert float(keras.random.uniform(())) == expected


def test_an_unused_global_generator_is_left_alone():
    keras.utils.set_random_seed(5)  # no generator until something draws
    saved = global_random.saved_form()
    assert int(saved["in_use"]) == 0
    keras.random.uniform(())
    drawn = float(keras.random.uniform(()))
    keras.utils.set_random_seed(5)
    keras.random.uniform(())
    global_random.restore(saved)
    assert float(keras.random.uniform(())) == drawn
