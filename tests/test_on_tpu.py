"""On a real TPU chip (`pytest -m tpu`; skipped elsewhere): a load
straight into shards, a training step whose loss is keras-hub's, its
attention in the splash kernel with padding per row, and the target
compile's memory against the chip's own compile of the same step, and the
command's default answer (`plan --device v5e`, which compiles where the TPU
compiler is) on the steps of real shapes measured on the chip.

Run on the machine with `bash scripts/accelerator_tests.sh` (the kit of
`scripts/accelerator_kit.sh` carried along): every time a device path
changes (attention, loss, loading, the trainer's steps). A small Gemma 3
of real head size (128, which splash lays in lanes) at 8,192 tokens, where
XLA's attention still runs for keras-hub; in float32, so that the loss of
splash and of XLA's attention agree to 1e-3.
"""

import contextlib
import json
import os
import pathlib
import subprocess
import sys

import jax
import keras
import keras_hub
import numpy as np
import pytest
import soft_capped_steps
import tiny_presets
from chip_steps import CHIP_STEPS
from chip_steps import chip_preset_folder
from chip_steps import chip_step_id

import keras_hub_autodist
from keras_hub_autodist import cli

pytestmark = [
    pytest.mark.tpu,
    pytest.mark.skipif(jax.devices()[0].platform != "tpu", reason="needs a TPU chip"),
]

# The tests that compare with a v5e's figures: the committed target and
# the steps measured on the chip.
ON_A_V5E = pytest.mark.skipif(
    "v5" not in jax.devices()[0].device_kind.lower(),
    reason="compares with figures of a TPU v5e",
)
SEQUENCE = 8192
ONE_DEVICE = {"batch": 1, "model": 1}
CONFIG = dict(
    tiny_presets.GEMMA3_TEXT,
    vocabulary_size=4096,
    num_layers=2,
    num_query_heads=2,
    num_key_value_heads=1,
    hidden_dim=512,
    intermediate_dim=1024,
    head_dim=128,
    sliding_window_size=1024,
)


@pytest.fixture(scope="module")
def preset(tmp_path_factory):
    return tiny_presets.save_preset(
        tmp_path_factory.mktemp("tpu") / "gemma3",
        keras_hub.models.Gemma3Backbone,
        CONFIG,
        task_class=keras_hub.models.Gemma3CausalLM,
    )


def _batch():
    rng = np.random.default_rng(0)
    ids = rng.integers(1, CONFIG["vocabulary_size"], (2, SEQUENCE)).astype("int32")
    padding = np.ones_like(ids)
    padding[0, :100] = 0  # left padding: its first queries have no key
    padding[1, SEQUENCE - 3000 :] = 0  # right padding
    return {"token_ids": ids, "padding_mask": padding}, np.roll(ids, -1, 1), padding


def _trained(preset, **kwargs):
    from bench import accelerator_program

    lm = keras_hub.models.Gemma3CausalLM.from_preset(
        preset, preprocessor=None, dtype="float32", **kwargs
    )
    lm.compile(optimizer=keras.optimizers.Adam(1e-3))
    x, y, padding = _batch()
    with accelerator_program.recording_steps() as recorded:
        logs = lm.train_on_batch(x, y, padding.astype("float32"), return_dict=True)
        program = accelerator_program.program_memory(recorded)
    return lm, float(logs["loss"]), program


def test_a_load_goes_straight_into_shards_on_the_chip(preset):
    plain = keras_hub.models.Gemma3CausalLM.from_preset(preset, preprocessor=None)
    bound = keras_hub.models.Gemma3CausalLM.from_preset(
        preset, preprocessor=None, device_mesh=ONE_DEVICE
    )
    chip = jax.devices()[0]
    for ours, theirs in zip(bound.weights, plain.weights):
        assert ours.path == theirs.path
        assert ours.value.devices() == {chip}, ours.path
        np.testing.assert_array_equal(np.asarray(ours.value), np.asarray(theirs.value))


def test_a_step_takes_keras_hubs_loss_and_attends_with_splash(preset):
    _, theirs, their_program = _trained(preset)
    _, ours, our_program = _trained(preset, device_mesh=ONE_DEVICE)
    # The same cross-entropy, through splash against XLA's attention.
    np.testing.assert_allclose(ours, theirs, rtol=1e-3)
    assert our_program["attention"] == "splash"
    assert their_program["attention"] != "splash"


@ON_A_V5E
def test_the_target_compile_is_the_chips_own_compile(preset):
    """`compiled_memory(..., device="v5e")` (on a v5e) against the memory
    of the step `train_on_batch` ran on the chip: within 5%."""
    _, _, program = _trained(preset, device_mesh=ONE_DEVICE)
    plan = keras_hub_autodist.plan(preset, ONE_DEVICE, dtype="float32")
    compiled = keras_hub_autodist.compiled_memory(plan, 2, SEQUENCE, device="v5e")
    assert not compiled.out_of_memory
    ratio = compiled.peak_bytes / program["program_bytes"]
    assert 0.95 <= ratio <= 1.05, (compiled.peak_bytes, program)
    assert compiled.attention == program["attention"] == "splash"


@ON_A_V5E
@pytest.mark.parametrize("case", CHIP_STEPS, ids=chip_step_id)
def test_the_default_answer_on_the_chip_is_its_compile(case, tmp_path, capfd):
    """`plan --device v5e` with a batch and a sequence, as a user types it
    on the chip: compiled by default, so never maybe, and right about
    whether the step runs."""
    preset, untied, lora_rank, batch, sequence, runs, _ = case
    args = ["plan", chip_preset_folder(preset, untied, tmp_path)]
    args += ["--mesh", "batch=1,model=1", "--dtype", "bfloat16", "--device", "v5e"]
    args += ["--batch", str(batch), "--seq", str(sequence), "--json"]
    if lora_rank:
        args += ["--lora-rank", str(lora_rank)]
    capfd.readouterr()
    assert cli.main(args) == 0
    answer = json.loads(capfd.readouterr().out)
    assert answer["compiled_by_default"]
    assert answer["fits"] is runs, answer


@pytest.fixture(scope="module")
def soft_capped_preset(tmp_path_factory):
    return tiny_presets.save_preset(
        tmp_path_factory.mktemp("tpu") / "gemma2",
        keras_hub.models.GemmaBackbone,
        soft_capped_steps.CONFIG,
        task_class=keras_hub.models.GemmaCausalLM,
    )


@pytest.mark.parametrize(
    "sequence, precision, rtol",
    soft_capped_steps.CHIP_CASES,
    ids=lambda v: str(v),
)
def test_gemma2_keeps_its_attention_soft_cap_on_the_chip(
    soft_capped_preset, sequence, precision, rtol
):
    """The chip's losses of a bound Gemma 2 with a hard attention cap are
    the CPU's (plain keras-hub there, in a process of its own) within
    `rtol`, in `train_on_batch`, `evaluate` and `predict`: Keras' fused
    attention on a TPU drops the cap (7.8e-3 of the loss), and the bound
    model never takes it. `precision`: the products' (`None`: the TPU's
    default, whose bfloat16 passes in the dense layers, keras-hub's own,
    move the loss by about 1.1e-4 at 64 tokens)."""
    script = pathlib.Path(soft_capped_steps.__file__)
    cpu = subprocess.run(
        [sys.executable, str(script), soft_capped_preset, str(sequence)],
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
    )
    assert cpu.returncode == 0, cpu.stderr[-3000:]
    theirs = json.loads(cpu.stdout.strip().splitlines()[-1])
    products = (
        contextlib.nullcontext()
        if precision is None
        else jax.default_matmul_precision(precision)
    )
    with products:
        ours = soft_capped_steps.figures(soft_capped_preset, sequence, ONE_DEVICE)
    for name, value in theirs.items():
        np.testing.assert_allclose(ours[name], value, rtol=rtol, err_msg=name)
