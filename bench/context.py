"""Context parallelism: the compiled training step's memory per device
against sequence length for context axes of 1, 2, 4 and 8 devices, its
collective bytes against a hand-written all-gather-K/V attention, and one
step-time ratio.

Memory: `keras_hub_autodist.compiled_memory` compiles (never runs) the SGD
training step of one sequence on `{"batch": 1, "context": c}` and reads
XLA's `memory_analysis()` per device. Collectives: the same step compiled
on `(1, 8)` with `context=8`, its all-gather bytes against those of a
`shard_map` attention that gathers keys and values by hand (MaxText's
`all_gather` strategy), forward and backward, times the model's layers.
"""

from __future__ import annotations

import os
import statistics
import time

import numpy as np

from bench import comms
from bench import hlo
from bench import models

MODEL = "gemma_mqa"
SEQUENCES = (1024, 2048, 4096, 8192, 16384)
CONTEXTS = (1, 2, 4, 8)
COLLECTIVE_SEQUENCE = 4096
STEP_SEQUENCE = 2048
# Compiled peak per device at 4096 tokens with context=8, relative to one
# device.
TARGET = 0.30
# The long-context curve: context=8, each `context_parallel_strategy`.
LONG_SEQUENCES = (8192, 16384, 32768, 65536, 131072)
LONG_CONTEXT = 8
# Memory linear in the sequence: the compiled peak grows by at most this
# much per doubling of the tokens (a square would be 4x).
GROWTH_TARGET = 2.2


def memory_grid(path) -> list[dict]:
    """Temporaries and peak per device, for each sequence and context size."""
    import keras_hub_autodist

    rows = []
    for context in CONTEXTS:
        mesh = {"batch": 1, "context": context} if context > 1 else {"batch": 1}
        plan = keras_hub_autodist.plan(path, mesh)
        for sequence in SEQUENCES:
            memory = keras_hub_autodist.compiled_memory(plan, 1, sequence, "sgd")
            rows.append(
                dict(
                    context=context,
                    sequence_length=sequence,
                    temp=memory.temp_bytes,
                    peak=memory.peak_bytes,
                    estimate=plan.activation_bytes_per_device(1, sequence),
                )
            )
    return rows


# A model whose gathered keys and values are what grows: 8 key/value heads
# of 128 (Llama 3 8B's), 2 layers, a small vocabulary so that the logits
# don't hide them.
WIDE_KV = dict(
    vocabulary_size=8192,
    num_layers=2,
    num_query_heads=8,
    num_key_value_heads=8,
    hidden_dim=1024,
    intermediate_dim=2048,
)


def save_wide_kv_preset(root) -> str:
    """`WIDE_KV` saved as a Llama 3 preset under `root`; its path."""
    import keras
    import keras_hub

    keras.utils.set_random_seed(0)
    path = f"{root}/llama_wide_kv"
    keras_hub.models.Llama3Backbone(**WIDE_KV).save_to_preset(path)
    return path


def long_curve(root) -> dict:
    """Compiled peak per device at `LONG_SEQUENCES` on `context=8`, for
    each `context_parallel_strategy`, with its growth per doubling: the
    bench's `MODEL` and `WIDE_KV`, saved under `root`."""
    import keras_hub_autodist
    from keras_hub_autodist.planning.options import CONTEXT_PARALLEL_STRATEGIES

    paths = {
        MODEL: models.save_presets(root)[MODEL],
        "llama_wide_kv": save_wide_kv_preset(root),
    }
    curves = {}
    for name, path in paths.items():
        for strategy in CONTEXT_PARALLEL_STRATEGIES:
            plan = keras_hub_autodist.plan(
                path,
                {"batch": 1, "context": LONG_CONTEXT},
                context_parallel_strategy=strategy,
            )
            peaks = [
                keras_hub_autodist.compiled_memory(plan, 1, s, "sgd").peak_bytes
                for s in LONG_SEQUENCES
            ]
            growth = [after / before for before, after in zip(peaks, peaks[1:])]
            curves[f"{name}, {strategy}"] = dict(peaks=peaks, growth=growth)
    worst = max(g for curve in curves.values() for g in curve["growth"])
    return dict(
        models=list(paths),
        context=LONG_CONTEXT,
        sequences=list(LONG_SEQUENCES),
        curves=curves,
        worst_growth=worst,
        met=worst <= GROWTH_TARGET,
    )


def _load(path, mesh):
    import keras_hub

    import keras_hub_autodist

    lm = keras_hub.models.CausalLM.from_preset(
        path, preprocessor=None, device_mesh=mesh, progress=False
    )
    return lm, keras_hub_autodist.distribution_of(lm).distribution


def model_gather_bytes(path, vocabulary_size) -> dict:
    """Collectives of the model's compiled step with `context=8`."""
    lm, distribution = _load(path, {"batch": 1, "context": 8})
    data = models.batch(
        vocabulary_size, sequence_length=COLLECTIVE_SEQUENCE, batch_size=1
    )
    compiled = comms.train_step_compiled(lm, distribution, data)
    return hlo.collectives(compiled.as_text())


def reference_gather_bytes(config, context=8) -> dict:
    """Collectives of hand-written context-parallel attention (forward and
    backward of one layer): each device's query block against keys and
    values all-gathered over the context axis, then times the layers."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec

    heads = config["num_query_heads"]
    kv_heads = config["num_key_value_heads"]
    head_dim = config["head_dim"]
    s = COLLECTIVE_SEQUENCE
    mesh = Mesh(np.array(jax.devices()[:context]), ("context",))
    block = PartitionSpec(None, "context")

    def attention(q, k, v):
        k = jax.lax.all_gather(k, "context", axis=1, tiled=True)
        v = jax.lax.all_gather(v, "context", axis=1, tiled=True)
        offset = jax.lax.axis_index("context") * q.shape[1]
        rows = offset + jnp.arange(q.shape[1])[:, None]
        causal = rows >= jnp.arange(k.shape[1])[None, :]
        k = jnp.repeat(k, heads // kv_heads, axis=2)
        v = jnp.repeat(v, heads // kv_heads, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(head_dim)
        scores = jnp.where(causal, scores, -1e30)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores), v)

    sharded = jax.shard_map(
        attention, mesh=mesh, in_specs=(block, block, block), out_specs=block
    )

    def loss(q, k, v):
        return sharded(q, k, v).sum()

    shapes = [(1, s, heads, head_dim), (1, s, kv_heads, head_dim)]
    args = [
        jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, block))
        for shape in (shapes[0], shapes[1], shapes[1])
    ]
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    found = hlo.collectives(grad.lower(*args).compile().as_text())
    layers = config["num_layers"]
    return {
        op: {key: value * layers for key, value in counts.items()}
        for op, counts in found.items()
    }


def step_time_ratio(path, vocabulary_size, rounds=5) -> dict:
    """Median SGD step at `STEP_SEQUENCE` tokens with `context=8` against
    tensor parallelism on `model=8`, alternating, after a warm-up."""
    data = models.batch(vocabulary_size, sequence_length=STEP_SEQUENCE, batch_size=1)
    variants = {
        "context=8": {"batch": 1, "context": 8},
        "model=8 (tp)": {"batch": 1, "model": 8},
    }
    loaded = {}
    for label, mesh in variants.items():
        lm, distribution = _load(path, mesh)
        models.compile_for_training(lm, distribution)
        lm.train_on_batch(*data)  # compile
        loaded[label] = lm
    times = {label: [] for label in variants}
    for _ in range(rounds):
        for label, lm in loaded.items():
            start = time.perf_counter()
            lm.train_on_batch(*data)
            times[label].append(time.perf_counter() - start)
    medians = {label: statistics.median(t) for label, t in times.items()}
    return dict(
        sequence_length=STEP_SEQUENCE,
        median_s=medians,
        ratio=medians["context=8"] / medians["model=8 (tp)"],
    )


def run(paths) -> dict:
    _, config = models.CONFIGS[MODEL]
    path = paths[MODEL]
    grid = memory_grid(path)
    peak = {(r["context"], r["sequence_length"]): r["peak"] for r in grid}
    ratio = peak[(8, 4096)] / peak[(1, 4096)]
    return dict(
        model=MODEL,
        grid=grid,
        ratio_4096=ratio,
        met=ratio <= TARGET,
        collectives=model_gather_bytes(path, config["vocabulary_size"]),
        reference=reference_gather_bytes(config),
        step_time=step_time_ratio(path, config["vocabulary_size"]),
        long=long_curve(os.path.dirname(path)),
    )


def plot(result, out_dir) -> str:
    """Compiled peak per device against sequence length, one line per
    context size; returns the image's file name."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4))
    for context in CONTEXTS:
        rows = [r for r in result["grid"] if r["context"] == context]
        axes.plot(
            [r["sequence_length"] for r in rows],
            [r["peak"] / 2**20 for r in rows],
            marker="o",
            label=f"context={context}",
        )
    axes.set_xscale("log", base=2)
    axes.set_yscale("log", base=2)
    axes.set_xlabel("tokens per sequence")
    axes.set_ylabel("compiled peak per device (MiB)")
    axes.set_title(f"{result['model']}: training step, batch 1, SGD")
    axes.legend()
    figure.tight_layout()
    name = "context_memory.png"
    figure.savefig(out_dir / name, dpi=100)
    plt.close(figure)
    return name
