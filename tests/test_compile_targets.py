"""The memory check compiled for a named accelerator on this CPU-only
machine (`compile_targets`, `compiled_memory(..., device=)`, `plan --device
D --compiled --json`): a TPU v5e through libtpu, two T4s through JAX's CUDA
plugin, when the `tpu-compile` and `gpu-compile` extras are installed; the
usable memory of the device profiles; the compiled program's collectives,
attention and out-of-memory refusals."""

import importlib.util
import json
import sys

import jax
import pytest
from search_stand_ins import TILED_GEMMA

import keras_hub_autodist
from keras_hub_autodist import cli
from keras_hub_autodist.errors import CompilerMissingError
from keras_hub_autodist.errors import EnvironmentVariableError
from keras_hub_autodist.errors import PlanError
from keras_hub_autodist.errors import TargetCompileError
from keras_hub_autodist.fitting import compile_targets
from keras_hub_autodist.fitting import step_memory
from keras_hub_autodist.fitting.compiled_analysis import collectives
from keras_hub_autodist.fitting.compiled_analysis import out_of_memory
from keras_hub_autodist.fitting.compiled_step import compiled_memory
from keras_hub_autodist.fitting.device_profiles import DEVICE_PROFILES
from keras_hub_autodist.fitting.device_profiles import GIB
from keras_hub_autodist.fitting.device_profiles import usable_memory

HAS_TPU_COMPILER = importlib.util.find_spec("libtpu") is not None
HAS_GPU_COMPILER = importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
needs_tpu_compiler = pytest.mark.skipif(
    not HAS_TPU_COMPILER,
    reason="the TPU compiler is not installed: pip install "
    "keras-hub-autodist[tpu-compile]",
)
needs_gpu_compiler = pytest.mark.skipif(
    not HAS_GPU_COMPILER,
    reason="the GPU compiler is not installed: pip install "
    "keras-hub-autodist[gpu-compile]",
)
BATCH, SEQ = 4, 16


def _state_bytes(plan, batch, seq):
    """The plan's per-device state: weights and optimizer state, as the
    closed form counts them; and the batch slice the step also takes."""
    estimate = step_memory.step_estimate(plan, batch, seq, "adam")
    batch_axis = plan.mesh_axes.size(plan.batch_axis)
    # token ids, padding mask and labels: int32 each.
    return estimate.weights + estimate.optimizer_state, 3 * 4 * batch * seq // (
        batch_axis
    )


def _assert_compiled_the_planned_layout(plan, memory):
    state, batch = _state_bytes(plan, BATCH, SEQ)
    # Beside the state and the batch, the step takes a few scalars (the
    # iteration count, the learning rate, the metrics' totals).
    assert abs(memory.argument_bytes - batch - state) <= 0.02 * state + 64


@needs_tpu_compiler
def test_compiles_for_a_tpu_v5e_2x2_here():
    plan = keras_hub_autodist.plan(
        TILED_GEMMA, {"batch": 2, "model": 2}, device_memory="v5e"
    )
    memory = compiled_memory(plan, BATCH, SEQ, preset=TILED_GEMMA)
    assert memory.compiled_for() == {
        "platform": "tpu",
        "device_kind": "TPU v5 lite",
        "devices": 4,
    }
    assert memory.target == "v5e" and not memory.out_of_memory
    _assert_compiled_the_planned_layout(plan, memory)
    assert memory.cost["flops"] > 0 and memory.cost["optimal_seconds"] > 0
    # tp over 2 devices: the partial sums of the sharded matmuls are summed.
    assert any(c.kind == "all-reduce" and c.bytes > 0 for c in memory.collectives)
    assert memory.attention == "xla"


@needs_gpu_compiler
def test_compiles_for_two_t4s_here(tiny_presets_dir):
    plan = keras_hub_autodist.plan(
        tiny_presets_dir["gemma_mqa"], {"batch": 1, "model": 2}
    )
    memory = compiled_memory(plan, BATCH, SEQ, device="t4")
    assert memory.compiled_for() == {
        "platform": "gpu",
        "device_kind": "Tesla T4",
        "devices": 2,
    }
    _assert_compiled_the_planned_layout(plan, memory)
    assert memory.peak_bytes >= memory.argument_bytes > 0


@needs_gpu_compiler
def test_a_step_the_target_cannot_run_is_an_error_with_its_fix(tiny_presets_dir):
    # Keras' attention asks for bfloat16 dots a T4 has no arithmetic for:
    # its compiler refuses the step (as a real T4 does); float16 compiles.
    preset = tiny_presets_dir["llama3_untied"]
    mesh = {"batch": 1, "model": 2}
    plan = keras_hub_autodist.plan(preset, mesh, dtype="bfloat16", device_memory="t4")
    with pytest.raises(TargetCompileError) as refused:
        compiled_memory(plan, BATCH, SEQ)
    message = str(refused.value)
    assert "Tesla T4 x 2" in message and "ALG_DOT_BF16_BF16_F32" in message
    assert 'dtype="float16"' in message and "Received: dtype='bfloat16'" in message
    half = keras_hub_autodist.plan(preset, mesh, dtype="float16", device_memory="t4")
    assert compiled_memory(half, BATCH, SEQ).peak_bytes > 0


@needs_tpu_compiler
def test_cli_answers_from_the_target_compile(tiny_presets_dir, capfd):
    args = [
        "plan",
        tiny_presets_dir["gemma_mqa"],
        "--device",
        "v5e",
        "--mesh",
        "batch=2,model=2",
        "--batch",
        str(BATCH),
        "--seq",
        str(SEQ),
        "--compiled",
        "--json",
    ]
    assert cli.main(args) == 0
    answer = json.loads(capfd.readouterr().out)
    assert answer["compiled_for"]["device_kind"] == "TPU v5 lite"
    assert answer["compiled_for"]["devices"] == 4
    assert answer["fits"] == (
        answer["compiled_peak_bytes_per_device"] <= answer["device_memory_bytes"]
    )
    parts = answer["estimate_parts"]
    state = parts["weights"] + parts["optimizer_state"]
    assert answer["compiled_argument_bytes_per_device"] >= state
    assert answer["compiled_flops_per_device"] > 0
    assert answer["compiled_optimal_seconds"] > 0
    assert answer["compiled_attention"] == "xla"
    assert {c["kind"] for c in answer["compiled_collectives"]} >= {"all-reduce"}
    assert answer["device_memory_bytes"] == int(15.75 * GIB)
    assert "TPU compiler" in answer["device_memory_assumption"]


@needs_tpu_compiler
def test_a_step_too_large_for_the_tpu_is_an_answer(tiny_presets_dir):
    # 2048 sequences of 4096 tokens: the logits alone are past 16 GiB.
    plan = keras_hub_autodist.plan(
        tiny_presets_dir["gemma_mqa"], {"batch": 2, "model": 2}, device_memory="v5e"
    )
    memory = compiled_memory(plan, 2048, 4096)
    assert "RESOURCE_EXHAUSTED" in memory.out_of_memory
    assert memory.compiler_limit_bytes == int(15.75 * GIB)
    assert memory.peak_bytes > memory.compiler_limit_bytes
    assert "does not fit" in memory.summary()


def test_without_the_compiler_the_error_names_the_extra(monkeypatch, tiny_presets_dir):
    found = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: (
            None if name in ("libtpu", "jax_plugins.xla_cuda12") else found(name, *a)
        ),
    )
    plan = keras_hub_autodist.plan(
        tiny_presets_dir["gemma_mqa"], {"batch": 2, "model": 2}, device_memory="v5e"
    )
    with pytest.raises(CompilerMissingError, match=r"\[tpu-compile\].*Received"):
        compiled_memory(plan, BATCH, SEQ)
    with pytest.raises(CompilerMissingError, match=r"\[gpu-compile\].*Received"):
        compiled_memory(plan, BATCH, SEQ, device="h100")


@pytest.mark.parametrize(
    "package, device, extra",
    [("jax_plugins", "h100", "gpu-compile"), ("libtpu", "v5e", "tpu-compile")],
)
def test_without_the_compilers_package_the_error_names_the_extra(
    monkeypatch, tiny_presets_dir, package, device, extra
):
    """The compiler's whole package missing (a GPU compiler's `jax_plugins`
    too, whose submodule can't even be looked for) names the extra."""
    # As if not installed: the package unimportable, none of it imported.
    monkeypatch.setitem(sys.modules, package, None)
    for name in [name for name in sys.modules if name.startswith(f"{package}.")]:
        monkeypatch.delitem(sys.modules, name)
    plan = keras_hub_autodist.plan(
        tiny_presets_dir["gemma_mqa"], {"batch": 2, "model": 2}, device_memory=device
    )
    with pytest.raises(CompilerMissingError, match=rf"\[{extra}\].*Received"):
        compiled_memory(plan, BATCH, SEQ)


def test_local_devices_of_the_target_kind_are_compiled_for(monkeypatch):
    kind = jax.devices()[0].device_kind
    spec = compile_targets.TargetSpec("cpu", "none", (kind,))
    monkeypatch.setitem(compile_targets.TARGETS, "this-cpu", spec)
    target = compile_targets.compile_target("this-cpu", 4)
    assert not target.compile_only
    assert target.devices == tuple(jax.devices()[:4])


def test_unknown_target_and_impossible_slice_are_errors():
    with pytest.raises(PlanError, match=r"No compiler target for device 'k80'"):
        compile_targets.compile_target("k80", 2)
    if HAS_TPU_COMPILER:
        with pytest.raises(PlanError, match=r"No v5e TPU slice has 3 devices"):
            compile_targets.compile_target("v5e", 3)


def test_gpu_target_configs_are_the_profiles_devices():
    for name, spec in compile_targets.TARGETS.items():
        if spec.platform != "gpu":
            continue
        config = compile_targets.gpu_target_config(spec.generation)
        assert "# Source:" in config
        total = DEVICE_PROFILES[name].total_bytes
        assert f"device_memory_size: {total}\n" in config, name


def test_usable_memory_follows_jax_gpu_pool_settings():
    t4 = DEVICE_PROFILES["t4"]
    assert t4.total_bytes == 15 * GIB
    default, why = usable_memory(t4, {})
    assert default == int(0.75 * 15 * GIB)
    assert why.startswith("11.2 GiB: JAX's default 75% of a T4's 15 GiB")
    assert usable_memory(t4, {"XLA_PYTHON_CLIENT_MEM_FRACTION": ".95"})[0] == int(
        0.95 * 15 * GIB
    )
    assert usable_memory(t4, {"XLA_CLIENT_MEM_FRACTION": ".5"})[0] == int(
        0.5 * 15 * GIB
    )
    # No pool: every buffer its own allocation, up to the whole memory.
    assert usable_memory(t4, {"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"})[0] == (
        15 * GIB
    )
    # Deferring the pool keeps its limit.
    assert usable_memory(t4, {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"})[0] == default
    with pytest.raises(EnvironmentVariableError, match=r"Received: XLA_CLIENT_MEM"):
        usable_memory(t4, {"XLA_CLIENT_MEM_FRACTION": "95"})


def test_plans_for_a_named_gpu_hold_to_the_pool(monkeypatch):
    monkeypatch.delenv("XLA_CLIENT_MEM_FRACTION", raising=False)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", ".9")
    from keras_hub_autodist.fitting.device_memory import device_memory_info

    assert device_memory_info((), "t4") == (int(0.9 * 15 * GIB), "given")


def test_collectives_count_async_pairs_once_by_their_result():
    text = "\n".join(
        [
            "%ags = (bf16[4,8]{1,0}, bf16[8,8]{1,0}) all-gather-start(%p)",
            "%agd = bf16[8,8]{1,0} all-gather-done(%ags)",
            "%ar = f32[16]{0} all-reduce(%x), to_apply=%add",
            "%rs = f32[4]{0} reduce-scatter(%y), dimensions={0}",
        ]
    )
    found = {c.kind: (c.count, c.bytes) for c in collectives(text)}
    assert found == {
        "all-gather": (1, 128),
        "all-reduce": (1, 64),
        "reduce-scatter": (1, 16),
    }


def test_out_of_memory_reads_both_forms_of_the_tpu_refusal():
    temporaries = RuntimeError(
        "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory "
        "required for HLO temporaries (48.00G) exceeds available HBM (15.75G)."
    )
    assert out_of_memory(temporaries) == (48 * GIB, int(15.75 * GIB))
    used = RuntimeError("RESOURCE_EXHAUSTED: Used 20.50G of 15.48G hbm.")
    assert out_of_memory(used) == (int(20.5 * GIB), int(15.48 * GIB))
    assert out_of_memory(RuntimeError("INTERNAL: no")) is None
