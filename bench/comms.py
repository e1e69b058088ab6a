"""Collectives and memory of the compiled training step, against compiled
hand-written references.

For every model x mesh x variant the train step is compiled once; its HLO
gives the collectives (`bench.hlo.collectives`) and `memory_analysis()` the
per-device argument, output and temporary bytes. The references are
compiled layouts, not formulas: a hand-written Megatron layout and a
hand-written fully sharded (ZeRO-3 style) one (`bench.references`),
keras-hub's static map and replicated data parallelism.
"""

from __future__ import annotations

import jax

from bench import hlo
from bench import models

# (shape, axis names): the four batch x model splits of 8 devices, and 2 x 4
# again with the model axis first (same sizes, transposed device order).
MESHES = [
    ((8, 1), ("batch", "model")),
    ((4, 2), ("batch", "model")),
    ((2, 4), ("batch", "model")),
    ((1, 8), ("batch", "model")),
    ((4, 2), ("model", "batch")),
]
VARIANTS = ["autodist_tp", "autodist_fsdp", "megatron", "zero3", "static", "replicated"]
# Each autodist strategy against its compiled reference, with the target.
REFERENCES = {"autodist_tp": "megatron", "autodist_fsdp": "zero3"}
TARGET = 1.05
BUILD_TOKENS = 8
MEMORY_FIELDS = (
    "argument_size_in_bytes",
    "output_size_in_bytes",
    "temp_size_in_bytes",
    "alias_size_in_bytes",
    "generated_code_size_in_bytes",
)


def mesh_label(shape, axis_names):
    """ "2x4" (batch x model); "2x4 (model, batch)" when the model axis is first."""
    sizes = dict(zip(axis_names, shape))
    label = f"{sizes['batch']}x{sizes['model']}"
    if tuple(axis_names) != ("batch", "model"):
        label += f" ({', '.join(axis_names)})"
    return label


def train_step_compiled(lm, distribution, data):
    """The compiled (SGD) train step for one batch `data = (x, y)`.

    The optimizer and metric variables are built by a step on the first
    `BUILD_TOKENS` tokens of each sequence; the full batch is only compiled,
    never run.
    """
    models.compile_for_training(lm, distribution)
    x, y = data
    with distribution.scope():
        lm.train_on_batch(
            {k: v[:, :BUILD_TOKENS] for k, v in x.items()}, y[:, :BUILD_TOKENS]
        )
        state = lm._get_jax_state(
            trainable_variables=True,
            non_trainable_variables=True,
            optimizer_variables=True,
            metrics_variables=True,
        )
        layout = distribution.get_data_layout(x["token_ids"].shape).backend_layout
        placed = jax.device_put((x, y, None), layout)
        return jax.jit(lm.train_step).lower(state, placed).compile()


def memory_of(compiled):
    """Per-device bytes from XLA's `memory_analysis()` ({} if unavailable)."""
    analysis = compiled.memory_analysis()
    if analysis is None:
        return {}
    return {
        field.replace("_size_in_bytes", ""): int(getattr(analysis, field, 0) or 0)
        for field in MEMORY_FIELDS
    }


def measure(name, path, shape, axis_names, variant):
    """One row: collectives and memory of one variant's compiled step."""
    mesh = mesh_label(shape, axis_names)
    lm, distribution = models.load(variant, name, path, shape, axis_names)
    if lm is None:
        return dict(
            model=name, mesh=mesh, variant=variant, note=f"fails: {distribution}"
        )
    compiled = train_step_compiled(
        lm,
        distribution,
        models.batch(lm.backbone.vocabulary_size, sequence_length=models.TRAIN_SEQ),
    )
    counts = hlo.collectives(compiled.as_text())
    row = dict(
        model=name,
        mesh=mesh,
        variant=variant,
        total=sum(c["bytes"] for c in counts.values()),
        count=sum(c["count"] for c in counts.values()),
        by_op=counts,
        memory=memory_of(compiled),
        note="",
    )
    if variant.startswith("autodist"):
        import keras_hub_autodist

        plan = keras_hub_autodist.distribution_of(lm).plan
        row["activation_estimate"] = plan.activation_bytes_per_device(
            models.BATCH, models.TRAIN_SEQ
        )
        row["parameter_bytes"] = plan.max_device_bytes
    return row


def run(paths, meshes=MESHES, variants=VARIANTS):
    rows = []
    for name, path in paths.items():
        for shape, axis_names in meshes:
            for variant in variants:
                rows.append(measure(name, path, shape, axis_names, variant))
    return rows


def verdicts(rows):
    """autodist / its compiled reference, per model x mesh, with the target.

    Returns dicts with model, mesh, variant, reference, ratio (of collective
    bytes; None when the reference moves none), met, and both rows.
    """
    found = []
    for row in rows:
        reference = REFERENCES.get(row["variant"])
        if reference is None or row.get("note"):
            continue
        ref = next(
            r
            for r in rows
            if r["model"] == row["model"]
            and r["mesh"] == row["mesh"]
            and r["variant"] == reference
        )
        if ref["total"]:
            ratio = row["total"] / ref["total"]
        else:
            ratio = None if row["total"] else 1.0
        met = ratio is not None and ratio <= TARGET
        found.append(
            dict(
                model=row["model"],
                mesh=row["mesh"],
                variant=row["variant"],
                reference=reference,
                ratio=ratio,
                met=met,
                row=row,
                ref=ref,
            )
        )
    return found
