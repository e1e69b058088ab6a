"""The accelerator bench's choices for one TPU chip, checked without one:
the parts and cases a TPU runs, the steps measured there by hand, the
program memory read from the step Keras jitted, the ladder's stop rule, and
the wheels brought to the machine."""

import pathlib
import re

import numpy as np

from bench import accelerator_choices as choices
from bench import accelerator_program
from bench import accelerator_render
from bench import accelerator_runner
from bench import accelerator_steps
from bench.accelerator_training import climb

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_a_tpu_runs_splash_and_blockwise_attention_never_cudnn():
    for tiny in (False, True):
        variants = {case[0] for case in choices.attention_cases("tpu", tiny)}
        assert "cudnn" not in variants
        assert {"splash", "blockwise"} <= variants
    assert choices.attention_cases("gpu", tiny=False)[0][0] == "cudnn"
    # The splash kernel lays its head dimension in lanes of 128.
    assert choices.ATTENTION_HEADS[2] % 128 == 0
    assert choices.ATTENTION_HEADS_TINY[2] % 128 == 0


def test_a_tpu_measures_training_first_and_loads_what_fits_its_chip():
    assert choices.PARTS["tpu"][0] == "train"
    assert "long" not in choices.PARTS["tpu"]
    assert choices.LOAD_MODEL["tpu"] == "gemma_2b"  # a 7B shape does not fit
    # The parts' times and the run's stay inside one 10-minute command.
    budgets = choices.BUDGET_S["tpu"]
    assert sum(budgets[p] for p in choices.PARTS["tpu"]) <= choices.TOTAL_S["tpu"]
    assert choices.TOTAL_S["tpu"] + accelerator_runner.CHILD_GRACE_S < 600


def test_the_target_follows_the_machine():
    assert choices.target_of("tpu", "TPU v5 lite") == "v5e"
    assert choices.target_of("tpu", "TPU v6 lite") == "v6e"
    assert choices.target_of("gpu", "NVIDIA H200") == "h200"
    assert choices.target_of("cpu", "cpu") == "v5e"
    assert choices.family_of("v5e") == "tpu"
    assert accelerator_steps.steps_of("tpu", tiny=False) is accelerator_steps.TPU_STEPS


def test_the_tpu_steps_hold_the_steps_measured_on_the_chip_by_hand():
    names = {
        name
        for step in accelerator_steps.steps_of("tpu", tiny=False)
        for name in step.names()
    }
    assert {
        "gemma_2b lora8 4x1024",
        "gemma_2b lora8 8x1024",
        "gemma_2b lora8 12x1024",
        "gemma3_1b lora8 1x4096",
        "llama3.2_1b untied full 2x1024",
    } <= names
    for step in accelerator_steps.steps_of("tpu", tiny=False):
        assert step.pair and step.warmup >= 2 and step.steps >= 3
        assert list(step.batches) == sorted(step.batches)
    _, llama = accelerator_steps.model_config("llama3.2_1b", tiny=False)
    assert llama["tie_word_embeddings"] is False


def test_one_long_step_is_chosen_by_its_label_or_its_model():
    long = accelerator_steps.long_steps_of("tpu", tiny=False)
    one = accelerator_steps.chosen(long, labels=["gemma3_1b_32k"])
    assert [s.label for s in one] == ["gemma3_1b_32k"]
    gemma_2b = accelerator_steps.chosen(long, models=["gemma_2b"])
    assert [s.label for s in gemma_2b] == ["gemma_2b_32k"]
    assert accelerator_steps.chosen(long) == long
    assert accelerator_steps.chosen(long, ["gemma_2b"], ["gemma3_1b_32k"]) == []


def test_the_ladder_stops_at_the_first_refusal_or_failure():
    measured = []

    def measure(batch):
        measured.append(batch)
        return {"batch": batch, "refused": batch >= 12}

    rows = climb([4, 8, 12, 16], measure)
    assert measured == [4, 8, 12]
    assert rows[-1]["refused"]

    def failing(batch):
        return {"batch": batch, "error": ["x"]} if batch == 8 else {"batch": batch}

    assert [r["batch"] for r in climb([4, 8, 12], failing)] == [4, 8]
    assert len(climb([1, 2], lambda b: {"batch": b, "refused": False})) == 2


def test_program_memory_is_read_from_the_step_keras_jitted():
    import keras

    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(256)])
    model.compile(optimizer="adam", loss="mse")
    x = np.ones((8, 64), "float32")
    y = np.ones((8, 256), "float32")
    with accelerator_program.recording_steps() as recorded:
        model.train_on_batch(x, y)
    memory = accelerator_program.program_memory(recorded)
    weights = (64 * 256 + 256) * 4
    # The step's arguments: the weights and Adam's two moments (and its
    # counters), and the batch.
    assert memory["argument_bytes"] >= 3 * weights + x.nbytes + y.nbytes
    assert memory["argument_bytes"] == accelerator_program.argument_bytes(recorded)
    assert memory["program_bytes"] == (
        memory["temp_bytes"]
        + memory["argument_bytes"]
        + memory["output_bytes"]
        - memory["alias_bytes"]
    )
    # The state is donated: its updated copy reuses the arguments' buffers.
    assert memory["alias_bytes"] >= 3 * weights
    # Outside the recording, Keras' own jit is back.
    import keras.src.backend.jax.trainer as trainer

    assert trainer.jit.__name__ != "recording_jit"


def test_a_refused_step_is_the_bytes_its_refusal_names():
    recorded = accelerator_program.Recorded(jitted=object(), arguments=())
    import jax

    recorded.arguments = (jax.ShapeDtypeStruct((1024, 1024), np.float32),)
    temporaries = RuntimeError(
        "RESOURCE_EXHAUSTED: the total memory required for HLO temporaries "
        "(12.00G) exceeds available HBM (15.75G)"
    )
    # The figure named counts the arguments already (libtpu names a step
    # of 17 GiB of arguments and no temporary "HLO temporaries (17.00G)").
    refused = accelerator_program.refused_memory(temporaries, recorded)
    assert refused["program_bytes"] == 12 * 2**30
    assert refused["argument_bytes"] == 4 * 2**20
    whole = RuntimeError("RESOURCE_EXHAUSTED: Used 20.00G of 15.75G hbm")
    assert accelerator_program.refused_memory(whole, recorded)["program_bytes"] == (
        20 * 2**30
    )
    assert accelerator_program.refused_memory(ValueError("x"), recorded) is None


def test_a_refused_rung_is_reported_with_its_program_and_ends_the_ladder():
    results = dict(
        machine="1 x TPU v5 lite",
        date="2026-12-06",
        tiny=False,
        elapsed_s=400.0,
        target="v5e",
        loading=[],
        training=[
            dict(
                step="g lora8 4x1024",
                label="g",
                variant="autodist",
                batch=4,
                step_s=0.3,
                tokens_per_s=14000.0,
                tflops=1.0,
                first_step_s=30.0,
                program_bytes=int(14.57 * 2**30),
                peak_bytes=5.07e9,
            ),
            dict(
                step="g lora8 8x1024",
                label="g",
                variant="autodist",
                batch=8,
                refused=True,
                program_bytes=int(32.95 * 2**30),
                error=["RESOURCE_EXHAUSTED: x"],
            ),
        ],
    )
    predictions = {
        "g lora8 4x1024": {"target_peak_bytes": 14.0 * 2**30, "target_refused": False},
        "g lora8 8x1024": {"target_peak_bytes": 30.0 * 2**30, "target_refused": False},
    }
    text = accelerator_render.render(results, predictions)
    assert "| g lora8 4x1024 | autodist | yes | 14.57 GiB |" in text
    assert "| g lora8 8x1024 | autodist | no | 32.95 GiB |" in text
    assert "| g | autodist | 4 | 8 |" in text  # the largest batch, the refused
    # The memory answer is against the program's bytes, not the device peak.
    assert "| g lora8 4x1024 | yes | 15.64 GB | 15.03 GB (0.96) | fits |" in text
    # The target compile said the refused step fits: a verdict missed.
    assert "| target compile's verdict = the device's | g lora8 8x1024 | 0.000" in text


def test_a_child_past_its_time_is_stopped_and_reported():
    rows = accelerator_runner.run_child("probe", timeout=1)
    assert rows == [{"error": ["stopped at the time limit (1 s)"]}]


def test_a_child_stopped_at_its_time_keeps_its_finished_rungs():
    rows = accelerator_runner.parse_child_output(
        'WARNING noise\n{"batch": 4, "step_s": 0.3}\n{"batch": 8, "step_s": 0.6}\n'
    )
    assert [r["batch"] for r in rows] == [4, 8]


def test_presets_are_made_one_at_a_time_in_the_order_needed(monkeypatch, tmp_path):
    # Three makers at once ran the TPU machine's host memory out.
    import threading
    import time

    running, most, order = [0], [0], []
    lock = threading.Lock()

    class Maker:
        def __init__(self, argv, **kwargs):
            self.returncode = None
            self.name = argv[4]
            with lock:
                running[0] += 1
                most[0] = max(most[0], running[0])
                order.append(self.name)

        def communicate(self):
            time.sleep(0.05)
            with lock:
                running[0] -= 1
            self.returncode = 1 if self.name == "GemmaBackbone" else 0
            return "", "no such preset"

        def poll(self):
            return self.returncode

    monkeypatch.setattr(accelerator_runner.subprocess, "Popen", Maker)
    models = ["llama3.2_1b", "gemma3_1b", "gemma_2b"]
    presets = accelerator_runner.Presets(str(tmp_path), models, tiny=True)
    assert presets.path("gemma3_1b") == str(tmp_path / "gemma3_1b_shape")
    assert presets.path("gemma_2b") is None  # its maker failed
    presets.close()
    assert most[0] == 1
    assert order == [accelerator_steps.model_config(m, True)[0] for m in models]


def test_the_kit_brings_what_keras_hub_imports_for_python_3_11():
    script = (ROOT / "scripts" / "accelerator_kit.sh").read_text()
    listed = re.search(r"PACKAGES=\((.*?)\)", script, re.S).group(1)
    names = {re.split(r"[=<>]", word.strip('"'))[0] for word in listed.split()}
    assert {
        "keras",
        "keras-hub",
        "namex",
        "optree",
        "typing_extensions",
        "absl-py",
        "h5py",
        "packaging",
        "regex",
        "rich",
        "pygments",
        "markdown-it-py",
        "mdurl",
        "safetensors",
        "tokenizers",
        "sentencepiece",
    } <= names
    assert "kagglehub" not in names
    assert "PYTHON_VERSION=3.11" in script
    assert "--only-binary=:all:" in script and "--implementation cp" in script
    site = (ROOT / "scripts" / "accelerator_site.sh").read_text()
    # The run and the chip's tests install the same folder the kit fills,
    # which git ignores.
    assert "WHEELS=${WHEELS:-.whl}" in script and ".whl/*.whl" in site
    for command in (
        "accelerator_run.sh",
        "accelerator_tests.sh",
        "accelerator_answers.sh",
    ):
        text = (ROOT / "scripts" / command).read_text()
        assert "source scripts/accelerator_site.sh" in text, command
    assert ".whl/" in (ROOT / ".gitignore").read_text().split()


def test_the_committed_v5e_predictions_name_every_step_the_chip_runs():
    for tiny in (True, False):
        predicted = accelerator_steps.read_predictions("v5e", tiny)
        steps = accelerator_steps.steps_of("tpu", tiny)
        # Every rung run there (and a rung more, where it was predicted).
        assert {name for step in steps for name in step.names()} <= set(predicted)
        for figures in predicted.values():
            assert figures["compiled_for"]["device_kind"] == "TPU v5 lite"
            assert figures["target_peak_bytes"] >= figures["target_argument_bytes"] > 0


def test_fewer_parts_stretch_their_times_to_the_runs_and_no_further():
    total = choices.TOTAL_S["tpu"]
    alone = accelerator_runner.Clock("tpu", ["train"], 1.0)
    assert alone.budgets == {"train": total}
    every = accelerator_runner.Clock("tpu", choices.PARTS["tpu"], 1.0)
    assert sum(every.budgets.values()) == total
    assert every.budgets["train"] > every.budgets["load"] > every.budgets["attention"]


def test_two_runs_merge_and_what_the_second_measured_is_not_skipped():
    first = dict(
        date="d",
        tiny=False,
        parts=["train"],
        elapsed_s=440.0,
        training=[{"step": "a"}],
        skipped=["train gemma3_1b autodist"],
    )
    second = dict(
        date="d",
        tiny=False,
        parts=["train", "load"],
        elapsed_s=300.0,
        training=[{"step": "b"}],
        loading=[{"variant": "x"}],
        skipped=["load autodist dtype=None"],
    )
    merged = accelerator_render.merge([first, second])
    assert [r["step"] for r in merged["training"]] == ["a", "b"]
    assert merged["skipped"] == ["load autodist dtype=None"]
    assert [r["parts"] for r in merged["runs"]] == ["train", "train,load"]


def test_the_speed_part_alternates_the_variants_and_decides_the_speed_targets():
    from bench import accelerator_targets

    order = accelerator_runner.speed_order(accelerator_steps.SPEED_ROUNDS)
    assert order[:4] == [
        (0, "keras-hub"),
        (0, "autodist"),
        (1, "autodist"),
        (1, "keras-hub"),
    ]
    assert "speed" in choices.ALL_PARTS and "speed" not in choices.PARTS["tpu"]
    named = {s.name(b) for s in accelerator_steps.TPU_SPEED_STEPS for b in s.batches}
    # The four steps of the kernel's speed targets, keras-hub beside.
    assert named == {
        "gemma_2b lora8 4x1024",
        "gemma3_1b lora8 1x4096",
        "llama3.2_1b untied full 2x1024",
        "qwen2.5_0.5b full 4x1024",
    }

    def row(variant, tokens, **more):
        return dict(
            step="s",
            variant=variant,
            tokens_per_s=tokens,
            fit_tokens_per_s=tokens,
            **more,
        )

    # The ladder's one process each says 0.98; the alternated ones 1.0.
    results = dict(
        loading=[],
        training=[row("keras-hub", 100.0), row("autodist", 98.0)],
        speed=[
            row("keras-hub", 100.0, round=0),
            row("autodist", 99.0, round=0),
            row("autodist", 101.0, round=1),
            row("keras-hub", 100.0, round=1),
        ],
    )
    speed = {
        target: ratio
        for target, _, ratio, _ in accelerator_targets.verdicts(results, {})
        if "tokens/s" in target
    }
    assert speed == {
        "autodist's training tokens/s / keras-hub's": 1.0,
        "autodist's `fit` tokens/s / keras-hub's": 1.0,
    }
    results["speed"] = []
    ladder = [
        v for v in accelerator_targets.verdicts(results, {}) if "tokens/s" in v[0]
    ]
    assert [round(v[2], 2) for v in ladder] == [0.98, 0.98]
