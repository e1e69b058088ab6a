"""Per-device peak of the compiled training step with and without
`remat="full"`, on the same step.

`keras_hub_autodist.compiled_memory` compiles (never runs) the SGD step of a
Gemma-shaped model deep enough for the blocks' activations to dominate: the
bench's `gemma_mqa` with `LAYERS` decoder blocks, one sequence of `SEQ`
tokens on `(1, 8)`. Next to XLA's peaks, the closed-form estimate for the
compiling platform (`step_memory.step_estimate`), which counts each block's
input alone under `"full"`.
"""

from __future__ import annotations

import keras

from bench import models

LAYERS = 8
SEQ = 2048
BATCH = 1
MESH = {"batch": 1, "model": 8}
MODEL = "gemma_mqa"
# The peak with "full", relative to without, that shows the recomputation.
TARGET = 0.5


def save_deep_preset(root) -> str:
    """`MODEL` with `LAYERS` blocks, saved under `root`; returns its path."""
    cls, config = models.CONFIGS[MODEL]
    keras.utils.set_random_seed(0)
    path = f"{root}/{MODEL}_{LAYERS}_blocks"
    cls(**dict(config, num_layers=LAYERS)).save_to_preset(path)
    return path


def peak(path, remat) -> dict:
    """XLA's peak and temporaries, and the estimate, for one `remat=`."""
    import keras_hub_autodist
    from keras_hub_autodist.fitting import step_memory

    plan = keras_hub_autodist.plan(path, MESH, remat=remat)
    compiled = keras_hub_autodist.compiled_memory(plan, BATCH, SEQ, "sgd")
    estimate = step_memory.step_estimate(
        plan, BATCH, SEQ, "sgd", platform=compiled.platform
    )
    return dict(
        peak=compiled.peak_bytes,
        temp=compiled.temp_bytes,
        estimate=estimate.total_bytes,
        platform=compiled.platform,
    )


def run(root) -> dict:
    """One row: the same step without and with `remat="full"`."""
    path = save_deep_preset(root)
    without = peak(path, None)
    full = peak(path, "full")
    ratio = full["peak"] / without["peak"]
    return dict(
        model=f"{MODEL} ({LAYERS} blocks)",
        mesh=f"{MESH['batch']}x{MESH['model']}",
        batch=BATCH,
        sequence_length=SEQ,
        platform=without["platform"],
        without=without,
        full=full,
        ratio=ratio,
        met=ratio <= TARGET,
    )
