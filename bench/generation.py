"""Tokens/s of greedy `generate` with and without a mesh (CPU, honest)."""

from __future__ import annotations

import time

import keras
import numpy as np

from bench import models

LENGTH = 64


def run(paths, name="gemma_mqa"):
    rows = []
    cls = models.CAUSAL_LM[models.CONFIGS[name][0]]
    x, _ = models.batch(models.CONFIGS[name][1]["vocabulary_size"])
    mask = np.zeros_like(x["padding_mask"])
    mask[:, :8] = 1
    prompt = {"token_ids": x["token_ids"] * mask, "padding_mask": mask}
    for label, mesh in [
        ("one device", None),
        ("mesh 8x1", {"batch": 8, "model": 1}),
        ("mesh 2x4", {"batch": 2, "model": 4}),
        ("mesh 1x8", {"batch": 1, "model": 8}),
    ]:
        kwargs = {"device_mesh": mesh} if mesh else {}
        lm = cls.from_preset(paths[name], preprocessor=None, **kwargs)
        lm.compile(sampler="greedy")
        start = time.perf_counter()
        lm.generate(prompt, max_length=LENGTH, stop_token_ids=None)
        first = time.perf_counter() - start
        timings = []
        for _ in range(3):
            start = time.perf_counter()
            lm.generate(prompt, max_length=LENGTH, stop_token_ids=None)
            timings.append(time.perf_counter() - start)
        steady = min(timings)
        tokens = models.BATCH * (LENGTH - 8)
        rows.append(
            dict(
                variant=label,
                first_call_s=first,
                steady_s=steady,
                tokens_per_s=tokens / steady,
            )
        )
        assert keras.distribution.distribution() is None
    return rows
