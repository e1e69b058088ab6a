"""The one memory answer: LoRA-aware, per named device, one verdict
(`fits == estimate <= memory`) in the plan, the summary, the advice and the
CLI's `--json`."""

import dataclasses
import json
import math

import keras
import pytest
from real_presets import REAL_PRESETS

import keras_hub_autodist
from keras_hub_autodist import PlanError
from keras_hub_autodist import cli
from keras_hub_autodist.fitting import compile_arguments
from keras_hub_autodist.fitting import report
from keras_hub_autodist.fitting import step_memory
from keras_hub_autodist.fitting import trained_state
from keras_hub_autodist.fitting import verdicts
from keras_hub_autodist.fitting.device_profiles import DEVICE_PROFILES
from keras_hub_autodist.fitting.device_profiles import GIB

GEMMA_7B = str(REAL_PRESETS / "gemma_7b")
SHARED = ["--mesh", "batch=1,model=2", "--dtype", "bfloat16", "--batch", "1"]
SHARED += ["--seq", "256"]


def _json(capfd, args):
    """The exit status and the one JSON object `plan --json` prints."""
    capfd.readouterr()
    status = cli.main(["plan", *args, "--json"])
    out = capfd.readouterr().out
    lines = out.strip().splitlines()
    assert len(lines) == 1, out  # one object, nothing else
    return status, json.loads(lines[0])


@pytest.mark.parametrize("lora, fits", [(["--lora-rank", "4"], True), ([], False)])
def test_the_shared_case_on_two_t4s(capfd, lora, fits):
    # Gemma 7B bf16 on 2 devices of 16 GiB, 1 x 256 tokens: the weights
    # (7.95 GiB per device) fit, Adam on all of them does not; LoRA does.
    status, answer = _json(capfd, [GEMMA_7B, *SHARED, "--device-memory", "16", *lora])
    assert status == 0  # the answer is data, whether it fits or not
    assert answer["fits"] is fits
    assert answer["fits"] == (
        answer["estimate_bytes_per_device"] <= answer["device_memory_bytes"]
    )
    assert answer["device_memory_bytes"] == 16 * GIB
    assert answer["lora_rank"] == (4 if lora else None)
    assert answer["mesh"] == {"batch": 1, "model": 2}
    assert answer["strategy"] == "tp" and answer["remat"] is None
    assert answer["estimate_covers"] == "training step"
    assert answer["estimate_parts"]["activations"] > 0
    if not fits:
        # The cheapest fix first, named as this command's flag.
        assert "`--lora-rank 4`" in answer["advice"][0]


def test_json_names_the_device_and_answers_without_a_batch(capfd):
    status, answer = _json(
        capfd, [GEMMA_7B, "--mesh", "batch=1,model=8", "--device", "v3-8"]
    )
    assert status == 0
    assert answer["device"] == "v3-8" and answer["platform"] == "tpu"
    assert answer["device_memory_bytes"] == DEVICE_PROFILES["v3-8"].memory_bytes
    # No batch: the weights, gradients and Adam state alone.
    assert answer["estimate_covers"] == "weights and optimizer state"
    assert answer["estimate_parts"]["activations"] == 0
    assert answer["fits"] == (
        answer["estimate_bytes_per_device"] <= answer["device_memory_bytes"]
    )


def test_lora_trains_only_the_query_and_value_adapters():
    plan = keras_hub_autodist.plan(GEMMA_7B, {"batch": 1, "model": 2})
    lora = keras_hub_autodist.plan(GEMMA_7B, {"batch": 1, "model": 2}, lora_rank=4)
    # gemma_7b: 28 blocks; query and value kernels (16 heads, 3072, 256):
    # A (16, 3072, 4) and B (4, 256) each, in float32 (Keras makes them so),
    # A split over the model axis as the kernel's heads are.
    whole = 28 * 2 * 4 * (16 * 3072 + 256)
    assert trained_state.lora_parameters(lora.rows, 4) == whole
    adapters = 28 * 2 * 4 * (8 * 3072 + 256) * 4  # float32 bytes per device
    assert trained_state.lora_parameters(lora.rows, 4, lora.mesh_axes) * 4 == adapters
    weights = plan.max_device_bytes
    assert plan.training_bytes_per_device("adam") == 4 * weights
    # The frozen weights: no gradient, no moments; the adapters all three.
    assert lora.training_bytes_per_device("adam") == weights + 4 * adapters
    assert lora.training_bytes_per_device("sgd") == weights + 2 * adapters
    estimate = step_memory.step_estimate(lora, 1, 256)
    assert estimate.gradients == adapters
    assert estimate.optimizer_state == 2 * adapters
    # The activations are the same model's, LoRA or not.
    assert estimate.activations == step_memory.step_estimate(plan, 1, 256).activations


def test_quantized_weights_are_frozen():
    plan = keras_hub_autodist.plan(GEMMA_7B, {"batch": 1, "model": 2})
    kernels = [row for row in plan.rows if row.path.endswith("/kernel")]
    rows = [
        dataclasses.replace(row, dtype="int8") if row in kernels else row
        for row in plan.rows
    ]
    frozen = sum(row.device_bytes for row in rows if row.dtype == "int8")
    quantized = plan.replace(rows=tuple(rows))
    estimate = step_memory.step_estimate(quantized, None, None)
    assert estimate.gradients == quantized.max_device_bytes - frozen
    assert estimate.optimizer_state == 2 * estimate.gradients


@pytest.mark.parametrize("name", sorted(DEVICE_PROFILES))
def test_named_devices(name):
    plan = keras_hub_autodist.plan(
        str(REAL_PRESETS / "gemma_2b"), {"batch": 1, "model": 1}, device_memory=name
    )
    assert plan.device_memory_bytes == DEVICE_PROFILES[name].memory_bytes
    assert plan.device_name == name
    assert name in plan.summary()


def test_an_unknown_device_is_refused():
    with pytest.raises(PlanError, match=r"Unknown device 'k80'.*Received"):
        keras_hub_autodist.plan(
            str(REAL_PRESETS / "gemma_2b"), {"batch": 1}, device_memory="k80"
        )


@pytest.mark.parametrize(
    "preset, mesh, memory, lora",
    [
        ("gemma_7b", {"batch": 1, "model": 2}, 16, None),
        ("gemma_7b", {"batch": 1, "model": 2}, 16, 4),
        ("gemma_2b", {"batch": 2, "model": 4}, 16, None),
        ("llama3_8b", {"batch": 4, "model": 2}, 24, 8),
        ("mixtral_8x7b", {"batch": 1, "model": 8}, 80, None),
    ],
)
@pytest.mark.parametrize("step", [None, (8, 1024)])
def test_every_answer_is_one_verdict(preset, mesh, memory, lora, step):
    plan = keras_hub_autodist.plan(
        str(REAL_PRESETS / preset), mesh, device_memory=memory * GIB, lora_rank=lora
    )
    batch, seq = step or (None, None)
    fits, estimate, line = report.memory_verdict(plan, batch, seq)
    verdict = verdicts.step_verdict(plan, batch, seq)
    assert fits is verdict.fits
    assert line.startswith(f"fits: {verdict.answer},")
    if fits is not None:
        assert fits == (estimate.total_bytes <= plan.device_memory_bytes)
    if step is None:
        assert fits == plan.fits
        assert "no activations" in line
        assert line in plan.summary()


def test_advice_names_only_what_fits_in_order_of_cost():
    # Full fine-tuning of Gemma 7B bf16 on 2 x 4 devices of 16 GiB: LoRA
    # fits. fsdp over the batch axis of 4 splits the state but gathers each
    # layer's weights for the step (19.8 GiB): it is not advised.
    plan = keras_hub_autodist.plan(
        GEMMA_7B, {"batch": 4, "model": 2}, dtype="bfloat16", strategy="tp"
    )
    advice = plan.fit_advice(4, 256)
    assert "LoRA" in advice[0]
    assert not any("fsdp" in line for line in advice)
    fsdp = keras_hub_autodist.plan(
        GEMMA_7B, {"batch": 4, "model": 2}, dtype="bfloat16", strategy="fsdp"
    )
    # Not yes: within the estimate's margins of the 16 GiB (maybe).
    assert report.memory_verdict(fsdp, 4, 256)[0] is not True
    assert not any("devices on the" in line for line in advice)
    # On one device even the bf16 weights (16 GiB) do not fit: more devices.
    alone = keras_hub_autodist.plan(
        GEMMA_7B, {"batch": 1, "model": 1}, dtype="bfloat16"
    )
    advice = alone.fit_advice(1, 256)
    assert "nothing fits on these 1 devices" in advice[0]
    assert not any("LoRA" in line or "fsdp" in line for line in advice)
    # A batch too big for LoRA alone: a smaller one, named; within the
    # estimate's margins of the devices, one to settle by compiling.
    lora = plan.replace(lora_rank=4)
    advice = lora.fit_advice(64, 1024)
    assert any(line.startswith("a batch of 8 sequences may fit") for line in advice)
    assert verdicts.step_verdict(lora, 8, 1024).answer == verdicts.MAYBE
    fits, _, _ = report.memory_verdict(lora, 64, 1024)
    assert not fits
    # At 4096 tokens even one sequence per device is too much (a batch
    # smaller than the batch axis is padded to it): shorter sequences.
    advice = lora.fit_advice(64, 4096)
    assert not any(line.startswith("a smaller batch") for line in advice)
    assert any(line.startswith("shorter sequences") for line in advice)


def test_one_optimizer_table():
    assert compile_arguments.OPTIMIZERS is trained_state.OPTIMIZERS
    parser = cli.build_parser()
    plan = parser._subparsers._group_actions[0].choices["plan"]
    (action,) = [a for a in plan._actions if a.dest == "optimizer"]
    assert list(action.choices) == list(trained_state.OPTIMIZERS)


def test_compiled_lora_step_trains_only_the_adapters(tiny_presets_dir):
    devices = keras.distribution.list_devices()[:8]
    mesh = keras.distribution.DeviceMesh((2, 4), ("batch", "model"), devices)
    full = keras_hub_autodist.plan(tiny_presets_dir["gemma_mqa"], mesh)
    lora = full.replace(lora_rank=2)
    full_memory = keras_hub_autodist.compiled_memory(full, 8, 16)
    lora_memory = keras_hub_autodist.compiled_memory(lora, 8, 16)
    # Arguments: weights (+ the adapters) and Adam's moments of the
    # adapters only, against the moments of every weight.
    adapters = trained_state.lora_parameters(lora.rows, 2) * 4
    saved = 2 * full.max_device_bytes - 3 * adapters
    assert lora_memory.argument_bytes <= full_memory.argument_bytes - saved + 1024
    assert math.isfinite(lora_memory.peak_bytes)


def test_remat_lowers_the_estimate(tiny_presets_dir):
    plan = keras_hub_autodist.plan(
        tiny_presets_dir["gemma_mqa"], {"batch": 2, "model": 4}
    )
    remat = plan.replace(remat="full")
    assert step_memory.activation_bytes(remat, 8, 64, "cpu") < (
        step_memory.activation_bytes(plan, 8, 64, "cpu")
    )
    # Only whole blocks' activations go; the logits stay.
    listed = plan.replace(remat={"mode": "list_of_layers", "layer_names": ["x"]})
    assert step_memory.activation_bytes(listed, 8, 64, "cpu") == (
        step_memory.activation_bytes(plan, 8, 64, "cpu")
    )


def test_from_preset_builds_inside_the_remat_scope(tiny_presets_dir, monkeypatch):
    import keras_hub

    modes = []
    original = keras.RematScope.__enter__

    def enter(scope):
        modes.append(scope.mode)
        return original(scope)

    monkeypatch.setattr(keras.RematScope, "__enter__", enter)
    layers = {"mode": "list_of_layers", "layer_names": ["ffw_linear"]}
    model = keras_hub_autodist.from_preset(
        keras_hub.models.GemmaCausalLM,
        tiny_presets_dir["gemma_mqa"],
        device_mesh={"batch": 2, "model": 4},
        remat=layers,
    )
    assert modes == ["list_of_layers"]
    assert model is not None
    # "full" is this package's own, block by block (tests/test_remat.py).
    keras_hub_autodist.from_preset(
        keras_hub.models.GemmaCausalLM,
        tiny_presets_dir["gemma_mqa"],
        device_mesh={"batch": 2, "model": 4},
        remat="full",
    )
    assert modes == ["list_of_layers"]
    with pytest.raises(PlanError, match="Received: remat='most'"):
        keras_hub_autodist.plan(
            tiny_presets_dir["gemma_mqa"], {"batch": 2}, remat="most"
        )
