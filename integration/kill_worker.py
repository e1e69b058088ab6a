"""One training run of the kill test: resumes from checkpoints, then trains.

Usage: python kill_worker.py PRESET CHECKPOINTS OUT.npz BATCH_AXIS MODEL_AXIS

Trains a tiny CausalLM with Adam for `EPOCHS` epochs on fixed data, with a
`ResumableCheckpoint` saving after every batch in the background. It prints
`batch N` after each batch trained (the parent kills it at random points) and
writes the final weights to OUT.npz when training ends.
"""

import os
import sys

os.environ["KERAS_BACKEND"] = "jax"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import keras_hub  # noqa: E402
import numpy as np  # noqa: E402

import keras_hub_autodist  # noqa: E402

ROWS = 64
BATCH = 8
EPOCHS = 3  # 24 batches


def data(vocabulary_size):
    rng = np.random.default_rng(0)
    ids = rng.integers(4, vocabulary_size, size=(ROWS, 8)).astype("int32")
    return {"token_ids": ids, "padding_mask": np.ones_like(ids)}, np.roll(ids, -1, 1)


class Announce(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        print(f"batch {batch}", flush=True)


def main(preset, checkpoints, out, batch_axis, model_axis):
    lm = keras_hub.models.CausalLM.from_preset(
        preset,
        preprocessor=None,
        device_mesh={"batch": int(batch_axis), "model": int(model_axis)},
    )
    lm.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    x, y = data(lm.backbone.vocabulary_size)
    callbacks = [Announce()]
    if checkpoints != "-":
        callbacks.insert(
            0,
            keras_hub_autodist.ResumableCheckpoint(
                checkpoints, save_freq=1, max_to_keep=2
            ),
        )
    lm.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=EPOCHS,
        shuffle=False,
        verbose=0,
        callbacks=callbacks,
    )
    np.savez(out, **{w.path: np.asarray(w.value) for w in lm.weights})


if __name__ == "__main__":
    main(*sys.argv[1:])
