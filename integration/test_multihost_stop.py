"""2 processes x 4 virtual CPU devices: SIGTERM to one process stops both at
the same batch, both save that checkpoint together, and a restart resumes it.

`ResumableCheckpoint` makes the processes agree after every batch on whether
any of them wants to stop; Orbax saves are collective, so a process that
stopped alone would leave the other waiting in the save. The resumed run must
equal a one-process run of the same global batches on 8 devices.
"""

import json
import os
import signal
import subprocess
import sys

import keras_hub
import numpy as np
import pytest
from test_multihost import free_port

pytestmark = pytest.mark.multihost

HERE = os.path.dirname(os.path.abspath(__file__))
TIMEOUT = 300
SIGNALLED = 1  # the process that receives SIGTERM


def start_cluster(preset, checkpoints, out, log_dir, run):
    """Start both processes; stdout of `SIGNALLED` is piped to the caller."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = []
    for pid in range(2):
        log = open(log_dir / f"{run}-{pid}.log", "w")
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-u",
                    os.path.join(HERE, "stop_worker.py"),
                    str(pid),
                    str(port),
                    preset,
                    str(checkpoints),
                    str(out),
                ],
                stdout=subprocess.PIPE if pid == SIGNALLED else log,
                stderr=log,
                text=True,
                env=env,
                cwd=HERE,
            )
        )
        log.close()
    return procs


def finish(procs, log_dir, run):
    try:
        for proc in procs:
            if proc.stdout is not None:
                proc.stdout.read()
            proc.wait(timeout=TIMEOUT)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for pid, proc in enumerate(procs):
        log = (log_dir / f"{run}-{pid}.log").read_text()
        assert proc.returncode == 0, log[-4000:]


def results(out):
    return [json.loads(open(f"{out}.{pid}.json").read()) for pid in range(2)]


def single_process_reference(preset):
    import stop_worker

    lm = keras_hub.models.CausalLM.from_preset(
        preset, preprocessor=None, device_mesh=stop_worker.MESH
    )
    stop_worker.compile_model(lm)
    x, y = stop_worker.global_data(lm.backbone.vocabulary_size)
    lm.fit(
        x,
        y,
        batch_size=stop_worker.GLOBAL_BATCH,
        epochs=stop_worker.EPOCHS,
        shuffle=False,
        verbose=0,
    )
    return {w.path: np.asarray(w.value) for w in lm.weights}


def test_sigterm_to_one_process_stops_both_at_the_same_batch(
    tiny_presets_dir, tmp_path
):
    sys.path.insert(0, HERE)
    import stop_worker

    preset = tiny_presets_dir["gemma_mqa"]
    checkpoints = tmp_path / "checkpoints"
    total = stop_worker.EPOCHS * stop_worker.BATCHES_PER_EPOCH

    stopped = tmp_path / "stopped"
    procs = start_cluster(preset, checkpoints, stopped, tmp_path, "stopped")
    for line in procs[SIGNALLED].stdout:
        if line.startswith("batch "):  # training, the handler is installed
            procs[SIGNALLED].send_signal(signal.SIGTERM)
            break
    finish(procs, tmp_path, "stopped")
    first, second = results(stopped)
    assert first["iterations"] == second["iterations"]  # the same batch
    step = first["iterations"]
    assert 0 < step < total
    assert os.listdir(checkpoints) == [str(step)]  # saved together, complete

    resumed = tmp_path / "resumed"
    procs = start_cluster(preset, checkpoints, resumed, tmp_path, "resumed")
    finish(procs, tmp_path, "resumed")
    for result in results(resumed):
        assert result["resumed_from"] == str(checkpoints / str(step))
        assert result["iterations"] == total
    weights = np.load(f"{resumed}.npz")
    reference = single_process_reference(preset)
    assert sorted(weights.files) == sorted(reference)
    for path, value in reference.items():
        np.testing.assert_allclose(weights[path], value, atol=1e-5, err_msg=path)
