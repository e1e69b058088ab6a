"""The compile cache's key holds every input of the compiled step, taken
from the one place that gathers them (`step_inputs.CompiledStepInputs`):
each field, each field of the plan, each setting of the environment changes
the key, and the search compiles from exactly those inputs. A search in
mixed precision after one in float32 compiles again, and the abstract
builds kept on disk are keyed by Keras' global dtype policy."""

import contextlib
import dataclasses
import inspect
import os

import keras
import pytest
from search_stand_ins import TINY_GEMMA
from search_stand_ins import stand_in_memory

from keras_hub_autodist.attention import attention_blocks
from keras_hub_autodist.fitting import compiled_step
from keras_hub_autodist.fitting.planner import plan
from keras_hub_autodist.loss import chunks
from keras_hub_autodist.planning import abstract
from keras_hub_autodist.planning.plan_record import PlanRecord
from keras_hub_autodist.searching import cache
from keras_hub_autodist.searching import search as search_module
from keras_hub_autodist.searching import step_inputs
from keras_hub_autodist.searching.search import search
from keras_hub_autodist.searching.step_inputs import CompiledStepInputs

MESH = {"batch": 2, "model": 2}


@pytest.fixture(scope="module")
def layout():
    return plan(TINY_GEMMA, MESH, strategy="tp")


def _inputs(layout, **changes):
    fields = dict(
        plan=layout,
        config=TINY_GEMMA["config"],
        batch_size=4,
        sequence_length=32,
        optimizer="adam",
        device="v5e",
    )
    fields.update(changes)
    return CompiledStepInputs(**fields)


# A changed value of each input of a step (but `preset`, which `config`
# stands for): a new field of `CompiledStepInputs` must be added here, and so
# be shown to change the key.
INPUT_CHANGES = {
    "plan": lambda layout: layout.replace(strategy="fsdp"),
    "config": lambda layout: dict(TINY_GEMMA["config"], num_layers=3),
    "batch_size": lambda layout: 8,
    "sequence_length": lambda layout: 64,
    "optimizer": lambda layout: "sgd",
    "device": lambda layout: "v6e",
    "lora_rank": lambda layout: 4,
    "gradient_accumulation_steps": lambda layout: 4,
    "timed_steps": lambda layout: 5,
    "environment": lambda layout: {
        **step_inputs.step_environment("v5e"),
        "dtype_policy": "mixed_bfloat16",
    },
}
# A changed value of each field of a plan that shapes the step; the others
# only explain it (`DESCRIPTIVE_PLAN_FIELDS`).
PLAN_CHANGES = {
    "backbone_class": "LlamaBackbone",
    "architecture": "llama",
    "mesh_axes": lambda axes: dataclasses.replace(axes, batch_axis="model"),
    "strategy": "fsdp",
    "dtype": "bfloat16",
    "rows": lambda rows: rows[:-1],
    "device_memory_bytes": lambda size: size + 1,
    "config_fields": lambda fields: {**fields, "extra": "x"},
    "context_parallel_strategy": "ring",
    "sequence_parallel": True,
    "sequence_parallel_outputs": ("decoder_block",),
    "lora_rank": 4,
    "device_name": "v6e",
    "remat": "full",
    "final_logit_soft_cap": 30.0,
    "mixed_policy": "mixed_bfloat16",
}


def _changed(value, change):
    return change(value) if callable(change) else change


def test_every_input_of_the_step_is_in_its_key(layout):
    fields = {field.name for field in dataclasses.fields(CompiledStepInputs)}
    assert set(INPUT_CHANGES) == fields - {"preset"}
    key = cache.step_key(_inputs(layout))
    for name, change in INPUT_CHANGES.items():
        assert cache.step_key(_inputs(layout, **{name: change(layout)})) != key, name
    # `preset` is read again to build the step; `config` is what it holds.
    assert cache.step_key(_inputs(layout, preset="./elsewhere")) == key


def test_every_field_of_the_plan_that_shapes_the_step_is_in_its_key(layout):
    fields = {field.name for field in dataclasses.fields(PlanRecord)}
    assert set(PLAN_CHANGES) == fields - set(step_inputs.DESCRIPTIVE_PLAN_FIELDS)
    key = cache.step_key(_inputs(layout))
    for name, change in PLAN_CHANGES.items():
        changed = layout.replace(**{name: _changed(getattr(layout, name), change)})
        assert cache.step_key(_inputs(changed)) != key, name
    for name in step_inputs.DESCRIPTIVE_PLAN_FIELDS:
        changed = layout.replace(**{name: "other words"})
        assert cache.step_key(_inputs(changed)) == key, name


@contextlib.contextmanager
def _keras_setting(set_value, get_value, value):
    previous = get_value()
    set_value(value)
    try:
        yield
    finally:
        set_value(previous)


@contextlib.contextmanager
def _jax_setting(name, value):
    import jax

    previous = getattr(jax.config, name)
    jax.config.update(name, value)
    try:
        yield
    finally:
        jax.config.update(name, previous)


@contextlib.contextmanager
def _patched(*args):
    with pytest.MonkeyPatch.context() as patch:
        (patch.setitem if isinstance(args[0], dict) else patch.setattr)(*args)
        yield


@contextlib.contextmanager
def _environment_variable(name, value):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(name, value)
        yield


# Each setting the step's build reads from the process, changed.
ENVIRONMENT_CHANGES = {
    "dtype policy": lambda: _keras_setting(
        keras.config.set_dtype_policy, keras.config.dtype_policy, "mixed_bfloat16"
    ),
    "floatx": lambda: _keras_setting(
        keras.config.set_floatx, keras.config.floatx, "float16"
    ),
    **{
        name: lambda name=name: _environment_variable(name, "--a_flag=1")
        for name in step_inputs.COMPILER_FLAGS
    },
    **{
        name: lambda name=name, value=value: _jax_setting(name, value)
        for name, value in (
            ("jax_default_matmul_precision", "highest"),
            ("jax_enable_x64", True),
        )
    },
    "attention rule": lambda: _patched(attention_blocks, "XLA_SCORES_MAX_BYTES", 16),
    "kernel per platform": lambda: _patched(
        attention_blocks.PLATFORM_KERNELS, "tpu", "blockwise"
    ),
    "loss chunks": lambda: _patched(chunks, "FEWEST_CHUNKS", 8),
    "versions": lambda: _patched(cache, "versions", lambda: {"jax": "0.0.0"}),
    "package code": lambda: _patched(cache, "code_digest", lambda: "other code"),
}


def test_every_setting_the_build_reads_is_in_the_key(layout):
    assert set(step_inputs.JAX_SETTINGS) <= set(ENVIRONMENT_CHANGES)

    def key():
        return cache.compile_key(layout, TINY_GEMMA["config"], 4, 32, "adam", "v5e")

    before = key()
    for name, change in ENVIRONMENT_CHANGES.items():
        with change():
            assert key() != before, name
        assert key() == before, name


def test_the_search_compiles_from_the_inputs_its_key_names(layout, tmp_path):
    # Every argument of `compiled_memory` is an input of the key, or one the
    # search leaves at its default.
    left_at_default = {"model_class", "device_mesh"}
    parameters = list(inspect.signature(compiled_step.compiled_memory).parameters)
    args, kwargs = _inputs(layout).compile_arguments()
    passed = set(parameters[: len(args)]) | set(kwargs)
    assert passed | left_at_default == set(parameters)
    assert not passed & left_at_default
    assert {"plan", "batch_size", "sequence_length", "optimizer"} <= passed
    for name in passed - {"preset"}:
        assert name in {f.name for f in dataclasses.fields(CompiledStepInputs)}
    # ... and the search hands it exactly those.
    asked = []

    def compiled_memory(*args, **kwargs):
        asked.append((args, kwargs))
        return stand_in_memory(args[0], args[1], args[2])

    inputs = _inputs(layout, lora_rank=2, preset="p")
    original = search_module.compiled_memory
    search_module.compiled_memory = compiled_memory
    try:
        search_module._compile(inputs, tmp_path)
    finally:
        search_module.compiled_memory = original
    assert asked == [inputs.compile_arguments()]
    assert search_module.cache.read_compile(tmp_path, cache.step_key(inputs))


def test_a_mixed_precision_search_after_a_float32_one_compiles_again(
    tmp_path, monkeypatch
):
    compiled = []

    def compiled_memory(layout, batch_size, sequence_length, optimizer, **kwargs):
        compiled.append(layout)
        return stand_in_memory(layout, batch_size, sequence_length, optimizer)

    monkeypatch.setattr(search_module, "compiled_memory", compiled_memory)
    arguments = dict(
        device="v5e",
        devices=4,
        batch_size=4,
        sequence_length=32,
        max_compiles=2,
        remats=(None,),
        cache_dir=tmp_path,
    )
    first = search(TINY_GEMMA, dtype="float32", **arguments)
    assert first.cache_hits == 0 and compiled
    assert {layout.mixed_policy for layout in compiled} == {""}
    compiled.clear()
    mixed = search(TINY_GEMMA, dtype="mixed_bfloat16", **arguments)
    assert mixed.cache_hits == 0
    assert compiled and {layout.mixed_policy for layout in compiled} == {
        "mixed_bfloat16"
    }
    # Asked again, each is served from the cache.
    again = search(TINY_GEMMA, dtype="float32", **arguments)
    assert again.cache_hits == again.compiles == first.compiles


def test_an_abstract_build_on_disk_is_keyed_by_the_global_dtype_policy(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("KERAS_HUB_AUTODIST_CACHE", str(tmp_path))
    backbone = __import__("keras_hub").models.GemmaBackbone
    config = dict(TINY_GEMMA["config"])  # no dtype: built in the global policy
    policy = keras.config.dtype_policy()
    abstract.clear_cache()
    try:
        built = abstract.model_variables(backbone, config)
        assert {weight.dtype for weight in built} == {"float32"}
        assert os.listdir(tmp_path)
        abstract.clear_cache()  # a later process: only the disk remembers
        keras.config.set_dtype_policy("bfloat16")
        built = abstract.model_variables(backbone, config)
        assert {weight.dtype for weight in built} == {"bfloat16"}
        stored = abstract.stored_variables("GemmaBackbone", config)
        assert {weight.dtype for weight in stored} == {"bfloat16"}
    finally:
        keras.config.set_dtype_policy(policy)
        abstract.clear_cache()
