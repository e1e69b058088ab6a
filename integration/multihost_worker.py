"""One process of the multi-host check: 4 virtual CPU devices of an 8-device mesh.

Usage: python multihost_worker.py PROCESS_ID PORT PRESET OUT.npz {local,wrong,read}

`local` feeds this process's own half of every global batch (the documented
convention); `wrong` feeds the first half on both processes (a control that
must give different results); `read` loads the backbone with `fsdp` and
writes, per process, the bytes it read from the weight file and the weights.
"""

import os
import sys

os.environ["KERAS_BACKEND"] = "jax"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax  # noqa: E402
import keras  # noqa: E402
import keras_hub  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

# Editable installs have no startup hook; importing the package activates it.
import keras_hub_autodist  # noqa: E402, F401

GLOBAL_BATCH = 8
STEPS = 3


def global_batches(vocabulary_size):
    rng = np.random.default_rng(0)
    for _ in range(STEPS):
        ids = rng.integers(4, vocabulary_size, size=(GLOBAL_BATCH, 8)).astype("int32")
        x = {"token_ids": ids, "padding_mask": np.ones_like(ids)}
        yield x, np.roll(ids, -1, axis=1)


def read_weights(process_id, preset, out):
    """Load with fsdp on 2x4; save this process's bytes read and the weights."""
    backbone = keras_hub.models.Backbone.from_preset(
        preset, device_mesh={"batch": 2, "model": 4}, strategy="fsdp"
    )
    stats = keras_hub_autodist.load_stats(backbone)
    _, plan = keras_hub_autodist.distribution_of(backbone)
    weights = {
        w.path: np.asarray(multihost_utils.process_allgather(w.value, tiled=True))
        for w in backbone.weights
    }
    np.savez(
        f"{out}.{process_id}.npz",
        bytes_read=stats.bytes_read,
        total_bytes=plan.total_bytes,
        **weights,
    )


def main(process_id, port, preset, out, mode):
    keras.distribution.initialize(
        job_addresses=f"127.0.0.1:{port}", num_processes=2, process_id=process_id
    )
    assert len(jax.devices()) == 8 and len(jax.local_devices()) == 4
    if mode == "read":
        read_weights(process_id, preset, out)
        jax.distributed.shutdown()
        return
    lm = keras_hub.models.CausalLM.from_preset(
        preset, preprocessor=None, device_mesh={"batch": 2, "model": 4}
    )
    lm.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    half = GLOBAL_BATCH // 2
    rows = slice(process_id * half, (process_id + 1) * half)
    if mode == "wrong":
        rows = slice(0, half)
    losses = []
    vocabulary_size = lm.backbone.vocabulary_size
    for x, y in global_batches(vocabulary_size):
        local_x = {k: v[rows] for k, v in x.items()}
        logs = lm.train_on_batch(local_x, y[rows], return_dict=True)
        losses.append(float(logs["loss"]))
    weights = {
        w.path: np.asarray(multihost_utils.process_allgather(w.value, tiled=True))
        for w in lm.backbone.weights
    }
    if process_id == 0:
        np.savez(out, losses=np.array(losses), **weights)
    jax.distributed.shutdown()


if __name__ == "__main__":
    pid, port, preset, out, mode = sys.argv[1:]
    main(int(pid), int(port), preset, out, mode)
