"""The layout search never dies on one candidate and never drops what the
user asked: a candidate that fails to compile is a row with its reason;
the strategy, remat and context-parallel strategy asked for bound every
candidate, the rule's included; every flag of `--search` is used or
refused; the compile cache heals bad entries, survives an unusable folder,
reads its switch as the package's other switches and is keyed by the
package's code; the GPU compiler missing or JAX started without it; and
arguments of the wrong kind named up front.

Most tests replace the compiler (`search.compiled_memory`) by a stand-in
that answers from the layout: what is under test is the search's
bookkeeping, not XLA."""

import dataclasses
import json
import os
import subprocess
import sys
import types
import warnings

import pytest
from search_stand_ins import TINY_GEMMA
from search_stand_ins import stand_in_memory

from keras_hub_autodist import cli
from keras_hub_autodist.environment import read_folder_switch
from keras_hub_autodist.errors import CompilerMissingError
from keras_hub_autodist.errors import PlanError
from keras_hub_autodist.errors import TargetCompileError
from keras_hub_autodist.planning.options import PlanOptions
from keras_hub_autodist.searching import cache as search_cache
from keras_hub_autodist.searching import search as search_module
from keras_hub_autodist.searching.report import to_json
from keras_hub_autodist.searching.search import COMPILED
from keras_hub_autodist.searching.search import FAILED
from keras_hub_autodist.searching.search import NOT_COMPILED
from keras_hub_autodist.searching.search import search
from keras_hub_autodist.searching.step_inputs import CompiledStepInputs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def compiler(monkeypatch):
    """The stand-in compiler; `calls` lists each layout it was asked for,
    `fail` the (strategy, mesh) pairs it refuses, and how."""
    state = types.SimpleNamespace(calls=[], fail=[])

    def compiled_memory(layout, batch_size, sequence_length, optimizer, **kwargs):
        mesh = dict(zip(layout.mesh_axes.axis_names, layout.mesh_axes.shape))
        state.calls.append(layout)
        for strategy, shape, error in state.fail:
            if strategy == layout.strategy and all(
                mesh.get(k, 1) == v for k, v in shape.items()
            ):
                raise error
        return stand_in_memory(layout, batch_size, sequence_length, optimizer)

    monkeypatch.setattr(search_module, "compiled_memory", compiled_memory)
    return state


def _search(tmp_path, **kwargs):
    arguments = dict(
        device="v5e",
        devices=4,
        batch_size=4,
        sequence_length=32,
        max_compiles=2,
        cache_dir=tmp_path / "compiles",
    )
    arguments.update(kwargs)
    return search(TINY_GEMMA, **arguments)


def test_a_candidate_that_fails_to_compile_is_a_row_and_the_search_goes_on(
    tmp_path, compiler
):
    # The rule's choice (compiled first) and one more fail, each for its
    # own reason; the search compiles others in their place.
    mosaic = TargetCompileError(
        "Mosaic failed to compile the splash kernel for TPU v3\nmore"
    )
    compiler.fail.append(("tp", {"batch": 4}, mosaic))
    compiler.fail.append(("fsdp", {"batch": 2, "model": 2}, ValueError("a sharding")))
    result = _search(tmp_path)
    failed = [e for e in result.entries if e.stage == FAILED]
    assert {e.candidate.label() for e in failed} >= {"batch=4,model=1 tp"}
    words = {e.error for e in failed}
    assert "Mosaic failed to compile the splash kernel for TPU v3" in words
    assert all("does not compile: " + e.error == e.why for e in failed)
    # Those that failed don't count against `max_compiles`: as many compile
    # as if none had failed, or are implied by a compile (the slower,
    # rematerialized twin of a layout that compiled and fits).
    compiled = [e for e in result.entries if e.stage == COMPILED]
    fitting = {dataclasses.replace(e.candidate, remat=None) for e in compiled if e.fits}
    implied = [
        e
        for e in result.entries
        if e.stage == NOT_COMPILED
        and e.candidate.remat
        and dataclasses.replace(e.candidate, remat=None) in fitting
    ]
    assert 2 <= len(compiled) == result.compiles <= 3
    assert len(compiled) + len(implied) >= 3
    assert result.chosen.stage == COMPILED and result.chosen.fits
    answer = json.loads(json.dumps(to_json(result)))
    rows = [c for c in answer["candidates"] if c["stage"] == FAILED]
    assert rows and all(r["compile_error"] for r in rows)
    assert "| failed |" in str(result)


def test_no_candidate_compiling_is_the_packages_error(tmp_path, compiler):
    compiler.fail.append(("tp", {}, RuntimeError("no kernel for this device")))
    compiler.fail.append(("fsdp", {}, RuntimeError("no kernel for this device")))
    with pytest.raises(TargetCompileError, match="No layout of the step compiles"):
        _search(tmp_path)
    # Tried twice as many as `max_compiles` asks for, and the rule's, then
    # given up: the same failure each time.
    assert len(compiler.calls) == 2 * (2 + 1)
    # A missing compiler is no candidate's failure: it ends the search.
    compiler.calls.clear()
    compiler.fail[:] = [("tp", {}, CompilerMissingError("install the extra"))]
    with pytest.raises(CompilerMissingError):
        _search(tmp_path)
    assert len(compiler.calls) == 1


@pytest.mark.parametrize(
    "asked",
    [
        dict(strategies=("fsdp",), remats=("full",)),
        dict(strategies=("tp",), remats=("full",)),
        dict(strategies=("tp", "fsdp"), remats=("full",)),
        dict(strategies=("fsdp",), remats=(None,)),
    ],
)
def test_every_candidate_has_the_strategy_and_remat_asked_for(
    tmp_path, compiler, asked
):
    result = _search(tmp_path, **asked)
    for entry in result.entries:
        assert entry.candidate.strategy in asked["strategies"], entry.candidate
        assert entry.candidate.remat in asked["remats"], entry.candidate
    assert result.rule_choice.candidate.remat in asked["remats"]
    for layout in compiler.calls:
        assert layout.strategy in asked["strategies"]
        assert layout.remat in asked["remats"]


def test_the_context_parallel_strategy_is_that_of_every_compile(tmp_path, compiler):
    _search(tmp_path, context_parallel_strategy="ring", devices=2, batch_size=1)
    assert compiler.calls
    assert {layout.context_parallel_strategy for layout in compiler.calls} == {"ring"}
    # It is part of a compile's key: a ring step is never served for another.
    layout = compiler.calls[0]
    other = layout.replace(context_parallel_strategy="all_gather")
    key = search_cache.compile_key(layout, TINY_GEMMA["config"], 1, 32, "adam", "v5e")
    assert key != search_cache.compile_key(
        other, TINY_GEMMA["config"], 1, 32, "adam", "v5e"
    )


def test_from_preset_loads_the_layout_compiled_with_the_options_asked(
    tiny_presets_dir, tmp_path, monkeypatch, compiler
):
    from keras_hub_autodist.searching import auto_mesh as auto_search

    monkeypatch.setattr(auto_search, "FROM_PRESET_SEQUENCE", 32)
    monkeypatch.setenv(search_cache.COMPILE_CACHE_ENV, str(tmp_path))
    v5e = types.SimpleNamespace(platform="tpu", device_kind="TPU v5 lite")
    asked = PlanOptions(strategy="fsdp", remat="full")
    mesh, options, _ = auto_search.searched_layout(
        tiny_presets_dir["gemma_mqa"], "auto", asked, [v5e] * 4
    )
    assert (options.strategy, options.remat) == ("fsdp", "full")
    loaded = {(tuple(sorted(mesh.items())), options.strategy, options.remat)}
    compiled = {
        (
            tuple(sorted(zip(c.mesh_axes.axis_names, c.mesh_axes.shape))),
            c.strategy,
            c.remat,
        )
        for c in compiler.calls
    }
    assert loaded <= compiled


def _search_args(*extra):
    return ["plan", "./p", "--device", "v5e", "--devices", "4", "--batch", "4"] + [
        "--seq",
        "32",
        "--search",
        *extra,
    ]


@pytest.mark.parametrize("flag", ["--batch-axis", "--model-axis", "--context-axis"])
def test_search_refuses_the_axis_flags_it_cannot_use(flag, capsys):
    assert cli.main(_search_args(flag, "data")) == 2
    error = capsys.readouterr().err
    assert f"drop {flag}" in error and f"Received: {flag} data" in error


def test_search_passes_every_flag_it_takes(monkeypatch):
    asked = {}

    def fake_search(*args, **kwargs):
        asked.update(kwargs, args=args)
        raise PlanError("stop here")

    monkeypatch.setattr(search_module, "search", fake_search)
    argv = _search_args(
        "--context-parallel-strategy", "ring", "--strategy", "fsdp", "--remat", "full"
    )
    argv += ["--dtype", "bfloat16", "--optimizer", "sgd", "--lora-rank", "2"]
    assert cli.main(argv) == 2
    assert asked["context_parallel_strategy"] == "ring"
    assert asked["strategies"] == ("fsdp",) and asked["remats"] == ("full",)
    assert asked["dtype"] == "bfloat16" and asked["optimizer"] == "sgd"
    assert asked["args"][1:] == ("v5e", 4, 4, 32, 2)


def test_search_from_the_command_line_starts_jax_on_the_cpu(monkeypatch):
    # Without an accelerator, `--search` sets JAX up as `--compiled` does:
    # on the CPU, so that the GPU compiler's plugin is not started as a
    # backend on a machine without a GPU.
    from keras_hub_autodist import devices

    seen = {}
    monkeypatch.setattr(devices, "has_accelerator", lambda: False)
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.setattr(cli, "_run_plan", lambda args: seen.update(os.environ) or 0)
    assert cli.main(_search_args()) == 0
    assert seen["JAX_PLATFORMS"] == "cpu"


@pytest.mark.skipif(
    search_cache.versions()["jax-cuda12-plugin"] == "",
    reason="the GPU compiler is not installed: keras-hub-autodist[gpu-compile]",
)
def test_a_gpu_target_compiles_from_python_without_jax_platforms():
    # A fresh process in which JAX started without the CUDA plugin (its
    # check of CUDA's libraries fails without a GPU).
    code = (
        "import jax; jax.devices()\n"
        "from keras_hub_autodist.fitting.compile_targets import compile_target\n"
        "print(compile_target('t4', 2).device_kind)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "Tesla T4"
    assert "JAX_SKIP_CUDA_CONSTRAINTS_CHECK" not in env


def test_a_missing_gpu_compiler_names_its_extra(monkeypatch):
    from keras_hub_autodist.fitting import compile_targets

    # As without the extra: no `jax_plugins` package at all.
    monkeypatch.setitem(sys.modules, "jax_plugins", None)
    monkeypatch.delitem(sys.modules, "jax_plugins.xla_cuda12", raising=False)
    compile_targets._gpu_devices.cache_clear()
    try:
        with pytest.raises(CompilerMissingError, match=r"keras-hub-autodist\[gpu"):
            compile_targets.compile_target("t4", 3)
    finally:
        compile_targets._gpu_devices.cache_clear()


@pytest.mark.parametrize(
    "wrong, named",
    [
        (dict(devices="8"), "devices="),
        (dict(devices=True), "devices="),
        (dict(sequence_length="32"), "sequence_length="),
        (dict(sequence_length=0), "sequence_length="),
        (dict(batch_size="4"), "batch_size="),
        (dict(device=5), "device="),
        (dict(lora_rank="4"), "lora_rank="),
        (dict(optimizer="adamw2"), "optimizer="),
        (dict(strategies="tp"), "strategies="),
        (dict(strategies=("tp", "zero")), "strategies="),
        (dict(remats="full"), "remats="),
        (dict(remats=()), "remats="),
        (dict(max_compiles=1.5), "max_compiles="),
        (dict(cache_dir=3), "cache_dir="),
        (dict(context_parallel_strategy="rings"), "context_parallel_strategy="),
        (dict(dtype=16), "dtype="),
    ],
)
def test_arguments_of_the_wrong_kind_are_named_up_front(
    tmp_path, monkeypatch, wrong, named
):
    import keras_hub_autodist.searching.search as module

    def never(*args, **kwargs):
        raise AssertionError("planned before the arguments were checked")

    monkeypatch.setattr(module, "read_config", never)
    with pytest.raises(PlanError, match=f"Received: {named}"):
        _search(tmp_path, **wrong)
    with pytest.raises(PlanError, match="Received: preset="):
        search(3, "v5e", 4, 4, 32)


def _plan():
    from keras_hub_autodist.fitting.planner import plan

    return plan(TINY_GEMMA, {"batch": 4, "model": 1}, device_memory="v5e")


@pytest.mark.parametrize(
    "stored",
    [
        [1, 2],
        "text",
        None,
        {"format": 1, "key": "KEY", "memory": [1]},
        {"format": 1, "key": "KEY", "memory": "MEMORY", "peak": "x"},
        {"format": 1, "key": "KEY", "memory": "MEMORY", "collectives": [[1]]},
        {"format": 1, "key": "KEY", "memory": "MEMORY", "cost": {"flops": "x"}},
        {"format": 1, "key": "KEY", "memory": "MEMORY", "peak": True},
    ],
)
def test_a_bad_cache_entry_is_a_miss_and_is_rewritten(tmp_path, stored):
    layout = _plan()
    key = search_cache.compile_key(layout, TINY_GEMMA["config"], 4, 32, "adam", "v5e")
    good = stand_in_memory(layout, 4, 32)
    if isinstance(stored, dict):
        memory = search_cache.memory_to_json(good)
        if "peak" in stored:
            memory["peak_bytes"] = stored.pop("peak")
        if "collectives" in stored:
            memory["collectives"] = stored.pop("collectives")
        if "cost" in stored:
            memory["cost"] = stored.pop("cost")
        stored = {**stored, "key": key}
        if stored["memory"] == "MEMORY":
            stored["memory"] = memory
    path = tmp_path / f"{key}.json"
    path.write_text(json.dumps(stored))
    assert search_cache.read_compile(tmp_path, key) is None
    compiled = []

    def compile_again(*args, **kwargs):
        compiled.append(args)
        return good

    import keras_hub_autodist.searching.search as module

    original = module.compiled_memory
    module.compiled_memory = compile_again
    try:
        inputs = CompiledStepInputs(
            layout, TINY_GEMMA["config"], 4, 32, "adam", "v5e", None, None
        )
        memory, hit = module._compile(inputs, tmp_path)
    finally:
        module.compiled_memory = original
    assert (memory, hit, len(compiled)) == (good, False, 1)
    assert search_cache.read_compile(tmp_path, key) == good


def test_a_cache_folder_that_is_a_file_means_no_cache_and_one_warning(
    tmp_path, compiler
):
    blocker = tmp_path / "compiles"
    blocker.write_text("mine")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = _search(tmp_path, cache_dir=blocker)
    said = [str(w.message) for w in caught if "compile cache" in str(w.message)]
    assert len(said) == 1 and "it is a file" in said[0]
    assert result.chosen.fits and result.cache_hits == 0
    assert blocker.read_text() == "mine"


def test_the_compile_cache_switch_reads_as_the_package_switches(tmp_path, monkeypatch):
    for on in ("1", "on", " TRUE "):
        monkeypatch.setenv(search_cache.COMPILE_CACHE_ENV, on)
        folder = search_cache.compile_cache_folder()
        assert folder is not None and folder.name == "compiles", on
        assert folder.is_absolute()
    for off in ("0", "off", "No"):
        monkeypatch.setenv(search_cache.COMPILE_CACHE_ENV, off)
        assert search_cache.compile_cache_folder() is None, off
    monkeypatch.setenv(search_cache.COMPILE_CACHE_ENV, str(tmp_path / "mine"))
    assert search_cache.compile_cache_folder() == tmp_path / "mine"
    # "On" keeps a default even with the package's disk cache off.
    monkeypatch.setenv("KERAS_HUB_AUTODIST_CACHE", "off")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv(search_cache.COMPILE_CACHE_ENV, "1")
    assert search_cache.compile_cache_folder() == (
        tmp_path / "xdg" / "keras_hub_autodist" / "compiles"
    )
    monkeypatch.delenv(search_cache.COMPILE_CACHE_ENV)
    assert search_cache.compile_cache_folder() is None
    assert read_folder_switch("X", {"X": "yes"}) == (True, "")
    assert read_folder_switch("X", {}) == (None, "")


def test_the_key_changes_with_the_packages_code(tmp_path, monkeypatch):
    package = tmp_path / "keras_hub_autodist"
    (package / "searching").mkdir(parents=True)
    step = package / "attention" / "splash_attention.py"
    step.parent.mkdir()
    step.write_text("KERNEL = 'xla'\n")
    monkeypatch.setattr(
        search_cache, "__file__", str(package / "searching" / "cache.py")
    )
    before = search_cache.code_digest.__wrapped__()
    step.write_text("KERNEL = 'splash'\n")
    after = search_cache.code_digest.__wrapped__()
    assert before != after
    monkeypatch.undo()
    # The key holds it.
    layout = _plan()

    def key():
        return search_cache.compile_key(
            layout, TINY_GEMMA["config"], 4, 32, "adam", "v5e"
        )

    first = key()
    monkeypatch.setattr(search_cache, "code_digest", lambda: before)
    assert key() != first


def test_a_remat_layout_whose_twin_without_remat_fits_is_not_compiled(
    tmp_path, compiler
):
    # Remat only adds recomputation: once a layout fits by its compile, the
    # same layout with remat can't be chosen, and its compile is skipped.
    result = _search(tmp_path, max_compiles=6)
    fitted = set()
    for layout in compiler.calls:
        shape = tuple(zip(layout.mesh_axes.axis_names, layout.mesh_axes.shape))
        assert layout.remat is None or (shape, layout.strategy) not in fitted
        if layout.remat is None:
            fitted.add((shape, layout.strategy))
    skipped = [
        e
        for e in result.entries
        if e.candidate.remat == "full"
        and e.stage != COMPILED
        and any(
            t.stage == COMPILED
            and t.candidate.key()[:2] == e.candidate.key()[:2]
            and t.candidate.remat is None
            for t in result.entries
        )
    ]
    assert skipped and result.chosen.candidate.remat is None


def test_from_preset_names_the_searched_axes_as_the_call_does(
    tiny_presets_dir, tmp_path, monkeypatch, compiler
):
    from keras_hub_autodist.searching import auto_mesh as auto_search

    monkeypatch.setattr(auto_search, "FROM_PRESET_SEQUENCE", 32)
    monkeypatch.setenv(search_cache.COMPILE_CACHE_ENV, str(tmp_path))
    v5e = types.SimpleNamespace(platform="tpu", device_kind="TPU v5 lite")
    asked = PlanOptions(batch_axis="data", model_axis="tensor", context_axis="seq")
    mesh, options, _ = auto_search.searched_layout(
        tiny_presets_dir["gemma_mqa"], "auto", asked, [v5e] * 4
    )
    assert set(mesh) <= {"data", "tensor", "seq"} and "data" in mesh
    assert (options.batch_axis, options.model_axis) == ("data", "tensor")


def test_the_chosen_layout_is_one_its_compile_shows_to_fit(
    tmp_path, compiler, monkeypatch
):
    # The first compiles (the rule's choice and the fastest by the closed
    # form) don't fit; later ones would. The search stops its first pass
    # at 2 x max_compiles without a fit, then compiles the layout ranked
    # first on the closed form alone before choosing it.
    first_pass = []
    compiled_memory = search_module.compiled_memory

    def too_large_at_first(layout, batch_size, *args, **kwargs):
        memory = compiled_memory(layout, batch_size, *args, **kwargs)
        first_pass.append(layout)
        if len(first_pass) <= 3:
            return dataclasses.replace(memory, peak_bytes=10**15)
        return memory

    monkeypatch.setattr(search_module, "compiled_memory", too_large_at_first)
    result = _search(tmp_path, max_compiles=1)
    assert len(first_pass) > 3
    assert result.chosen.stage == COMPILED and result.chosen.fits
    assert result.chosen.compiled.peak_bytes < 10**15
