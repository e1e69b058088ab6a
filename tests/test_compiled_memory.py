"""`keras_hub_autodist.compiled_memory`: XLA's bytes of the training step compiled
from abstract weights, against the same step compiled with real ones; the
calibrated closed form (`step_memory`); the CLI's `--batch/--seq/--compiled`."""

import gc

import jax
import keras
import keras_hub
import numpy as np
import pytest
from real_presets import REAL_PRESETS

import keras_hub_autodist
from keras_hub_autodist import ModelClassError
from keras_hub_autodist import PlanError
from keras_hub_autodist import cli
from keras_hub_autodist.fitting import step_memory
from keras_hub_autodist.fitting.compiled_step import compiled_memory
from keras_hub_autodist.fitting.compiled_step import default_task_class
from keras_hub_autodist.fitting.compiled_step import memory_of
from keras_hub_autodist.fitting.compiled_step import program_facts

BATCH, SEQ = 8, 16


def _mesh(shape):
    devices = keras.distribution.list_devices()[: shape[0] * shape[1]]
    return keras.distribution.DeviceMesh(shape, ("batch", "model"), devices)


def _real_step_memory(path, task_cls, mesh, strategy):
    """The step `train_on_batch` runs, compiled with the loaded weights."""
    lm = task_cls.from_preset(
        path, preprocessor=None, device_mesh=mesh, strategy=strategy
    )
    lm.compile(optimizer=keras.optimizers.Adam())
    distribution = keras_hub_autodist.distribution_of(lm).distribution
    ids = np.random.default_rng(0).integers(
        4, lm.backbone.vocabulary_size, (BATCH, SEQ)
    )
    x = {"token_ids": ids.astype("int32"), "padding_mask": np.ones_like(ids, "int32")}
    y = np.roll(x["token_ids"], -1, axis=1)
    lm.train_on_batch(x, y)  # builds the optimizer and metrics
    with distribution.scope():
        state = lm._get_jax_state(
            trainable_variables=True,
            non_trainable_variables=True,
            optimizer_variables=True,
            metrics_variables=True,
        )
        shardings = jax.tree.map(lambda a: a.sharding, state)
        layout = distribution.get_data_layout(ids.shape).backend_layout
        data = jax.device_put((x, y, None), layout)
        step = jax.jit(lm.train_step, donate_argnums=0, out_shardings=(None, shardings))
        compiled = step.lower(state, data).compile()
    return memory_of(
        compiled,
        batch_size=BATCH,
        sequence_length=SEQ,
        optimizer="adam",
        devices=mesh.devices.size,
        platform="cpu",
        device_kind=mesh.backend_mesh.devices.flat[0].device_kind,
        # The same costs, collectives and attention as the abstract compile.
        **program_facts(compiled),
    )


@pytest.mark.parametrize(
    "name, task_cls, shape, strategy",
    [
        ("gemma_mqa", keras_hub.models.GemmaCausalLM, (2, 4), "tp"),
    ],
)
def test_matches_the_step_compiled_with_real_weights(
    tiny_presets_dir, name, task_cls, shape, strategy
):
    assert_matches_the_step_compiled_with_real_weights(
        tiny_presets_dir[name], task_cls, shape, strategy
    )


def assert_matches_the_step_compiled_with_real_weights(path, task_cls, shape, strategy):
    mesh = _mesh(shape)
    plan = keras_hub_autodist.plan(path, mesh, strategy=strategy)
    abstract = compiled_memory(plan, BATCH, SEQ, "adam")
    real = _real_step_memory(path, task_cls, mesh, strategy)
    assert abstract == real
    assert abstract.alias_bytes > 0  # the state is donated, as Keras does


def test_allocates_no_weight(tiny_presets_dir):
    plan = keras_hub_autodist.plan(tiny_presets_dir["gemma_mqa"], _mesh((2, 4)))
    gc.collect()
    before = [(a.shape, a.dtype) for a in jax.live_arrays()]
    memory = compiled_memory(plan, BATCH, SEQ)
    gc.collect()
    assert [(a.shape, a.dtype) for a in jax.live_arrays()] == before
    assert memory.peak_bytes > 0


def test_arguments_are_weights_adam_state_and_the_batch(tiny_presets_dir):
    plan = keras_hub_autodist.plan(tiny_presets_dir["gemma_mqa"], _mesh((2, 4)))
    memory = compiled_memory(plan, BATCH, SEQ, "adam")
    batch = 3 * (BATCH // 2) * SEQ * 4  # token ids, padding mask, labels
    expected = 3 * plan.max_device_bytes + batch  # weight, two moments
    assert expected <= memory.argument_bytes <= expected + 64  # + scalars
    sgd = compiled_memory(plan, BATCH, SEQ, "sgd")
    assert plan.max_device_bytes + batch <= sgd.argument_bytes
    assert sgd.argument_bytes < memory.argument_bytes - plan.max_device_bytes
    assert memory.peak_bytes == (
        memory.argument_bytes
        + memory.output_bytes
        - memory.alias_bytes
        + memory.temp_bytes
    )


def _gemma_config():
    import tiny_presets

    return {**tiny_presets.GEMMA_MQA, "vocabulary_size": 64}


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda p: compiled_memory(p, 0, SEQ), PlanError, r"Received: batch_size=0"),
        (lambda p: compiled_memory(p, 0, SEQ), PlanError, r"Received: batch_size=0"),
        (lambda p: compiled_memory(p, 8, 1.5), PlanError, r"sequence_length=1.5"),
        (lambda p: compiled_memory(p, 8, SEQ, "lion"), PlanError, r"'lion'"),
        (
            lambda p: compiled_memory(p, 8, SEQ, model_class=dict),
            ModelClassError,
            r"Received: model_class=<class 'dict'>",
        ),
    ],
)
def test_bad_arguments_are_refused(tiny_presets_dir, call, error, match):
    plan = keras_hub_autodist.plan(tiny_presets_dir["gemma_mqa"], _mesh((2, 4)))
    with pytest.raises(error, match=match):
        call(plan)


def test_default_task_class():
    assert default_task_class(keras_hub.models.GemmaBackbone) is (
        keras_hub.models.GemmaCausalLM
    )
    with pytest.raises(ModelClassError, match=r"Received: backbone class Backbone"):
        default_task_class(keras_hub.models.Backbone)


def test_fit_advice_names_the_compiled_check():
    plan = keras_hub_autodist.plan(
        str(REAL_PRESETS / "gemma_7b"), {"batch": 1, "model": 1}
    )
    assert not plan.fits
    assert "compiled_memory(plan, batch_size, sequence_length)" in plan.summary()


# --- the calibrated closed form -------------------------------------------------


def test_step_estimate_parts():
    plan = keras_hub_autodist.plan(
        str(REAL_PRESETS / "gemma_2b"), {"batch": 1, "model": 1}, dtype="bfloat16"
    )
    estimate = step_memory.step_estimate(plan, 4, 1024, "adam")
    assert estimate.weights == estimate.gradients == plan.max_device_bytes
    assert estimate.optimizer_state == 2 * plan.max_device_bytes
    # On a GPU half the gradients are live beside the activations at the
    # backward pass's peak (`GRADIENTS_AT_PEAK`), all of them at the update.
    assert estimate.live_gradients == estimate.gradients // 2
    assert estimate.total_bytes == sum(
        (
            estimate.weights,
            estimate.optimizer_state,
            max(
                estimate.live_gradients + estimate.activations,
                estimate.gradients + estimate.update_temporaries,
            ),
        )
    )
    # The H200's measured peak for this step (../shared/ACCELERATOR.md).
    assert 1.0 < estimate.total_bytes / 31.3e9 < 1.15
    cpu = step_memory.step_estimate(plan, 4, 1024, "adam", platform="cpu")
    assert cpu.activations > estimate.activations
    with pytest.raises(PlanError, match=r"Received: platform='ipu'"):
        step_memory.step_estimate(plan, 4, 1024, platform="ipu")
    with pytest.raises(PlanError, match=r"Received: optimizer='lion'"):
        step_memory.step_estimate(plan, 4, 1024, "lion")


def test_the_update_counts_when_it_outgrows_the_activations():
    """On CPU, applying Adam's update keeps 1.4x the trained bytes beside
    the state: full fine-tuning of short sequences peaks there, after the
    activations are gone; LoRA trains too little for it to matter."""
    plan = keras_hub_autodist.plan(
        str(REAL_PRESETS / "llama3.2_1b"), {"batch": 2, "model": 4}
    )
    full = step_memory.step_estimate(plan, 2, 128, platform="cpu")
    factor = step_memory.UPDATE_TEMPORARIES["cpu"]
    assert full.update_temporaries == int(factor * full.gradients)
    assert full.update_temporaries > full.activations
    assert full.total_bytes == full.state_bytes + full.update_temporaries
    long = step_memory.step_estimate(plan, 2, 4096, platform="cpu")
    assert long.total_bytes == long.state_bytes + long.activations
    lora = step_memory.step_estimate(plan, 2, 128, platform="cpu", lora_rank=4)
    assert lora.total_bytes == lora.state_bytes + lora.activations
    # Split over the batch axis (fsdp), the update shrinks with the state.
    assert full.with_state_split(2) == full.state_bytes / 2 + max(
        full.activations, full.update_temporaries / 2
    )
    gpu = step_memory.step_estimate(plan, 2, 128)
    assert gpu.update_temporaries == 0


# --- the command line ---------------------------------------------------------------


def test_cli_prints_the_estimate_and_the_compiled_check(tiny_presets_dir, capsys):
    path = tiny_presets_dir["gemma_mqa"]
    args = ["plan", path, "--mesh", "batch=2,model=4", "--batch", "8", "--seq", "16"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "training step, batch 8 x 16 tokens, adam, estimated per device" in out
    assert "compiled" not in out
    assert cli.main(args + ["--compiled"]) == 0
    out = capsys.readouterr().out
    assert "compiled training step (XLA, cpu, 8 devices)" in out
    assert "estimate / compiled peak:" in out


@pytest.mark.parametrize(
    "extra, match",
    [
        (["--batch", "8"], "needs both --batch and --seq"),
        (["--compiled"], "--compiled needs them too"),
        (["--batch", "0", "--seq", "16"], "--batch takes a positive integer"),
    ],
)
def test_cli_step_errors_are_one_line(tiny_presets_dir, capsys, extra, match):
    path = tiny_presets_dir["gemma_mqa"]
    try:
        status = cli.main(["plan", path, "--mesh", "batch=2,model=4", *extra])
    except SystemExit as exit:  # argparse's own errors
        status = exit.code
    assert status == 2
    err = capsys.readouterr().err
    assert match in err and len(err.strip().splitlines()) == 1


def test_the_plan_method_is_a_deprecated_alias(tiny_presets_dir, monkeypatch):
    """It hands its arguments on (not compiled again here: the function's
    own tests compile)."""
    from keras_hub_autodist.fitting import compiled_step

    plan = keras_hub_autodist.plan(tiny_presets_dir["gemma_mqa"], _mesh((2, 4)))
    calls = []
    monkeypatch.setattr(
        compiled_step, "compiled_memory", lambda *a, **k: calls.append((a, k)) or "m"
    )
    with pytest.warns(DeprecationWarning, match=r"keras_hub_autodist.compiled_memory"):
        answer = plan.compiled_memory(BATCH, SEQ, "sgd", platform="cpu")
    assert answer == "m"
    assert calls == [((plan, BATCH, SEQ, "sgd"), {"platform": "cpu"})]
