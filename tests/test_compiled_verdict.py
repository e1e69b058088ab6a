"""The compiled verdict is the compiler's: on a TPU, a step its compiler
accepts fits and one it refuses does not, with the bytes the refusal names;
on a GPU, whose compiler refuses nothing for its size, the program's own
peak against the pool JAX's allocator gives a program. One rule
(`compiled_answer.compiled_fits`) for the command's text and `--json`,
`CompiledMemory.fits` and the layout search, tried at steps within 1% of
the limit on each side."""

import json
import types

import jax
import pytest
from test_compile_targets import TILED_GEMMA
from test_compile_targets import needs_gpu_compiler
from test_compile_targets import needs_tpu_compiler
from test_search_robustness import TINY_GEMMA

import keras_hub_autodist
from keras_hub_autodist import cli
from keras_hub_autodist.fitting import compiled_answer
from keras_hub_autodist.fitting.compiled_answer import compiled_fits
from keras_hub_autodist.fitting.compiled_step import compiled_memory
from keras_hub_autodist.fitting.compiled_step import memory_of
from keras_hub_autodist.fitting.device_profiles import DEVICE_PROFILES
from keras_hub_autodist.fitting.device_profiles import GIB
from keras_hub_autodist.searching import search as search_module
from keras_hub_autodist.searching.search import COMPILED

V5E_LIMIT = DEVICE_PROFILES["v5e"].memory_bytes
BATCH, SEQ = 4, 16


def _analysis(peak: int, parts: int, arguments: int = 1 << 20):
    """XLA's memory analysis of a program whose own peak is `peak` and
    whose parts (arguments + outputs - aliased + temporaries) sum to
    `parts`: a program whose buffers are not all live at once."""
    return types.SimpleNamespace(
        argument_size_in_bytes=arguments,
        output_size_in_bytes=arguments,
        alias_size_in_bytes=arguments,
        temp_size_in_bytes=parts - arguments,
        generated_code_size_in_bytes=0,
        peak_memory_in_bytes=peak,
    )


def _program(peak, parts):
    return types.SimpleNamespace(memory_analysis=lambda: _analysis(peak, parts))


def _fields(platform, **more):
    fields = dict(batch_size=BATCH, sequence_length=SEQ, optimizer="adam", devices=1)
    return {**fields, "platform": platform, **more}


# Within 1% of the limit on each side: the program's peak under it, the sum
# of its parts over it (Qwen 2.5 0.5B's full fine-tune of 8 x 1024 tokens
# on a v5e: peak 15.08 GiB, parts 15.82 GiB, limit 15.75 GiB; it runs).
UNDER, OVER = 0.995, 1.005


@pytest.mark.parametrize("platform", ["tpu", "gpu"])
def test_the_peak_is_the_programs_own_not_the_sum_of_its_parts(platform):
    capacity = V5E_LIMIT
    memory = memory_of(
        _program(int(UNDER * capacity), int(OVER * capacity)),
        **_fields(platform, device_memory_bytes=capacity),
    )
    assert memory.peak_bytes == int(UNDER * capacity)
    assert compiled_fits(memory, capacity) and memory.fits is True
    over = memory_of(
        _program(int(OVER * capacity), int(UNDER * capacity)),
        **_fields(platform, device_memory_bytes=capacity),
    )
    assert over.peak_bytes == int(OVER * capacity)
    assert not compiled_fits(over, capacity) and over.fits is False
    # A backend that reports no peak: the sum of the parts.
    silent = types.SimpleNamespace(
        memory_analysis=lambda: _analysis(0, int(OVER * capacity))
    )
    assert memory_of(silent, **_fields(platform)).peak_bytes == int(OVER * capacity)


def test_on_a_cpu_the_peak_is_the_sum_of_the_parts():
    """XLA's CPU compiler reports a peak without its temporaries."""
    memory = memory_of(_program(1000, 5000), **_fields("cpu"))
    assert memory.peak_bytes == 5000


def test_a_step_the_tpu_compiler_accepted_fits_the_memory_it_holds_programs_to():
    accepted = memory_of(
        _program(int(OVER * V5E_LIMIT), int(OVER * V5E_LIMIT)),
        **_fields("tpu", compiler_limit_bytes=V5E_LIMIT),
    )
    assert compiled_fits(accepted, V5E_LIMIT)
    # Held to less than the compiler gives it, the peak decides.
    assert not compiled_fits(accepted, V5E_LIMIT // 2)
    # No GPU compiler holds a program to a limit: the peak decides there.
    gpu = memory_of(
        _program(int(OVER * V5E_LIMIT), int(OVER * V5E_LIMIT)),
        **_fields("gpu", compiler_limit_bytes=V5E_LIMIT),
    )
    assert not compiled_fits(gpu, V5E_LIMIT)


def _refuse(needed_gib):
    def compile(self, *args, **kwargs):
        raise RuntimeError(
            "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory "
            f"required for HLO temporaries ({needed_gib:.2f}G) exceeds "
            "available HBM (15.75G)."
        )

    return compile


def _run(capfd, *args):
    capfd.readouterr()
    assert cli.main(["plan", *args]) == 0
    return capfd.readouterr().out


TPU_STEP = ["--device", "v5e", "--mesh", "batch=2,model=2", "--batch", str(BATCH)]
TPU_STEP += ["--seq", str(SEQ)]


@needs_tpu_compiler
def test_a_tpu_step_within_one_percent_of_the_limit_is_the_compilers_verdict(
    monkeypatch,
):
    preset = {"preset": TILED_GEMMA}
    plan = keras_hub_autodist.plan(
        TILED_GEMMA, {"batch": 2, "model": 2}, device_memory="v5e"
    )
    # Accepted: its peak just under the limit, its parts just over.
    peak, parts = int(UNDER * V5E_LIMIT), int(OVER * V5E_LIMIT)
    with monkeypatch.context() as patched:
        patched.setattr(
            jax.stages.Compiled, "memory_analysis", lambda self: _analysis(peak, parts)
        )
        memory = compiled_memory(plan, BATCH, SEQ, **preset)
    assert not memory.out_of_memory
    assert memory.peak_bytes == peak and memory.fits is True
    # Refused: the bytes its refusal names, its arguments among them.
    with monkeypatch.context() as patched:
        patched.setattr(jax.stages.Lowered, "compile", _refuse(OVER * 15.75))
        refused = compiled_memory(plan, BATCH, SEQ, **preset)
    named = int(float(f"{OVER * 15.75:.2f}") * GIB)
    assert refused.peak_bytes == named and refused.fits is False
    assert refused.compiler_limit_bytes == V5E_LIMIT


@needs_tpu_compiler
def test_the_commands_tpu_answer_is_the_compilers_text_and_json(
    monkeypatch, capfd, tiny_presets_dir
):
    preset = tiny_presets_dir["gemma_mqa"]
    peak, parts = int(UNDER * V5E_LIMIT), int(OVER * V5E_LIMIT)
    with monkeypatch.context() as patched:
        patched.setattr(
            jax.stages.Compiled, "memory_analysis", lambda self: _analysis(peak, parts)
        )
        answer = json.loads(_run(capfd, preset, *TPU_STEP, "--json"))
        (line,) = [
            line
            for line in _run(capfd, preset, *TPU_STEP).splitlines()
            if line.startswith("fits")
        ]
    assert answer["compiled_by_default"]
    assert answer["fits"] is True and answer["verdict"] == "yes"
    assert answer["compiled_peak_bytes_per_device"] == peak
    assert answer["advice"] == []
    assert line.startswith("fits (compiled for TPU v5 lite x 4): yes")
    assert f"{peak / GIB:.2f} GiB" in line
    with monkeypatch.context() as patched:
        patched.setattr(jax.stages.Lowered, "compile", _refuse(OVER * 15.75))
        answer = json.loads(_run(capfd, preset, *TPU_STEP, "--json"))
    assert answer["fits"] is False and answer["verdict"] == "no"
    named = int(float(f"{OVER * 15.75:.2f}") * GIB)
    assert answer["compiled_peak_bytes_per_device"] == named
    assert answer["compiler_limit_bytes_per_device"] == V5E_LIMIT


@needs_tpu_compiler
def test_a_tiny_tpu_step_is_held_to_a_memory_within_one_percent_of_its_peak():
    """A real compile for a v5e: the memory given just over and just under
    the program's own peak (its parts sum to more)."""
    plan = keras_hub_autodist.plan(
        TILED_GEMMA, {"batch": 2, "model": 2}, device_memory="v5e"
    )
    memory = compiled_memory(plan, BATCH, SEQ, preset=TILED_GEMMA)
    assert memory.fits is True
    for share, fits in ((UNDER, True), (OVER, False)):
        capacity = int(memory.peak_bytes / share)
        assert compiled_fits(memory, capacity) is fits, share
        held = plan.replace(device_memory_bytes=capacity)
        again = compiled_memory(held, BATCH, SEQ, preset=TILED_GEMMA)
        assert again.peak_bytes == memory.peak_bytes
        assert again.fits is fits, share


@needs_gpu_compiler
def test_a_gpu_step_is_held_to_the_pool_jax_gives_a_program(
    monkeypatch, capfd, tiny_presets_dir
):
    """XLA's GPU compiler refuses no program for its size: the program's
    peak is held to JAX's pool, here set by the client's memory fraction
    to within 1% of it on each side."""
    preset = tiny_presets_dir["gemma_mqa"]
    mesh = {"batch": 1, "model": 2}
    plan = keras_hub_autodist.plan(preset, mesh, device_memory="t4")
    memory = compiled_memory(plan, BATCH, SEQ)
    parts = (
        memory.argument_bytes
        + memory.output_bytes
        - memory.alias_bytes
        + memory.temp_bytes
    )
    assert memory.fits is True and memory.peak_bytes <= parts
    total = DEVICE_PROFILES["t4"].total_bytes
    # The verdict is under test, not its advice, whose steps would be
    # compiled too.
    monkeypatch.setattr(compiled_answer, "MAX_ADVICE_COMPILES", 0)
    for share, fits in ((UNDER, True), (OVER, False)):
        fraction = memory.peak_bytes / share / total
        monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", repr(fraction))
        args = [preset, "--device", "t4", "--mesh", "batch=1,model=2"]
        args += ["--batch", str(BATCH), "--seq", str(SEQ), "--compiled", "--json"]
        answer = json.loads(_run(capfd, *args))
        assert answer["compiled_peak_bytes_per_device"] == memory.peak_bytes
        assert answer["device_memory_bytes"] == int(total * fraction)
        assert answer["fits"] is fits, share
        assert answer["verdict"] == ("yes" if fits else "no")


def test_the_search_ranks_by_the_same_verdict(monkeypatch, tmp_path):
    """The layout search reads each candidate's compile by the same rule: a
    step whose peak is within 1% under the limit fits, though its parts sum
    to more; one within 1% over does not."""

    def compiled(layout, batch_size, sequence_length, optimizer, **kwargs):
        mesh = dict(zip(layout.mesh_axes.axis_names, layout.mesh_axes.shape))
        share = UNDER if mesh.get("model", 1) == 1 else OVER
        capacity = layout.device_memory_bytes
        program = _program(int(share * capacity), int(OVER * capacity))
        return memory_of(
            program,
            **_fields(
                "tpu",
                devices=layout.mesh_axes.num_devices,
                batch_size=batch_size,
                sequence_length=sequence_length,
                cost={"optimal_seconds": 0.01 * mesh.get("model", 1)},
            ),
        )

    monkeypatch.setattr(search_module, "compiled_memory", compiled)
    result = search_module.search(
        TINY_GEMMA,
        device="v5e",
        devices=4,
        batch_size=4,
        sequence_length=32,
        max_compiles=8,
        cache_dir=tmp_path / "compiles",
    )
    compiled_entries = [e for e in result.entries if e.stage == COMPILED]
    assert {e.fits for e in compiled_entries} == {True, False}
    for entry in compiled_entries:
        capacity = DEVICE_PROFILES["v5e"].memory_bytes
        assert entry.fits is (entry.compiled.peak_bytes <= capacity)
    assert result.chosen.fits and result.chosen.candidate.mesh.get("model", 1) == 1
