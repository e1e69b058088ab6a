"""2 processes x 4 virtual CPU devices form one 8-device mesh via JAX's runtime.

Each process loads the same preset with `device_mesh={"batch": 2, "model": 4}`
and trains on its process-local half of each global batch; the result must
equal a single-process 8-device run on the same global data.
"""

import os
import socket
import subprocess
import sys
import time

import keras
import keras_hub
import numpy as np
import pytest

pytestmark = pytest.mark.multihost

HERE = os.path.dirname(os.path.abspath(__file__))
TIMEOUT = 420


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_cluster(preset, out, mode, tmp_path, *argument, pipe_first=False):
    """Start both processes of `multihost_worker.py` on a fresh port.

    Their output is appended to `tmp_path/MODE-PID.log`; with `pipe_first`,
    the first process's stdout is a pipe (its stderr goes to its log).
    """
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = []
    for pid in range(2):
        piped = pipe_first and pid == 0
        with open(tmp_path / f"{mode}-{pid}.log", "a") as log:
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-u",
                        os.path.join(HERE, "multihost_worker.py"),
                        str(pid),
                        str(port),
                        preset,
                        str(out),
                        mode,
                        *argument,
                    ],
                    stdout=subprocess.PIPE if piped else log,
                    stderr=log if piped else subprocess.STDOUT,
                    text=True,
                    env=env,
                    cwd=HERE,
                )
            )
    return procs


def wait_cluster(procs, mode, tmp_path):
    """Wait for both processes; when one fails, stop the other at once
    (it would wait for its peer until JAX's coordination service gives up)."""
    deadline = time.monotonic() + TIMEOUT
    try:
        for proc in procs:
            if proc.stdout is not None:
                proc.stdout.read()
        while any(proc.poll() is None for proc in procs):
            failed = any(proc.poll() not in (None, 0) for proc in procs)
            if failed or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
    failures = [
        f"process {pid} (exit {proc.returncode}):\n"
        + (tmp_path / f"{mode}-{pid}.log").read_text()[-4000:]
        for pid, proc in enumerate(procs)
        if proc.returncode != 0
    ]
    assert not failures, "\n".join(failures)


def run_cluster(preset, out, mode, tmp_path, *argument):
    """Run both processes of `multihost_worker.py MODE` to the end."""
    wait_cluster(start_cluster(preset, out, mode, tmp_path, *argument), mode, tmp_path)
    if mode == "read":
        return [np.load(f"{out}.{pid}.npz") for pid in range(2)]
    if mode == "save":
        return None
    return np.load(out)


def single_process_reference(preset):
    sys.path.insert(0, HERE)
    import multihost_worker

    lm = keras_hub.models.CausalLM.from_preset(
        preset, preprocessor=None, device_mesh={"batch": 2, "model": 4}
    )
    lm.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    losses = [
        float(lm.train_on_batch(x, y, return_dict=True)["loss"])
        for x, y in multihost_worker.global_batches(lm.backbone.vocabulary_size)
    ]
    return losses, {w.path: np.asarray(w.value) for w in lm.backbone.weights}


def test_two_processes_match_one(tiny_presets_dir, tmp_path):
    preset = tiny_presets_dir["gemma_mqa"]
    result = run_cluster(preset, tmp_path / "local.npz", "local", tmp_path)
    losses, weights = single_process_reference(preset)
    np.testing.assert_allclose(result["losses"], losses, rtol=1e-5)
    for path, value in weights.items():
        np.testing.assert_allclose(result[path], value, atol=1e-5, err_msg=path)

    # Control: both processes feed the first half; the run must differ.
    wrong = run_cluster(preset, tmp_path / "wrong.npz", "wrong", tmp_path)
    assert not np.allclose(wrong["losses"], losses, rtol=1e-5)


def test_each_process_reads_only_its_slices(tiny_presets_dir, tmp_path):
    """fsdp on 2x4 over 2 processes: each reads at most 55% of the weights'
    bytes from the file, and the loaded weights equal one process's load."""
    preset = tiny_presets_dir["gemma_mqa"]
    results = run_cluster(preset, tmp_path / "read", "read", tmp_path)
    reference = keras_hub.models.Backbone.from_preset(preset)
    for result in results:
        fraction = float(result["bytes_read"]) / float(result["total_bytes"])
        assert 0 < fraction <= 0.55, fraction
        for weight in reference.weights:
            np.testing.assert_array_equal(
                result[weight.path], np.asarray(weight.value), err_msg=weight.path
            )
