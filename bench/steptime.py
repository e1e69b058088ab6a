"""Median training step time, variants run alternately in one process."""

from __future__ import annotations

import statistics
import time

import jax

from bench import models

VARIANTS = ["autodist_tp", "autodist_fsdp", "static", "replicated"]


def run(paths, shape=(2, 4), rounds=6, steps=3):
    rows = []
    for name, path in paths.items():
        loaded = {}
        for variant in VARIANTS:
            lm, distribution = models.load(variant, name, path, shape)
            if lm is None:
                rows.append(
                    dict(model=name, variant=variant, note=f"fails: {distribution}")
                )
                continue
            models.compile_for_training(lm, distribution)
            x, y = models.batch(lm.backbone.vocabulary_size)
            for _ in range(2):  # warm-up: compile and settle
                with distribution.scope():
                    lm.train_on_batch(x, y)
            loaded[variant] = (lm, distribution, x, y)
        times = {variant: [] for variant in loaded}
        for _ in range(rounds):
            for variant, (lm, distribution, x, y) in loaded.items():
                for _ in range(steps):
                    start = time.perf_counter()
                    with distribution.scope():
                        logs = lm.train_on_batch(x, y, return_dict=True)
                    jax.block_until_ready(logs["loss"])
                    times[variant].append(time.perf_counter() - start)
        base = statistics.median(times["replicated"])
        for variant, samples in times.items():
            median = statistics.median(samples)
            rows.append(
                dict(
                    model=name,
                    variant=variant,
                    median_s=median,
                    ratio=median / base,
                    note="",
                )
            )
    return rows
