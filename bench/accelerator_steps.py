"""The training steps `python -m bench --accelerator` measures, and their
predicted peaks.

The steps are data (`STEPS`): a Gemma shape, full or LoRA training, a batch
and a sequence length, all in bfloat16 with Adam on one device. Before a run
on an accelerator, `python -m bench.accelerator --predict h200` compiles each
of them on this machine for that accelerator (the target compile, nothing
allocated) and writes `bench/predictions/h200.json`, which is committed: the
run on the device then reports its measured peak against these predictions,
made before it.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import pathlib

PREDICTIONS = pathlib.Path(__file__).resolve().parent / "predictions"

# The Gemma shapes the run builds (random bfloat16 weights), and tiny ones
# for `--tiny`.
GEMMA_7B = dict(
    vocabulary_size=256000,
    num_layers=28,
    num_query_heads=16,
    num_key_value_heads=16,
    hidden_dim=3072,
    intermediate_dim=49152,
    head_dim=256,
)
GEMMA_2B = dict(
    vocabulary_size=256000,
    num_layers=18,
    num_query_heads=8,
    num_key_value_heads=1,
    hidden_dim=2048,
    intermediate_dim=32768,
    head_dim=256,
)
TINY = dict(
    vocabulary_size=1024,
    num_layers=2,
    num_query_heads=4,
    num_key_value_heads=1,
    hidden_dim=64,
    intermediate_dim=256,
    head_dim=16,
)


@dataclasses.dataclass(frozen=True)
class Step:
    """One training step to measure on the device.

    Attributes:
        name: its label in the tables and the key of its prediction.
        shape: "7b" or "2b" (the Gemma shapes of `bench.accelerator`).
        lora_rank: 0 trains every weight; otherwise `enable_lora(rank)`.
        batch: sequences per step.
        sequence: tokens per sequence.
        steps: timed steps (the median is reported).
        warmup: steps before the timed ones (the first compiles).
        generate: new tokens for the `generate` timing; 0 skips it.
        pair: also time plain keras-hub on the same step.
        local_check: also compile the step on the device with
            `compiled_memory` before training (the local compile).
    """

    name: str
    shape: str
    lora_rank: int
    batch: int
    sequence: int
    steps: int
    warmup: int
    generate: int = 0
    pair: bool = False
    local_check: bool = False


STEPS = [
    Step("gemma_2b full 4x1024", "2b", 0, 4, 1024, 6, 2, 128, True, True),
    Step("gemma_2b lora8 4x1024", "2b", 8, 4, 1024, 4, 1),
    Step("gemma_7b full 2x1024", "7b", 0, 2, 1024, 3, 1, local_check=True),
    Step("gemma_7b lora8 4x1024", "7b", 8, 4, 1024, 3, 1),
]
TINY_STEPS = [
    Step("tiny full 2x32", "7b", 0, 2, 32, 3, 1, 16, True, True),
    Step("tiny lora8 2x32", "2b", 8, 2, 32, 2, 1),
]


def steps_of(tiny: bool) -> list[Step]:
    return TINY_STEPS if tiny else STEPS


def predict(target: str, tiny: bool = False) -> dict:
    """Compile every step for `target` on this machine; their figures.

    Args:
        target: a device profile name (`"h200"`, `"h100"`, ...).
        tiny: the tiny steps (`--tiny`).

    Returns:
        `{"target": ..., "date": ..., "steps": {name: figures}}`, where the
        figures are the target compile's peak and argument bytes, what it was
        compiled for, and the closed forms (the plan's, and the calibrated
        `step_memory.step_estimate` for the target's platform).
    """
    import time

    import keras_hub_autodist
    from keras_hub_autodist.fitting import step_memory

    shapes = {"7b": GEMMA_7B, "2b": GEMMA_2B}
    rows = {}
    for step in steps_of(tiny):
        config = TINY if tiny else shapes[step.shape]
        preset = {"class_name": "GemmaBackbone", "config": dict(config)}
        plan = keras_hub_autodist.plan(
            preset,
            {"batch": 1, "model": 1},
            dtype="bfloat16",
            lora_rank=step.lora_rank or None,
            device_memory=target,
        )
        start = time.perf_counter()
        compiled = keras_hub_autodist.compiled_memory(
            plan, step.batch, step.sequence, "adam", preset=preset, device=target
        )
        seconds = time.perf_counter() - start
        closed = plan.training_bytes_per_device(
            "adam"
        ) + plan.activation_bytes_per_device(step.batch, step.sequence)
        calibrated = step_memory.step_estimate(
            plan, step.batch, step.sequence, "adam", platform=compiled.platform
        ).total_bytes
        rows[step.name] = dict(
            target_peak_bytes=compiled.peak_bytes,
            target_argument_bytes=compiled.argument_bytes,
            compiled_for=compiled.compiled_for(),
            attention=compiled.attention,
            compile_s=seconds,
            closed_form_bytes=closed,
            calibrated_bytes=calibrated,
        )
        print(f"{step.name}: {compiled.peak_bytes / 1e9:.2f} GB", flush=True)
    return dict(target=target, date=datetime.date.today().isoformat(), steps=rows)


def write_predictions(target: str, tiny: bool = False) -> pathlib.Path:
    """`predict` and save it as `bench/predictions/<target>[-tiny].json`."""
    PREDICTIONS.mkdir(exist_ok=True)
    path = PREDICTIONS / f"{target}{'-tiny' if tiny else ''}.json"
    path.write_text(json.dumps(predict(target, tiny), indent=1) + "\n")
    return path


def read_predictions(target: str, tiny: bool = False) -> dict:
    """The committed predictions for `target`, or {} where there are none."""
    path = PREDICTIONS / f"{target}{'-tiny' if tiny else ''}.json"
    return json.loads(path.read_text())["steps"] if path.exists() else {}
