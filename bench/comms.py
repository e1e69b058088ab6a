"""Collectives in the compiled training step, against the Megatron figure."""

from __future__ import annotations

import jax

from bench import hlo
from bench import models

MESHES = [(8, 1), (4, 2), (2, 4), (1, 8)]
VARIANTS = ["autodist_tp", "autodist_fsdp", "static", "replicated"]


def train_step_hlo(lm, distribution):
    models.compile_for_training(lm, distribution)
    x, y = models.batch(lm.backbone.vocabulary_size)
    with distribution.scope():
        lm.train_on_batch(x, y)  # builds optimizer and metric variables
        state = lm._get_jax_state(
            trainable_variables=True,
            non_trainable_variables=True,
            optimizer_variables=True,
            metrics_variables=True,
        )
        layout = distribution.get_data_layout(x["token_ids"].shape).backend_layout
        data = jax.device_put((x, y, None), layout)
        return jax.jit(lm.train_step).lower(state, data).compile().as_text()


def megatron_bytes(name, shape, itemsize=4):
    """2 all-reduces of batch x seq x hidden per layer forward, 2 backward, plus
    the data-parallel gradient all-reduce of parameters / model-axis size."""
    batch_axis, model_axis = shape
    config = models.CONFIGS[name][1]
    activations = (
        4
        * config["num_layers"]
        * models.BATCH
        * models.SEQ
        * config["hidden_dim"]
        * itemsize
    )
    activations = activations if model_axis > 1 else 0
    cls = models.CONFIGS[name][0]
    params = cls(**config).count_params() * itemsize
    gradients = params / model_axis if batch_axis > 1 else 0
    return activations + gradients


def run(paths):
    rows = []
    for name, path in paths.items():
        for shape in MESHES:
            for variant in VARIANTS:
                lm, distribution = models.load(variant, name, path, shape)
                if lm is None:
                    rows.append(
                        dict(
                            model=name,
                            mesh=f"{shape[0]}x{shape[1]}",
                            variant=variant,
                            note=f"fails: {distribution}",
                        )
                    )
                    continue
                counts = hlo.collectives(train_step_hlo(lm, distribution))
                rows.append(
                    dict(
                        model=name,
                        mesh=f"{shape[0]}x{shape[1]}",
                        variant=variant,
                        total=sum(c["bytes"] for c in counts.values()),
                        count=sum(c["count"] for c in counts.values()),
                        by_op=counts,
                        note="",
                    )
                )
            rows.append(
                dict(
                    model=name,
                    mesh=f"{shape[0]}x{shape[1]}",
                    variant="megatron (analytic)",
                    total=megatron_bytes(name, shape),
                    count=None,
                    by_op=None,
                    note="",
                )
            )
    return rows
