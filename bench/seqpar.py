"""Per-device temporary bytes of the train step with and without sequence
parallelism, at a long sequence on `(1, 8)`.

The train step is compiled (never run) for one batch of `SEQ` tokens; XLA's
`memory_analysis()` gives its per-device temporary bytes. The model is built
and its optimizer and metric variables created on a short batch first, so
that nothing of the long sequence is executed.
"""

from __future__ import annotations

from bench import comms
from bench import models

SEQ = 4096
BATCH = 1
MESH = ((1, 8), ("batch", "model"))
MODEL = "gemma_mqa"
# Activation temporaries with sequence parallelism, relative to without.
TARGET = 0.3


def temp_bytes(path, sequence_parallel, name=MODEL, sequence_length=SEQ):
    """`memory_analysis()` of the compiled SGD train step at `sequence_length`."""
    cls = models.CAUSAL_LM[models.CONFIGS[name][0]]
    shape, axis_names = MESH
    lm = cls.from_preset(
        path,
        preprocessor=None,
        device_mesh=models.mesh_of(shape, axis_names),
        strategy="tp",
        sequence_parallel=sequence_parallel,
    )
    import keras_hub_autodist

    distribution = keras_hub_autodist.distribution_of(lm).distribution
    compiled = comms.train_step_compiled(
        lm,
        distribution,
        models.batch(
            lm.backbone.vocabulary_size,
            sequence_length=sequence_length,
            batch_size=BATCH,
        ),
    )
    plan = keras_hub_autodist.distribution_of(lm).plan
    return dict(
        comms.memory_of(compiled),
        estimate=plan.activation_bytes_per_device(BATCH, sequence_length),
    )


def run(paths, name=MODEL):
    """One row: temporaries without and with sequence parallelism."""
    without = temp_bytes(paths[name], False, name)
    with_sp = temp_bytes(paths[name], True, name)
    ratio = with_sp["temp"] / without["temp"] if without.get("temp") else None
    return dict(
        model=name,
        mesh=comms.mesh_label(*MESH),
        batch=BATCH,
        sequence_length=SEQ,
        temp_without=without.get("temp"),
        temp_with=with_sp.get("temp"),
        ratio=ratio,
        met=ratio is not None and ratio <= TARGET,
        # The planner's activation estimate with and without: how much of
        # the activations the residual stream (all sequence parallelism
        # shards) is.
        estimate_without=without["estimate"],
        estimate_with=with_sp["estimate"],
    )
