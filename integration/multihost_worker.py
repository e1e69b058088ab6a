"""One process of the multi-host check: 4 virtual CPU devices of an 8-device mesh.

Usage: python multihost_worker.py PROCESS_ID PORT PRESET OUT MODE [ARGUMENT]

MODE is one of:

- `local`: feeds this process's own half of every global batch (the
  documented convention) and writes the losses and weights to OUT.npz;
- `wrong`: feeds the first half on both processes (a control that must give
  different results);
- `read`: loads the backbone with `fsdp` and writes, per process, the bytes
  it read from the weight file and the weights to OUT.PROCESS_ID.npz;
- `save`: for each case of `SAVE_CASES` (ARGUMENT: a MoE preset for the case
  with an expert axis), trains with Adam, saves a preset and weights files
  into the folder OUT/CASE shared by both processes, trains one more step,
  restores the weights file with `load_weights`, and writes the trained and
  the restored state to OUT/CASE.npz (the weights are also saved by a
  `keras.callbacks.ModelCheckpoint`, and the model by `save`);
- `resume`: trains the kill test's model and data (`kill_worker.py`) with a
  `ResumableCheckpoint` in the folder ARGUMENT, each process feeding its half
  of every global batch; prints `batch N` after each batch and writes the
  final weights to OUT.npz.
"""

import os
import sys
import traceback

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
MESH = {"batch": 2, "model": 4}
# Case -> (mesh, strategy) of the `save` mode; "expert" uses the MoE preset.
SAVE_CASES = {
    "tp": (MESH, "tp"),
    "fsdp": (MESH, "fsdp"),
    "expert": ({"batch": 2, "expert": 2, "model": 2}, "fsdp"),
}


def global_batches(vocabulary_size):
    rng = np.random.default_rng(0)
    for _ in range(STEPS):
        ids = rng.integers(4, vocabulary_size, size=(GLOBAL_BATCH, 8)).astype("int32")
        x = {"token_ids": ids, "padding_mask": np.ones_like(ids)}
        yield x, np.roll(ids, -1, axis=1)


def read_weights(process_id, preset, out):
    """Load with fsdp on 2x4; save this process's bytes read and the weights."""
    backbone = keras_hub.models.Backbone.from_preset(
        preset, device_mesh=MESH, strategy="fsdp"
    )
    stats = keras_hub_autodist.load_stats(backbone)
    _, plan = keras_hub_autodist.distribution_of(backbone)
    np.savez(
        f"{out}.{process_id}.npz",
        bytes_read=stats.bytes_read,
        total_bytes=plan.total_bytes,
        **gathered(backbone.weights),
    )


def local_rows(process_id):
    """This process's half of every global batch."""
    half = GLOBAL_BATCH // 2
    return slice(process_id * half, (process_id + 1) * half)


def train_local_batches(lm, rows):
    """Train on `rows` of each global batch; return the losses."""
    losses = []
    for x, y in global_batches(lm.backbone.vocabulary_size):
        local_x = {k: v[rows] for k, v in x.items()}
        logs = lm.train_on_batch(local_x, y[rows], return_dict=True)
        losses.append(float(logs["loss"]))
    return losses


def gathered(variables):
    """Each variable's global value, gathered onto every host."""
    return {
        v.path: np.asarray(multihost_utils.process_allgather(v.value, tiled=True))
        for v in variables
    }


def training_state(lm, prefix=""):
    """The weights and the optimizer's variables (keyed without the
    optimizer's own name, which Keras numbers per process), gathered."""
    optimizer = {
        f"optimizer/{path.split('/', 1)[-1]}": value
        for path, value in gathered(lm.optimizer.variables).items()
    }
    return {prefix + k: v for k, v in (gathered(lm.weights) | optimizer).items()}


def compile_adam(lm):
    lm.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )


def save_and_restore(process_id, preset, out, expert_preset):
    """The `save` mode: every case saves to one shared folder per case."""
    for case, (mesh, strategy) in SAVE_CASES.items():
        lm = keras_hub.models.CausalLM.from_preset(
            expert_preset if case == "expert" else preset,
            preprocessor=None,
            device_mesh=mesh,
            strategy=strategy,
        )
        compile_adam(lm)
        train_local_batches(lm, local_rows(process_id))
        folder = os.path.join(out, case)
        lm.save_to_preset(os.path.join(folder, "preset"))
        lm.save_weights(os.path.join(folder, "model.weights.h5"))
        # Keras' callback calls the bound `save_weights` at each epoch end.
        checkpoint = keras.callbacks.ModelCheckpoint(
            os.path.join(folder, "checkpoint.weights.h5"), save_weights_only=True
        )
        checkpoint.set_model(lm)
        checkpoint.on_epoch_end(0, {})
        lm.save(os.path.join(folder, "model.keras"))
        trained = training_state(lm)
        # One more step moves every weight and slot away from the file.
        train_local_batches(lm, local_rows(process_id))
        lm.load_weights(os.path.join(folder, "model.weights.h5"))
        restored = training_state(lm, "restored/")
        if process_id == 0:
            np.savez(f"{folder}.npz", **trained, **restored)


def resume(process_id, preset, out, checkpoints):
    """The `resume` mode: `kill_worker.py`'s training over two processes."""
    import kill_worker  # after JAX started: its XLA_FLAGS no longer apply

    lm = keras_hub.models.CausalLM.from_preset(
        preset, preprocessor=None, device_mesh=MESH
    )
    compile_adam(lm)
    x, y = kill_worker.data(lm.backbone.vocabulary_size)
    # Row r of global batch b is row b * GLOBAL_BATCH + r of the data.
    rows = np.arange(len(y)).reshape(-1, GLOBAL_BATCH)[:, local_rows(process_id)]
    rows = rows.reshape(-1)
    lm.fit(
        {k: v[rows] for k, v in x.items()},
        y[rows],
        batch_size=GLOBAL_BATCH // 2,
        epochs=kill_worker.EPOCHS,
        shuffle=False,
        verbose=0,
        callbacks=[
            keras_hub_autodist.ResumableCheckpoint(
                checkpoints, save_freq=1, max_to_keep=2
            ),
            kill_worker.Announce(),
        ],
    )
    weights = gathered(lm.weights)
    if process_id == 0:
        np.savez(out, **weights)


def main(process_id, port, preset, out, mode, argument=None):
    keras.distribution.initialize(
        job_addresses=f"127.0.0.1:{port}", num_processes=2, process_id=process_id
    )
    assert len(jax.devices()) == 8 and len(jax.local_devices()) == 4
    if mode == "read":
        read_weights(process_id, preset, out)
    elif mode == "save":
        save_and_restore(process_id, preset, out, argument)
    elif mode == "resume":
        resume(process_id, preset, out, argument)
    else:
        lm = keras_hub.models.CausalLM.from_preset(
            preset, preprocessor=None, device_mesh=MESH
        )
        lm.compile(
            optimizer=keras.optimizers.SGD(0.1),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        rows = slice(0, GLOBAL_BATCH // 2) if mode == "wrong" else None
        losses = train_local_batches(lm, rows or local_rows(process_id))
        weights = gathered(lm.backbone.weights)
        if process_id == 0:
            np.savez(out, losses=np.array(losses), **weights)
    jax.distributed.shutdown()


if __name__ == "__main__":
    pid, port, preset, out, mode, *argument = sys.argv[1:]
    try:
        main(int(pid), int(port), preset, out, mode, *argument)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        # Exit at once: JAX's shutdown at exit would wait for the other
        # process, which may wait in a collective for this one.
        os._exit(1)
