"""One process of the stop test: 4 virtual CPU devices of an 8-device mesh.

Usage: python stop_worker.py PROCESS_ID PORT PRESET CHECKPOINTS OUT

Trains a tiny CausalLM with Adam for `EPOCHS` epochs on this process's half
of each global batch (`local_rows`), with a `ResumableCheckpoint` in
CHECKPOINTS that saves only when asked to stop (on `SIGTERM`). It prints
`batch N` after each batch (the parent sends `SIGTERM` to one process at
some point), and when `fit` returns it writes OUT.<process id>.json (the
optimizer's iteration count, the checkpoint it resumed from) and, on process
0, OUT.npz with every weight.
"""

import json
import os
import sys

if __name__ == "__main__":  # a process of its own (the test imports helpers)
    os.environ["KERAS_BACKEND"] = "jax"
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax  # noqa: E402
import keras  # noqa: E402
import keras_hub  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

import keras_hub_autodist  # noqa: E402

MESH = {"batch": 2, "model": 4}
GLOBAL_BATCH = 8
BATCHES_PER_EPOCH = 4
EPOCHS = 3  # 12 batches
PROCESSES = 2


def global_data(vocabulary_size):
    """The rows of every global batch, in order."""
    rng = np.random.default_rng(0)
    rows = GLOBAL_BATCH * BATCHES_PER_EPOCH
    ids = rng.integers(4, vocabulary_size, size=(rows, 8)).astype("int32")
    return {"token_ids": ids, "padding_mask": np.ones_like(ids)}, np.roll(ids, -1, 1)


def local_rows(process_id):
    """This process's rows: its half of each global batch (process 0 feeds
    the first half, which lands on its devices)."""
    half = GLOBAL_BATCH // PROCESSES
    return np.concatenate(
        [
            np.arange(start + process_id * half, start + (process_id + 1) * half)
            for start in range(0, GLOBAL_BATCH * BATCHES_PER_EPOCH, GLOBAL_BATCH)
        ]
    )


def compile_model(lm):
    lm.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )


class Announce(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        print(f"batch {batch}", flush=True)


def main(process_id, port, preset, checkpoints, out):
    keras.distribution.initialize(
        job_addresses=f"127.0.0.1:{port}",
        num_processes=PROCESSES,
        process_id=process_id,
    )
    assert len(jax.devices()) == 8 and len(jax.local_devices()) == 4
    lm = keras_hub.models.CausalLM.from_preset(
        preset, preprocessor=None, device_mesh=MESH
    )
    compile_model(lm)
    x, y = global_data(lm.backbone.vocabulary_size)
    rows = local_rows(process_id)
    checkpoint = keras_hub_autodist.ResumableCheckpoint(
        checkpoints, save_freq=100, max_to_keep=2
    )
    lm.fit(
        {k: v[rows] for k, v in x.items()},
        y[rows],
        batch_size=GLOBAL_BATCH // PROCESSES,
        epochs=EPOCHS,
        shuffle=False,
        verbose=0,
        callbacks=[checkpoint, Announce()],
    )
    with open(f"{out}.{process_id}.json", "w") as f:
        json.dump(
            {
                "iterations": int(lm.optimizer.iterations),
                "resumed_from": checkpoint.resumed_from,
            },
            f,
        )
    weights = {
        w.path: np.asarray(multihost_utils.process_allgather(w.value, tiled=True))
        for w in lm.weights
    }
    if process_id == 0:
        np.savez(f"{out}.npz", **weights)
    jax.distributed.shutdown()


if __name__ == "__main__":
    pid, port, preset, checkpoints, out = sys.argv[1:]
    main(int(pid), int(port), preset, checkpoints, out)
