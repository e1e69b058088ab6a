"""`python -m bench.estimate_calibration`: the closed-form step estimates
against the compiled check, per model x mesh x dtype.

Compiles each training step abstractly (`LayoutPlan.compiled_memory`: no
weight is allocated) on 8 virtual CPU devices and prints, per case, XLA's
peak bytes per device, the plan's closed form (`training_bytes_per_device`
+ `activation_bytes_per_device`), the calibrated one for the compiling
platform (`keras_hub_autodist.fitting.step_memory.step_estimate`) and the
unweighted terms, as a Markdown table and JSON lines (`--json`).
"""

from __future__ import annotations

import os

os.environ["KERAS_BACKEND"] = "jax"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402

import keras  # noqa: E402

import keras_hub_autodist  # noqa: E402
from bench import models  # noqa: E402
from bench.accelerator_steps import GEMMA_2B  # noqa: E402
from keras_hub_autodist.fitting import step_memory  # noqa: E402

# The tests' tiny presets (tests/tiny_presets.py) and the bench models.
TINY = {
    "tiny_gemma_mqa": (
        "GemmaBackbone",
        dict(
            vocabulary_size=100,
            num_layers=2,
            num_query_heads=8,
            num_key_value_heads=1,
            hidden_dim=32,
            intermediate_dim=64,
            head_dim=8,
        ),
    ),
    "tiny_llama3": (
        "Llama3Backbone",
        dict(
            vocabulary_size=64,
            num_layers=2,
            num_query_heads=8,
            num_key_value_heads=2,
            hidden_dim=32,
            intermediate_dim=64,
        ),
    ),
}
BENCH = {name: (cls.__name__, config) for name, (cls, config) in models.CONFIGS.items()}
MESHES = [(1, 1), (8, 1), (2, 4), (1, 8)]
# The calibrated estimate's target against the compiled peak.
TARGET = 0.15
# Real configs of 0.5B to 2.6B parameters (tests/data/presets), float32,
# Adam (`--real`): on 2 x 4 devices, tp and fsdp, LoRA (rank 4) and full
# fine-tuning, 512 and 1024 tokens; LoRA on the other meshes (4 x 2 fsdp,
# 1 x 8 tp, 8 x 1 fsdp); the longer sequences of the two smallest; three
# steps with `remat="full"`, each next to the same step without; twelve
# in bfloat16; and five of Mixtral's shapes (two of its blocks).
REAL_PRESETS = os.path.join(os.path.dirname(__file__), "..", "tests", "data", "presets")
REAL = ("llama3.2_1b", "gemma3_1b", "gemma2_2b", "gemma_2b", "qwen2.5_0.5b")
OTHER_MESHES = (
    ((4, 2), "fsdp", 4, 512),
    ((1, 8), "tp", 2, 1024),
    ((8, 1), "fsdp", 8, 512),
)
REMAT = (
    ("llama3.2_1b", 2048, "tp", 4),
    ("gemma3_1b", 1024, "tp", None),
    ("llama3.2_1b", 512, "fsdp", None),
)
LONG = (("llama3.2_1b", 2048), ("llama3.2_1b", 4096), ("gemma3_1b", 4096))
# Steps in bfloat16, whose weights XLA's CPU backend keeps float32 copies of:
# (model, mesh, strategy, batch, seq, LoRA rank).
BFLOAT16 = (
    ("llama3.2_1b", (2, 4), "tp", 2, 512, 4),
    ("llama3.2_1b", (2, 4), "tp", 2, 512, None),
    ("llama3.2_1b", (2, 4), "tp", 2, 1024, None),
    ("llama3.2_1b", (2, 4), "fsdp", 2, 512, 4),
    ("llama3.2_1b", (2, 4), "fsdp", 2, 512, None),
    ("llama3.2_1b", (4, 2), "fsdp", 4, 512, 4),
    ("llama3.2_1b", (8, 1), "fsdp", 8, 512, 4),
    ("gemma3_1b", (2, 4), "tp", 2, 512, 4),
    ("gemma3_1b", (2, 4), "fsdp", 2, 512, 4),
    ("gemma3_1b", (1, 8), "tp", 2, 1024, 4),
    ("gemma_2b", (2, 4), "tp", 2, 512, None),
    ("gemma_2b", (2, 4), "fsdp", 2, 512, None),
)
# Mixtral 8x7B's shapes with 2 of its 32 blocks (keras-hub's
# `MixtralBackbone` arguments): (dtype, mesh, strategy, batch, seq, LoRA rank).
MIXTRAL_SHAPE = (
    "MixtralBackbone",
    dict(
        vocabulary_size=32000,
        num_layers=2,
        num_query_heads=32,
        num_key_value_heads=8,
        hidden_dim=4096,
        intermediate_dim=14336,
        num_experts=8,
        top_k=2,
        rope_max_wavelength=1000000,
        layer_norm_epsilon=1e-5,
    ),
)
MIXTRAL = (
    ("float32", (2, 4), "tp", 2, 512, 4),
    ("float32", (2, 4), "fsdp", 2, 512, None),
    ("float32", (1, 8), "tp", 2, 1024, None),
    ("bfloat16", (2, 4), "tp", 2, 512, 4),
    ("bfloat16", (2, 4), "fsdp", 2, 512, None),
)


def cases(quick=False):
    for name, model in TINY.items():
        for shape in MESHES:
            yield name, model, shape, "float32", 8, 128
    for name, model in BENCH.items():
        for shape in MESHES[: 2 if quick else None]:
            for dtype in ("float32", "bfloat16"):
                yield name, model, shape, dtype, 8, 512
    if not quick:
        for dtype in ("float32", "bfloat16"):
            yield "gemma_2b_shape", ("GemmaBackbone", GEMMA_2B), (1, 1), dtype, 4, 1024


def real_cases():
    """The `--real` grid, each step once: the remat cases' steps without
    remat may already be in it."""
    seen = set()
    for case in _real_grid():
        if case not in seen:
            seen.add(case)
            yield case


def _real_grid():
    for name in REAL:
        preset = os.path.join(REAL_PRESETS, name)
        for strategy in ("tp", "fsdp"):
            for lora_rank in (None, 4):
                for seq in (512, 1024):
                    yield (
                        name,
                        preset,
                        (2, 4),
                        "float32",
                        2,
                        seq,
                        strategy,
                        lora_rank,
                        None,
                    )
        for shape, strategy, batch, seq in OTHER_MESHES:
            yield name, preset, shape, "float32", batch, seq, strategy, 4, None
    for name, seq in LONG:
        preset = os.path.join(REAL_PRESETS, name)
        for strategy in ("tp", "fsdp"):
            yield name, preset, (2, 4), "float32", 2, seq, strategy, 4, None
    yield from remat_cases()
    yield from bfloat16_cases()
    yield from mixtral_cases()


def mixtral_cases():
    """Mixtral's shapes, 2 blocks (`MIXTRAL`)."""
    name = "mixtral_8x7b_2_blocks"
    for dtype, shape, strategy, batch, seq, lora_rank in MIXTRAL:
        yield name, MIXTRAL_SHAPE, shape, dtype, batch, seq, strategy, lora_rank, None


def bfloat16_cases():
    """Real configs in bfloat16 (`BFLOAT16`)."""
    for name, shape, strategy, batch, seq, lora_rank in BFLOAT16:
        preset = os.path.join(REAL_PRESETS, name)
        yield name, preset, shape, "bfloat16", batch, seq, strategy, lora_rank, None


def remat_cases():
    """Real configs with `remat="full"`, each next to the same step without."""
    for name, seq, strategy, lora_rank in REMAT:
        preset = os.path.join(REAL_PRESETS, name)
        for remat in (None, "full"):
            yield name, preset, (2, 4), "float32", 2, seq, strategy, lora_rank, remat


def measure(
    name, model, shape, dtype, batch, seq, strategy="tp", lora_rank=None, remat=None
):
    if isinstance(model, str):
        preset = model
    else:
        class_name, config = model
        preset = {"class_name": class_name, "config": config}
    devices = keras.distribution.list_devices()[: shape[0] * shape[1]]
    mesh = keras.distribution.DeviceMesh(shape, ("batch", "model"), devices)
    plan = keras_hub_autodist.plan(
        preset, mesh, strategy=strategy, dtype=dtype, lora_rank=lora_rank, remat=remat
    )
    compiled = keras_hub_autodist.compiled_memory(
        plan, batch, seq, "adam", preset=preset
    )
    closed = plan.training_bytes_per_device("adam") + plan.activation_bytes_per_device(
        batch, seq
    )
    estimate = step_memory.step_estimate(
        plan, batch, seq, "adam", platform=compiled.platform
    )
    return dict(
        model=name
        + (f" LoRA {lora_rank}" if lora_rank else "")
        + (f" remat {remat}" if remat else ""),
        mesh=f"{shape[0]}x{shape[1]} {strategy}",
        dtype=dtype,
        batch=batch,
        seq=seq,
        peak=compiled.peak_bytes,
        argument=compiled.argument_bytes,
        temp=compiled.temp_bytes,
        closed_form=closed,
        calibrated=estimate.total_bytes,
        state=estimate.weights + estimate.optimizer_state + estimate.gradients,
        terms=step_memory.activation_terms(plan, batch, seq, compiled.platform),
        itemsize=2 if dtype == "bfloat16" else 4,
    )


def table(rows):
    lines = [
        "| model | mesh | dtype | batch x seq | compiled peak MiB | closed form / "
        "compiled | calibrated / compiled |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['mesh']} | {r['dtype']} | {r['batch']} x "
            f"{r['seq']} | {r['peak'] / 2**20:,.1f} | "
            f"{r['closed_form'] / r['peak']:.2f} | {r['calibrated'] / r['peak']:.2f} |"
        )
    ratios = [r["calibrated"] / r["peak"] for r in rows]
    within = sum(abs(ratio - 1) <= TARGET for ratio in ratios)
    lines += [
        "",
        f"Calibrated within {TARGET:.0%} of the compiled peak: {within} of "
        f"{len(rows)} (from {min(ratios):.2f}x to {max(ratios):.2f}x).",
    ]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer cases")
    parser.add_argument("--json", default=None, help="also write JSON lines here")
    parser.add_argument(
        "--real", action="store_true", help="the ~1B real configs, LoRA and full"
    )
    args = parser.parse_args(argv)
    rows = []
    for case in real_cases() if args.real else cases(args.quick):
        rows.append(measure(*case))
        print(json.dumps(rows[-1]), flush=True, file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
