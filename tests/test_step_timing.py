"""A compiled step timed on this machine's devices (`fitting.step_timing`):
`compiled_memory(..., timed_steps=n)` runs the very step it compiled where
the devices are attached, `step_cost.compiled_cost` takes those seconds
over any model of them, and the search ranks by them, timing the rung
below the fastest batch too. Compiled for a device that is not attached (a
compiler's stand-ins), nothing runs."""

import dataclasses
import importlib.util

import pytest
from search_stand_ins import batch_limited_compiler
from search_stand_ins import search_tiny_gemma
from search_stand_ins import tpu_memory

import keras_hub_autodist
from keras_hub_autodist import ArgumentError
from keras_hub_autodist.fitting.compiled_step import compiled_memory
from keras_hub_autodist.fitting.device_profiles import DeviceSpeed
from keras_hub_autodist.fitting.step_timing import TIMED_STEPS
from keras_hub_autodist.searching import search as search_module
from keras_hub_autodist.searching import step_cost
from keras_hub_autodist.searching.report import COMPILED

MESH = {"batch": 2, "model": 4}
HAS_TPU_COMPILER = importlib.util.find_spec("libtpu") is not None


@pytest.fixture
def compiler(monkeypatch):
    return batch_limited_compiler(monkeypatch)


def test_the_step_is_timed_on_this_machines_devices(tiny_presets_dir):
    plan = keras_hub_autodist.plan(tiny_presets_dir["gemma_mqa"], MESH)
    untimed = compiled_memory(plan, 8, 32)
    assert "measured_seconds" not in untimed.cost
    timed = compiled_memory(plan, 8, 32, timed_steps=2)
    assert timed.cost["measured_seconds"] > 0
    # Timing adds the seconds and changes nothing else of the answer.
    assert {k: v for k, v in timed.cost.items() if k != "measured_seconds"} == (
        untimed.cost
    )
    assert (timed.peak_bytes, timed.out_of_memory) == (untimed.peak_bytes, "")


@pytest.mark.skipif(not HAS_TPU_COMPILER, reason="needs the TPU compiler")
def test_a_step_compiled_for_a_device_not_attached_is_not_run(tiny_presets_dir):
    plan = keras_hub_autodist.plan(tiny_presets_dir["gemma_mqa"], {"batch": 1})
    memory = compiled_memory(plan, 2, 32, device="v5e", timed_steps=2)
    assert "measured_seconds" not in memory.cost


@pytest.mark.parametrize("steps", [-1, 1.5, True, "5"])
def test_timed_steps_is_a_count(tiny_presets_dir, steps):
    plan = keras_hub_autodist.plan(tiny_presets_dir["gemma_mqa"], MESH)
    with pytest.raises(ArgumentError) as raised:
        compiled_memory(plan, 8, 32, timed_steps=steps)
    assert f"Received: timed_steps={steps!r}" in str(raised.value)


def test_a_measured_step_costs_what_it_measured():
    speed = DeviceSpeed(1e12, 1e11, 1e10, "pcie", "")
    program = tpu_memory(
        1, 1, 1, cost=dict(flops=4e12, optimal_seconds=0.5, measured_seconds=0.75)
    )
    # Measured on the device: neither the compiler's estimate nor the floor
    # of the model's flops at the device's peak stands for it.
    for least_flops in (0.0, 2e12):
        cost = step_cost.compiled_cost(program, speed, least_flops=least_flops)
        assert (cost.seconds, cost.source) == (0.75, "measured")


def searched_with_measured_times(tmp_path, monkeypatch, slower: dict) -> tuple:
    """Search the tiny Gemma on an attached stand-in device (16 per device
    fits, so the climb compiles no smaller batch) whose measured seconds
    are the stand-in's modelled ones times `slower[per-device batch]` (1 if
    absent): the compiler rematerializing near the memory's limit. Returns
    the result, its compiled entries that fit by per-device batch, and the
    `timed_steps` of each compile."""
    batch_limited_compiler(monkeypatch).limits = {None: 16}
    stand_in = search_module.compiled_memory
    timed = []

    def measured(layout, batch_size, sequence_length, optimizer, **kwargs):
        timed.append(kwargs["timed_steps"])
        memory = stand_in(layout, batch_size, sequence_length, optimizer, **kwargs)
        if memory.out_of_memory or not kwargs["timed_steps"]:
            return memory
        rows = batch_size // layout.mesh_axes.size(layout.mesh_axes.batch_axis)
        seconds = memory.cost["optimal_seconds"] * slower.get(rows, 1.0)
        return dataclasses.replace(memory, cost={"measured_seconds": seconds})

    monkeypatch.setattr(search_module, "compiled_memory", measured)
    monkeypatch.setattr(search_module, "attached", lambda device, count: True)
    result = search_tiny_gemma(tmp_path, per_device_batch=(1, 16), remats=(None,))
    compiled = {
        e.candidate.per_device_batch: e
        for e in result.entries
        if e.stage == COMPILED and e.fits
    }
    return result, compiled, timed


def test_the_search_times_each_step_and_the_rung_below_where_attached(
    tmp_path, monkeypatch
):
    """On an attached device every compile is timed; the fastest batch by
    the model (16 per device, the largest) is measured slower than 8 per
    device, so the rung below it is compiled, timed and chosen; the rung
    below 8 is compiled too and, slower, ends the descent."""
    result, compiled, timed = searched_with_measured_times(
        tmp_path, monkeypatch, {16: 2.0}
    )
    assert timed and set(timed) == {TIMED_STEPS}
    assert set(compiled) == {4, 8, 16}
    assert result.chosen.candidate.per_device_batch == 8
    assert result.chosen.cost.source == "measured"
    assert "measured on this machine's devices" in str(result)
    assert compiled[16].why.startswith("fits, 0.67x the chosen one's tokens/s")
    assert compiled[4].why.startswith("fits, 0.67x the chosen one's tokens/s")


def test_the_search_descends_while_each_rung_below_is_faster(tmp_path, monkeypatch):
    """Measured, each smaller batch down to 4 per device is faster (as
    Qwen 2.5 0.5B on a v5e: 16, 8 and 4 per device ran 30,707, 31,810 and
    32,080 tokens/s); 2 per device is slower again. The search descends to
    4, compiles 2 to know it, and stops there: 1 is never compiled."""
    # The stand-in's seconds per token fall with the batch: (1 + 8 / rows).
    # Measured: 16 -> 3.75, 8 -> 3.2, 4 -> 3.0, 2 -> 5.0 (x 1e-6).
    result, compiled, _ = searched_with_measured_times(
        tmp_path, monkeypatch, {16: 2.5, 8: 1.6}
    )
    assert result.chosen.candidate.per_device_batch == 4
    assert set(compiled) == {2, 4, 8, 16}
    assert all(
        e.stage != COMPILED for e in result.entries if e.candidate.per_device_batch == 1
    )


def test_the_search_runs_nothing_where_the_device_is_not_attached(
    tmp_path, compiler, monkeypatch
):
    timed = []
    stand_in = search_module.compiled_memory

    def recorded(*args, **kwargs):
        timed.append(kwargs["timed_steps"])
        return stand_in(*args, **kwargs)

    monkeypatch.setattr(search_module, "compiled_memory", recorded)
    result = search_tiny_gemma(tmp_path, per_device_batch=(1, 16), remats=(None,))
    assert timed and set(timed) == {0}
    assert "measured" not in str(result)


def test_a_run_of_several_processes_times_nothing(monkeypatch):
    """Each process would time its own runs, and processes that chose by
    different times would run different programs."""
    import jax

    from keras_hub_autodist.fitting import compile_targets

    monkeypatch.setattr(
        compile_targets, "_local_devices_of", lambda spec, count: ("a device",)
    )
    assert compile_targets.attached("v5e", 1)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    assert not compile_targets.attached("v5e", 1)


def test_a_step_the_device_cannot_hold_when_run_is_said_refused(
    tiny_presets_dir, monkeypatch
):
    from keras_hub_autodist.fitting import compiled_step

    plan = keras_hub_autodist.plan(tiny_presets_dir["gemma_mqa"], MESH)
    refusal = "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 2.00G"

    def out_of_memory(*args):
        raise RuntimeError(refusal)

    monkeypatch.setattr(compiled_step, "timed_step_seconds", out_of_memory)
    memory = compiled_memory(plan, 8, 32, timed_steps=2)
    assert memory.out_of_memory == refusal
    assert "measured_seconds" not in memory.cost
    assert memory.fits is False

    def broken(*args):
        raise ValueError("not about memory")

    monkeypatch.setattr(compiled_step, "timed_step_seconds", broken)
    with pytest.raises(ValueError, match="not about memory"):
        compiled_memory(plan, 8, 32, timed_steps=2)
