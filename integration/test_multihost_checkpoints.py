"""Saving, restoring and resuming with 2 processes x 4 virtual CPU devices.

A bound model's `save_to_preset`, `save_weights` (also through
`keras.callbacks.ModelCheckpoint`) and `save` run in both processes on one
shared path: process 0 writes, both take part in gathering each array.
What they write loads with plain keras-hub in one process, and restores with
`load_weights` in two. Training with `ResumableCheckpoint`, killed in both
processes at random points and restarted, ends where an uninterrupted
one-process run of the same global data ends.
"""

import os
import random

import keras
import keras_hub
import numpy as np
import pytest
from test_kill import kill_after_random_batches
from test_kill import uninterrupted  # noqa: F401 - a fixture used below
from test_multihost import run_cluster
from test_multihost import start_cluster
from test_multihost import wait_cluster
from tiny_presets import moe_preset_name

pytestmark = pytest.mark.multihost

# The cases of `multihost_worker.SAVE_CASES` (not imported: the worker sets
# XLA_FLAGS for its own processes when imported).
SAVE_CASES = ("expert", "fsdp", "tp")
# As many kill points as test_kill.py's one-process run; each restart of
# the two processes costs about 20 s on a 2-core machine.
KILLS = 10
# As test_kill.py's runs on two meshes: the same arithmetic, grouped
# differently over the processes' collectives. Adam's normalised updates
# carry that rounding in proportion to a weight's size: under jax 0.12 one
# value of 0.082 ended 1.01e-5 away, hence a relative term as well.
ATOL = 1e-5
RTOL = 1e-4


def restorable_state(lm):
    """A single-process model's weights and optimizer variables, keyed as
    `multihost_worker.training_state` keys them."""
    state = {w.path: np.asarray(w.value) for w in lm.weights}
    for variable in lm.optimizer.variables:
        key = "optimizer/" + variable.path.split("/", 1)[-1]
        state[key] = np.asarray(variable.value)
    return state


def test_two_processes_save_to_one_path_and_restore(tiny_presets_dir, tmp_path):
    out = tmp_path / "saved"
    expert_preset = tiny_presets_dir[moe_preset_name("mixtral", 8)]
    run_cluster(tiny_presets_dir["gemma_mqa"], out, "save", tmp_path, expert_preset)
    assert sorted(path.stem for path in out.glob("*.npz")) == list(SAVE_CASES)
    for case in SAVE_CASES:
        folder = out / case
        saved = np.load(f"{folder}.npz")
        trained = {k: saved[k] for k in saved.files if not k.startswith("restored/")}
        assert len(trained) * 2 == len(saved.files)
        # `load_weights` in the two processes brought everything back.
        for key, value in trained.items():
            np.testing.assert_array_equal(
                saved[f"restored/{key}"], value, err_msg=f"{case}: {key}"
            )
        # One copy, written whole by one process, with no staging left.
        assert sorted(os.listdir(folder)) == [
            "checkpoint.weights.h5",
            "model.keras",
            "model.weights.h5",
            "preset",
        ]

        # Plain keras-hub, in one process, without a mesh.
        lm = keras_hub.models.CausalLM.from_preset(
            str(folder / "preset"), preprocessor=None
        )
        for weight in lm.weights:
            np.testing.assert_array_equal(
                np.asarray(weight.value), trained[weight.path], err_msg=weight.path
            )
        # Keras' own loader names layers anew: compared in model order.
        whole = keras.saving.load_model(folder / "model.keras", compile=False)
        assert len(whole.weights) == len(lm.weights)
        for loaded, weight in zip(whole.weights, lm.weights):
            np.testing.assert_array_equal(
                np.asarray(loaded.value), trained[weight.path], err_msg=weight.path
            )
        lm.compile(
            optimizer=keras.optimizers.Adam(1e-2),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        lm.optimizer.build(lm.trainable_variables)
        for name in ("model.weights.h5", "checkpoint.weights.h5"):
            lm.load_weights(str(folder / name))
            state = restorable_state(lm)
            assert sorted(state) == sorted(trained)
            assert int(state["optimizer/iteration"]) > 0
            for key, value in state.items():
                np.testing.assert_array_equal(
                    value, trained[key], err_msg=f"{case}: {name}: {key}"
                )


def test_two_processes_resume_after_kills(tiny_presets_dir, tmp_path, uninterrupted):  # noqa: F811
    """Both processes are killed with SIGKILL after 1 to 3 batches and a
    random part of the next one, then restarted on a fresh port."""
    preset = tiny_presets_dir["gemma_mqa"]
    rng = random.Random(3)
    checkpoints = str(tmp_path / "checkpoints")
    out = tmp_path / "resumed.npz"
    kills = 0
    for _ in range(3 * KILLS):
        if kills == KILLS:
            break
        first, second = start_cluster(
            preset, out, "resume", tmp_path, checkpoints, pipe_first=True
        )
        kills += kill_after_random_batches(first, rng)
        second.kill()
        second.wait()
    log = (tmp_path / "resume-0.log").read_text()
    assert kills == KILLS, log[-4000:]
    procs = start_cluster(preset, out, "resume", tmp_path, checkpoints)
    wait_cluster(procs, "resume", tmp_path)
    result = np.load(out)
    assert sorted(result.files) == sorted(uninterrupted.files)
    for path in uninterrupted.files:
        np.testing.assert_allclose(
            result[path], uninterrupted[path], atol=ATOL, rtol=RTOL, err_msg=path
        )
