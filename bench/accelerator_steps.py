"""The models and training steps `python -m bench --accelerator` measures,
and their predicted memory.

The steps are data (`STEPS`, per accelerator family): a model shape, full or
LoRA training, a ladder of batch sizes at one sequence length, all in
bfloat16 with Adam on one device. Before a run on an accelerator,
`python -m bench --accelerator --predict v5e` compiles each rung of each
step on this machine for that accelerator (the target compile, nothing
allocated) and writes `bench/predictions/v5e.json`, which is committed: the
run on the device then reports what it measured against these predictions,
made before it.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import pathlib

PREDICTIONS = pathlib.Path(__file__).resolve().parent / "predictions"

# The model shapes the run builds (random bfloat16 weights): backbone class
# and config.
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
# Gemma 3 1B's text model (keras-hub's conversion of its Hugging Face config).
GEMMA3_1B = dict(
    vocabulary_size=262144,
    image_size=None,
    vision_encoder=None,
    num_layers=26,
    num_query_heads=4,
    num_key_value_heads=1,
    hidden_dim=1152,
    intermediate_dim=6912,
    head_dim=256,
    use_post_ffw_norm=True,
    use_post_attention_norm=True,
    use_sliding_window_attention=True,
    query_head_dim_normalize=True,
    sliding_window_size=512,
    use_query_key_norm=True,
    layer_norm_epsilon=1e-6,
)
# Llama 3.2 1B's shape with its own output embedding (1.5B parameters):
# keras-hub 0.32 saves a tied `Llama3Backbone` that it can't load back.
LLAMA32_1B_UNTIED = dict(
    vocabulary_size=128256,
    num_layers=16,
    num_query_heads=32,
    num_key_value_heads=8,
    hidden_dim=2048,
    intermediate_dim=8192,
    tie_word_embeddings=False,
    rope_max_wavelength=500000.0,
)
# Qwen 2.5 0.5B (heads of 64, its output embedding tied to its input one).
QWEN25_05B = dict(
    vocabulary_size=151936,
    num_layers=24,
    num_query_heads=14,
    num_key_value_heads=2,
    hidden_dim=896,
    intermediate_dim=4864,
    rope_max_wavelength=1000000.0,
    layer_norm_epsilon=1e-6,
    tie_word_embeddings=True,
)
# Phi-3 mini (3.8B parameters; heads of 96).
PHI3_MINI = dict(
    vocabulary_size=32064,
    num_layers=32,
    num_query_heads=32,
    num_key_value_heads=32,
    hidden_dim=3072,
    intermediate_dim=8192,
    layer_norm_epsilon=1e-5,
    max_sequence_length=4096,
)
# Gemma 2 2B (keras-hub's conversion of its Hugging Face config): soft caps
# on the attention's scores and on the logits, sliding windows every other
# layer.
GEMMA2_2B = dict(
    vocabulary_size=256000,
    num_layers=26,
    num_query_heads=8,
    num_key_value_heads=4,
    hidden_dim=2304,
    intermediate_dim=18432,
    head_dim=256,
    query_head_dim_normalize=True,
    use_post_ffw_norm=True,
    use_post_attention_norm=True,
    final_logit_soft_cap=30.0,
    attention_logit_soft_cap=50.0,
    use_sliding_window_attention=True,
    sliding_window_size=4096,
    layer_norm_epsilon=1e-6,
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
TINY_GEMMA3 = dict(
    GEMMA3_1B,
    vocabulary_size=1024,
    num_layers=2,
    hidden_dim=64,
    intermediate_dim=128,
    head_dim=16,
    sliding_window_size=16,
)
TINY_LLAMA = dict(
    LLAMA32_1B_UNTIED,
    vocabulary_size=1024,
    num_layers=2,
    num_query_heads=4,
    num_key_value_heads=2,
    hidden_dim=64,
    intermediate_dim=128,
)
TINY_QWEN = dict(
    QWEN25_05B,
    vocabulary_size=1024,
    num_layers=2,
    num_query_heads=2,
    num_key_value_heads=1,
    hidden_dim=128,
    intermediate_dim=256,
)
TINY_PHI3 = dict(
    PHI3_MINI,
    vocabulary_size=1024,
    num_layers=2,
    num_query_heads=2,
    num_key_value_heads=2,
    hidden_dim=192,
    intermediate_dim=256,
)
TINY_GEMMA2 = dict(
    GEMMA2_2B,
    vocabulary_size=1024,
    num_layers=2,
    hidden_dim=64,
    intermediate_dim=128,
    head_dim=16,
    sliding_window_size=16,
)
# model -> (backbone class, full config, tiny config).
MODELS = {
    "gemma_7b": ("GemmaBackbone", GEMMA_7B, TINY),
    "gemma_2b": ("GemmaBackbone", GEMMA_2B, TINY),
    "gemma2_2b": ("GemmaBackbone", GEMMA2_2B, TINY_GEMMA2),
    "gemma3_1b": ("Gemma3Backbone", GEMMA3_1B, TINY_GEMMA3),
    "llama3.2_1b": ("Llama3Backbone", LLAMA32_1B_UNTIED, TINY_LLAMA),
    "qwen2.5_0.5b": ("QwenBackbone", QWEN25_05B, TINY_QWEN),
    "phi3_mini": ("Phi3Backbone", PHI3_MINI, TINY_PHI3),
}


def model_config(model: str, tiny: bool) -> tuple[str, dict]:
    """`(backbone class name, config)` of `model` (a key of `MODELS`).

    Example:
    >>> model_config("gemma3_1b", tiny=True)[0]
    'Gemma3Backbone'
    """
    class_name, full, small = MODELS[model]
    return class_name, dict(small if tiny else full)


@dataclasses.dataclass(frozen=True)
class Step:
    """One training step to measure on the device, at one or more batches.

    Attributes:
        label: the model's name in the tables ("gemma_2b", "tiny", ...).
        model: a key of `MODELS`: the shape built.
        lora_rank: 0 trains every weight; otherwise `enable_lora(rank)`.
        batches: the ladder of sequences per step, smallest first: each is
            measured in turn, and the first the device refuses ends it.
        sequence: tokens per sequence.
        steps: timed steps per batch (the median is reported).
        warmup: steps before the timed ones (the first compiles).
        generate: new tokens for the `generate` timing; 0 skips it.
        pair: also time plain keras-hub on the same ladder.
        local_check: also compile the step on the device with
            `compiled_memory` before training (the local compile).
        remat: autodist's `from_preset(..., remat=...)` ("" for none);
            keras-hub has no such argument.
        against_xla: also train autodist with its layers' own (XLA's)
            attention, the per-device kernel turned off ("autodist-xla").
    """

    label: str
    model: str
    lora_rank: int
    batches: tuple[int, ...]
    sequence: int
    steps: int
    warmup: int
    generate: int = 0
    pair: bool = False
    local_check: bool = False
    remat: str = ""
    against_xla: bool = False

    def name(self, batch: int) -> str:
        """The rung's name in the tables and in the predictions.

        Example:
        >>> Step("gemma_2b", "gemma_2b", 8, (4, 8), 1024, 3, 2).name(8)
        'gemma_2b lora8 8x1024'
        """
        kind = f"lora{self.lora_rank}" if self.lora_rank else "full"
        remat = f" remat {self.remat}" if self.remat else ""
        return f"{self.label} {kind} {batch}x{self.sequence}{remat}"

    def names(self) -> list[str]:
        return [self.name(batch) for batch in self.batches]


# One H200 (143 GB): the Gemma 2B and 7B shapes, full and LoRA.
GPU_STEPS = [
    Step("gemma_2b", "gemma_2b", 0, (4,), 1024, 6, 2, 128, True, True),
    Step("gemma_2b", "gemma_2b", 8, (4,), 1024, 4, 1),
    Step("gemma_7b", "gemma_7b", 0, (2,), 1024, 3, 1, local_check=True),
    Step("gemma_7b", "gemma_7b", 8, (4,), 1024, 3, 1),
]
GPU_TINY_STEPS = [
    Step("tiny", "gemma_7b", 0, (2,), 32, 3, 1, 16, True, True),
    Step("tiny", "gemma_2b", 8, (2,), 32, 2, 1),
]
# One TPU v5e chip (15.75 GiB for a program): the steps measured there by
# hand, keras-hub beside autodist, two warm-ups before five timed steps and
# a `fit` of five. The Gemma 2B LoRA ladder finds the largest batch of 1024
# tokens that runs (keras-hub: 4 and 8 ran, 12 was refused); the other two
# are the largest steps that ran there (one rung more, refused there, would
# cost a compile each).
TPU_STEPS = [
    Step("gemma_2b", "gemma_2b", 8, (4, 8, 12), 1024, 5, 2, pair=True),
    Step("gemma3_1b", "gemma3_1b", 8, (1,), 4096, 5, 2, pair=True),
    Step("llama3.2_1b untied", "llama3.2_1b", 0, (2,), 1024, 5, 2, pair=True),
]
# Long sequences on the one chip (the part `long`): splash on the
# one-device mesh and the loss a chunk of tokens at a time, each decoder
# block recomputed where the sequence is longest. keras-hub was refused at
# 8192 tokens of Gemma 3 1B (30.68 GiB) and of the Gemma 2B shape (27.32).
# The families with heads of 64 and 96 (splash with its head dimension
# padded to lanes of 128): Llama 3.2 1B and Qwen 2.5 0.5B at 32k tokens,
# where XLA's attention was refused at 16k; Phi-3 mini at 4 x 4096; and
# Qwen 2.5 0.5B at 4 x 4096, with the kernel and with XLA's attention.
TPU_LONG_STEPS = [
    Step("llama3.2_1b_32k", "llama3.2_1b", 8, (1,), 32768, 2, 1, remat="full"),
    Step("qwen2.5_0.5b_32k", "qwen2.5_0.5b", 0, (1,), 32768, 2, 1, remat="full"),
    Step("phi3_mini_4x4k", "phi3_mini", 8, (4,), 4096, 2, 1, remat="full"),
    Step(
        "qwen2.5_0.5b_4x4k",
        "qwen2.5_0.5b",
        0,
        (4,),
        4096,
        5,
        2,
        remat="full",
        against_xla=True,
    ),
    Step("gemma2_2b_16k", "gemma2_2b", 8, (1,), 16384, 2, 1, remat="full"),
    Step("gemma3_1b_64k", "gemma3_1b", 8, (1,), 65536, 2, 1, remat="full"),
    Step("gemma_2b_32k", "gemma_2b", 8, (1,), 32768, 2, 1, remat="full"),
    Step("gemma3_1b_32k", "gemma3_1b", 8, (1,), 32768, 2, 1, remat="full"),
    Step("gemma3_1b_8k", "gemma3_1b", 8, (1,), 8192, 3, 1),
]
TPU_TINY_STEPS = [
    Step("tiny gemma", "gemma_2b", 8, (2, 4), 32, 2, 2, pair=True),
    Step("tiny gemma3", "gemma3_1b", 8, (1,), 64, 2, 2, pair=True),
    Step("tiny llama", "llama3.2_1b", 0, (2,), 32, 2, 2, pair=True),
]
STEPS = {"gpu": (GPU_STEPS, GPU_TINY_STEPS), "tpu": (TPU_STEPS, TPU_TINY_STEPS)}
# The part `speed`: autodist's tokens/s against keras-hub's, each variant in
# `SPEED_ROUNDS` fresh processes alternated (keras-hub, autodist, then
# autodist, keras-hub), so that the ratio is of two medians over processes
# and the order cancels. The speed targets are half a percent; one process
# each, with five steps, moved by as much between two runs (0.995 and 0.998
# for the same Gemma 2B step).
SPEED_ROUNDS = 2
TPU_SPEED_STEPS = [
    Step("gemma_2b", "gemma_2b", 8, (4,), 1024, 12, 2, pair=True),
    Step("gemma3_1b", "gemma3_1b", 8, (1,), 4096, 12, 2, pair=True),
    Step("llama3.2_1b untied", "llama3.2_1b", 0, (2,), 1024, 12, 2, pair=True),
    Step("qwen2.5_0.5b", "qwen2.5_0.5b", 0, (4,), 1024, 12, 2, pair=True),
]
TPU_TINY_SPEED_STEPS = [Step("tiny llama", "llama3.2_1b", 0, (2,), 32, 3, 1, pair=True)]
SPEED_STEPS = {"tpu": (TPU_SPEED_STEPS, TPU_TINY_SPEED_STEPS)}
# The part `chunks` (`accelerator_chunks`): one process per batch, each
# timing every chunk rule; Gemma's 256k vocabulary is where the chunks'
# size matters.
TPU_CHUNK_STEPS = [Step("gemma_2b", "gemma_2b", 8, (4, 8), 1024, 6, 1)]
TPU_TINY_CHUNK_STEPS = [Step("tiny gemma", "gemma_2b", 8, (2,), 32, 2, 1)]
CHUNK_STEPS = {"tpu": (TPU_CHUNK_STEPS, TPU_TINY_CHUNK_STEPS)}
# The part `search`: the configuration the layout search chooses for one
# chip (`plan --device v5e --devices 1 --per-device-batch 1:16 --search`,
# docs/benchmarks.md section 9) beside keras-hub's best runnable batch (the
# largest it runs without remat), on one ladder per model: keras-hub stops
# at the first batch the chip refuses it, autodist goes on to the chosen
# one. Llama 3.2 1B full: keras-hub ran 2 x 1,024 and was refused at 4, the
# search chose 8; Gemma 2 2B LoRA 8: the search chose 2 x 2,048 (4 as
# fast by its model); Qwen 2.5 0.5B full: keras-hub was refused at 8 x
# 1,024, the search chose 16. Each ladder starts at keras-hub's best
# runnable batch: a real-shape rung costs 30-60 s of a command's 10
# minutes (Gemma 2: keras-hub ran 2 x 2,048 and was refused at 4).
TPU_SEARCH_STEPS = [
    Step("llama3.2_1b searched", "llama3.2_1b", 0, (2, 8), 1024, 5, 2, pair=True),
    Step("gemma2_2b searched", "gemma2_2b", 8, (2, 4), 2048, 5, 2, pair=True),
    Step("qwen2.5_0.5b searched", "qwen2.5_0.5b", 0, (4, 8, 16), 1024, 5, 2, pair=True),
]
SEARCH_STEPS = {"tpu": TPU_SEARCH_STEPS}
# The part `long` of a family measured as training steps (a GPU's is
# `accelerator_children.child_long`'s, Gemma 2B at 32k tokens).
LONG_STEPS = {"tpu": TPU_LONG_STEPS}


def chosen(steps: list[Step], models=None, labels=None) -> list[Step]:
    """The `steps` of `models` (keys of `MODELS`) and `labels` alone; None
    keeps every one.

    Example:
    >>> [s.label for s in chosen(TPU_LONG_STEPS, labels=["gemma_2b_32k"])]
    ['gemma_2b_32k']
    >>> [s.label for s in chosen(TPU_LONG_STEPS, models=["gemma_2b"])]
    ['gemma_2b_32k']
    """
    return [
        step
        for step in steps
        if (models is None or step.model in models)
        and (labels is None or step.label in labels)
    ]


def steps_of(family: str, tiny: bool) -> list[Step]:
    """The steps measured for an accelerator `family` ("gpu" or "tpu")."""
    full, small = STEPS[family]
    return small if tiny else full


def speed_steps_of(family: str, tiny: bool) -> list[Step]:
    """The steps of the part `speed` for `family` ([] where it has none)."""
    full, small = SPEED_STEPS.get(family, ([], []))
    return small if tiny else full


def chunk_steps_of(family: str, tiny: bool) -> list[Step]:
    """The steps of the part `chunks` for `family` ([] where it has none)."""
    full, small = CHUNK_STEPS.get(family, ([], []))
    return small if tiny else full


def search_steps_of(family: str, tiny: bool) -> list[Step]:
    """The steps of the part `search` for `family` ([] where it has none,
    or for the tiny run)."""
    return [] if tiny else SEARCH_STEPS.get(family, [])


def long_steps_of(family: str, tiny: bool) -> list[Step]:
    """The training steps of the part `long` for `family` ([] where that
    part is measured otherwise, or for the tiny run)."""
    return [] if tiny else LONG_STEPS.get(family, [])


def predict(target: str, tiny: bool = False, labels=None) -> dict:
    """Compile every rung of every step for `target` on this machine.

    Args:
        target: a device profile name (`"v5e"`, `"h200"`, ...).
        tiny: the tiny steps (`--tiny`).
        labels: the labels of the steps compiled (`chosen`); None: all.

    Returns:
        `{"target": ..., "date": ..., "steps": {name: figures}}`, where the
        figures are the target compile's peak and argument bytes, whether it
        refused the step as too large, what it was compiled for, and the
        closed forms (the plan's, and the calibrated
        `step_memory.step_estimate` for the target's platform).
    """
    import time

    import keras_hub_autodist
    from keras_hub_autodist.fitting import step_memory
    from keras_hub_autodist.fitting import verdicts
    from keras_hub_autodist.fitting.compile_targets import target_spec

    rows = {}
    family = target_spec(target).platform
    steps = (
        steps_of(family, tiny)
        + long_steps_of(family, tiny)
        + search_steps_of(family, tiny)
    )
    for step in chosen(steps, labels=labels):
        class_name, config = model_config(step.model, tiny)
        preset = {"class_name": class_name, "config": config}
        plan = keras_hub_autodist.plan(
            preset,
            {"batch": 1, "model": 1},
            dtype="bfloat16",
            lora_rank=step.lora_rank or None,
            device_memory=target,
            remat=step.remat or None,
        )
        for batch in step.batches:
            start = time.perf_counter()
            compiled = keras_hub_autodist.compiled_memory(
                plan, batch, step.sequence, "adam", preset=preset, device=target
            )
            seconds = time.perf_counter() - start
            closed = plan.training_bytes_per_device(
                "adam"
            ) + plan.activation_bytes_per_device(batch, step.sequence)
            calibrated = step_memory.step_estimate(
                plan, batch, step.sequence, "adam", platform=compiled.platform
            ).total_bytes
            verdict = verdicts.step_verdict(
                plan, batch, step.sequence, "adam", platform=target
            )
            rows[step.name(batch)] = dict(
                target_peak_bytes=compiled.peak_bytes,
                # The chip's `program_bytes`' measure: the parts' sum.
                target_program_bytes=compiled.parts_bytes,
                target_argument_bytes=compiled.argument_bytes,
                target_refused=bool(compiled.out_of_memory),
                compiled_for=compiled.compiled_for(),
                attention=compiled.attention,
                compile_s=seconds,
                closed_form_bytes=closed,
                calibrated_bytes=calibrated,
                closed_form_verdict=verdict.answer,
            )
            print(
                f"{step.name(batch)}: {compiled.peak_bytes / 1e9:.2f} GB"
                f"{' (refused)' if compiled.out_of_memory else ''}",
                flush=True,
            )
    return dict(target=target, date=datetime.date.today().isoformat(), steps=rows)


def write_predictions(target: str, tiny: bool = False, labels=None) -> pathlib.Path:
    """`predict` and save it as `bench/predictions/<target>[-tiny].json`;
    with `labels`, those steps' predictions replace theirs in the saved
    ones and the others stay."""
    PREDICTIONS.mkdir(exist_ok=True)
    path = PREDICTIONS / f"{target}{'-tiny' if tiny else ''}.json"
    predicted = predict(target, tiny, labels)
    if labels is not None and path.exists():
        saved = json.loads(path.read_text())
        predicted["steps"] = {**saved["steps"], **predicted["steps"]}
    path.write_text(json.dumps(predicted, indent=1) + "\n")
    return path


def read_predictions(target: str, tiny: bool = False) -> dict:
    """The committed predictions for `target`, or {} where there are none."""
    path = PREDICTIONS / f"{target}{'-tiny' if tiny else ''}.json"
    return json.loads(path.read_text())["steps"] if path.exists() else {}
