"""The layout search (`searching.search`): candidates, pruning, the step-time
model, the compile cache, the report and its JSON, the CLI, and the stored
reference points (bench/layout_searches/, made by `python -m
bench.layout_search` on real configs; read here, not compiled again).

Target compiles are of a tiny model, for a TPU v5e and a T4 (libtpu and the
JAX CUDA plugin compile for them on this CPU-only machine)."""

import dataclasses
import importlib.util
import json
import pathlib
import types

import pytest
from search_stand_ins import TILED_GEMMA

from keras_hub_autodist import cli
from keras_hub_autodist.errors import PlanError
from keras_hub_autodist.fitting.compiled_analysis import Collective
from keras_hub_autodist.fitting.compiled_step import CompiledMemory
from keras_hub_autodist.fitting.device_profiles import DeviceSpeed
from keras_hub_autodist.fitting.hlo_cost import group_size
from keras_hub_autodist.fitting.hlo_cost import hlo_cost
from keras_hub_autodist.fitting.hlo_cost import link_bytes
from keras_hub_autodist.planning.options import PlanOptions
from keras_hub_autodist.searching import cache as search_cache
from keras_hub_autodist.searching import step_cost
from keras_hub_autodist.searching.auto_mesh import local_device_name
from keras_hub_autodist.searching.auto_mesh import searched_layout
from keras_hub_autodist.searching.report import to_json
from keras_hub_autodist.searching.search import COMPILED
from keras_hub_autodist.searching.search import PRUNED
from keras_hub_autodist.searching.search import Candidate
from keras_hub_autodist.searching.search import candidates
from keras_hub_autodist.searching.search import meshes
from keras_hub_autodist.searching.search import search

HAS_TPU_COMPILER = importlib.util.find_spec("libtpu") is not None
HAS_GPU_COMPILER = importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
needs_compilers = pytest.mark.skipif(
    not (HAS_TPU_COMPILER and HAS_GPU_COMPILER),
    reason="the TPU and GPU compilers are not installed: pip install "
    "keras-hub-autodist[tpu-compile,gpu-compile]",
)
STORED = pathlib.Path(__file__).resolve().parent.parent / "bench" / "layout_searches"
ENTRY_KEYS = {
    "mesh",
    "strategy",
    "remat",
    "batch_size",
    "compiled_peak_bytes_per_device",
    "fits",
    "modelled_step_seconds",
    "why",
}


@pytest.fixture(scope="module")
def v5e_search(tmp_path_factory):
    """One search of the tiny Gemma on a v5e x 4, and a second from its
    cache."""
    cache = tmp_path_factory.mktemp("compiles")
    arguments = dict(
        device="v5e",
        devices=4,
        batch_size=4,
        sequence_length=64,
        max_compiles=1,
        cache_dir=cache,
    )
    return search(TILED_GEMMA, **arguments), search(TILED_GEMMA, **arguments)


def test_candidates_span_batch_model_and_context_axes():
    found = meshes(8, 8, 2048)
    assert {"batch": 8, "model": 1} in found
    assert {"batch": 1, "model": 2, "context": 4} in found
    assert all(m["batch"] * m["model"] * m.get("context", 1) == 8 for m in found)
    # A batch axis divides the batch; a context axis the sequence.
    assert all(m["batch"] <= 2 for m in meshes(8, 2, 2048))
    assert all(m.get("context", 1) <= 2 for m in meshes(8, 8, 6))
    # An expert axis in the model axis' place for a mixture of experts.
    assert {"batch": 1, "expert": 8} in meshes(8, 1, 16, experts=True)
    layouts = candidates(8, 8, 2048)
    assert all(c.strategy == "tp" for c in layouts if c.mesh["batch"] == 1)
    assert {c.remat for c in layouts} == {None, "dots", "full"}
    assert len(set(layouts)) == len(layouts)


def test_the_roofline_adds_what_the_link_does_not_hide():
    pcie = DeviceSpeed(1e12, 1e11, 1e10, "pcie", "")
    cost = step_cost.roofline(2e12, 1e11, 3e10, pcie)
    assert (cost.compute_seconds, cost.memory_seconds, cost.link_seconds) == (
        2.0,
        1.0,
        3.0,
    )
    assert cost.seconds == 5.0  # nothing hidden over PCIe
    ici = dataclasses.replace(pcie, link="ici")
    half = step_cost.COLLECTIVE_OVERLAP["ici"]
    assert step_cost.roofline(2e12, 1e11, 3e10, ici).seconds == pytest.approx(
        max(2.0, half * 3.0) + (1 - half) * 3.0
    )
    # Memory-bound: the longer of compute and memory traffic.
    assert step_cost.roofline(1e12, 5e11, 0, pcie).seconds == 5.0


def _program(**cost) -> CompiledMemory:
    return CompiledMemory(
        argument_bytes=1,
        output_bytes=0,
        alias_bytes=0,
        temp_bytes=0,
        generated_code_bytes=0,
        peak_bytes=1,
        batch_size=1,
        sequence_length=1,
        optimizer="adam",
        devices=2,
        platform="gpu",
        cost=cost,
        collectives=(Collective("all-reduce", 1, 8),),
    )


def test_a_compiled_program_costs_its_roofline_or_the_compilers_estimate():
    speed = DeviceSpeed(1e12, 1e11, 1e10, "pcie", "")
    counted = step_cost.compiled_cost(
        _program(flops=4e12, bytes_accessed=1e11, link_bytes=1e10), speed
    )
    assert (counted.seconds, counted.source) == (5.0, "roofline")
    estimated = step_cost.compiled_cost(
        _program(flops=4e12, optimal_seconds=0.5), speed
    )
    assert (estimated.seconds, estimated.source) == (0.5, "xla")
    # Never faster than the device's peak on the flops the step must
    # compute: XLA counts none inside a custom call (the splash kernel).
    floored = step_cost.compiled_cost(
        _program(flops=4e12, optimal_seconds=0.5), speed, least_flops=2e12
    )
    assert (floored.seconds, floored.source) == (2.0, "model flops")
    kept = step_cost.compiled_cost(
        _program(flops=4e12, optimal_seconds=0.5), speed, least_flops=2e11
    )
    assert (kept.seconds, kept.source) == (0.5, "xla")


def test_flops_bytes_and_link_bytes_are_counted_from_hlo_text():
    text = "\n".join(
        [
            "ENTRY %main (a: bf16[8,16], b: bf16[16,4]) -> f32[8,4] {",
            "  %d = f32[8,4]{1,0} dot(%a, %b), lhs_contracting_dims={1}",
            "  %g = (f32[8,4]{1,0}, s8[64]{0}) custom-call(%a, %b), custom_call_"
            'target="__cublas$lt$matmul", backend_config={"dot_dimension_numbers"'
            ':{"lhs_contracting_dimensions":["1"]}}',
            "  ROOT %r = f32[8,4]{1,0} all-reduce(%d), replica_groups="
            "mesh['axis_0'=2,'axis_1'=4] {'axis_1'}, to_apply=%add",
            "}",
        ]
    )
    cost = hlo_cost(text)
    assert cost["flops"] == 2 * (2 * 8 * 4 * 16)
    # dot: 128 out + 256 + 128 in; gemm: 128 + 64 out + 384 in; all-reduce 256.
    assert cost["bytes_accessed"] == 512 + 576 + 256
    assert group_size("replica_groups=[2,4]<=[8]", 8) == 4
    assert link_bytes(text, 8) == 128 * 2 * 3 / 4


def test_six_n_tokens_cross_checks_the_flops_counted_from_a_t4_program():
    pytest.importorskip("jax_plugins.xla_cuda12")
    from keras_hub_autodist.fitting.compiled_step import compiled_memory
    from keras_hub_autodist.fitting.planner import plan

    layout = plan(TILED_GEMMA, {"batch": 1, "model": 2}, device_memory="t4")
    memory = compiled_memory(layout, 4, 64, preset=TILED_GEMMA, device="t4")
    assert memory.cost["counted_from_hlo"] == 1.0 and memory.cost["link_bytes"] > 0
    modelled = step_cost.model_flops(layout, 4, 64) / 2
    assert 0.8 < memory.cost["flops"] / modelled < 1.25


@needs_compilers
def test_the_search_ranks_explains_and_never_loses_to_the_rule(v5e_search):
    result, _ = v5e_search
    assert len(result.entries) >= 4
    assert all(entry.why for entry in result.entries)
    chosen, rule = result.chosen, result.rule_choice
    assert chosen.stage == COMPILED and chosen.fits
    assert rule.stage == COMPILED  # the rule's choice is always compiled
    assert chosen.seconds_per_token <= rule.seconds_per_token
    assert chosen.why.startswith("chosen")
    assert result.entries[0] is chosen
    # Compiled and fitting first, by modelled time per token.
    compiled = [e for e in result.entries if e.stage == COMPILED and e.fits]
    assert compiled == list(result.entries[: len(compiled)])
    times = [e.seconds_per_token for e in compiled]
    assert times == sorted(times)
    assert "| # | layout |" in str(result)


@needs_compilers
def test_compiles_are_cached_by_config_layout_and_versions(v5e_search, monkeypatch):
    cold, warm = v5e_search
    assert cold.cache_hits == 0 and warm.cache_hits == warm.compiles == cold.compiles
    assert warm.seconds < cold.seconds
    assert to_json(warm)["chosen"] == to_json(cold)["chosen"]
    from keras_hub_autodist.fitting.planner import plan

    tp = plan(TILED_GEMMA, {"batch": 2, "model": 2}, strategy="tp")
    fsdp = plan(TILED_GEMMA, {"batch": 2, "model": 2}, strategy="fsdp")
    config = TILED_GEMMA["config"]

    def key(layout):
        return search_cache.compile_key(layout, config, 4, 64, "adam", "v5e")

    assert key(tp) == key(tp) != key(fsdp)
    versions = search_cache.versions()
    monkeypatch.setattr(search_cache, "versions", lambda: {**versions, "jax": "0.0.0"})
    before = key(tp)
    monkeypatch.undo()
    assert key(tp) != before


@needs_compilers
def test_the_json_object_has_the_chosen_the_rules_and_every_candidate(v5e_search):
    result, _ = v5e_search
    answer = json.loads(json.dumps(to_json(result)))
    assert ENTRY_KEYS <= set(answer["chosen"]) and ENTRY_KEYS <= set(
        answer["rule_choice"]
    )
    assert len(answer["candidates"]) == len(result.entries)
    for entry in answer["candidates"]:
        assert ENTRY_KEYS <= set(entry)
        compiled = entry["stage"] == COMPILED
        assert (entry["compiled_peak_bytes_per_device"] is not None) == compiled
    assert answer["chosen"] == answer["candidates"][0]


def test_a_candidate_over_the_memory_is_pruned_before_compiling(tmp_path):
    # Two v5e chips are far too small for the tiny model's batch of 512
    # sequences of 32768 tokens in one step (each device attends with
    # splash, memory linear in the sequence, but the residual stream and
    # the MLP alone outgrow them): all candidates but the rule's are pruned
    # and not compiled; the rule's is compiled whatever the closed form
    # says. (Without accumulation: split into micro-steps, some fit.)
    pytest.importorskip("libtpu")
    result = search(
        TILED_GEMMA,
        "v5e",
        2,
        512,
        32768,
        max_compiles=0,
        remats=(None,),
        gradient_accumulation=False,
        cache_dir=tmp_path,
    )
    pruned = [e for e in result.entries if e.stage == PRUNED]
    assert pruned and all(e.compiled is None for e in pruned)
    assert all("pruned" in e.why for e in pruned if not e.rule)


@needs_compilers
def test_batch_auto_takes_the_largest_batch_that_fits(tmp_path):
    result = search(
        TILED_GEMMA,
        "v5e",
        2,
        "auto",
        64,
        max_compiles=0,
        remats=(None,),
        cache_dir=tmp_path,
    )
    batches = {e.candidate.batch_size for e in result.entries}
    assert max(batches) > 2 and result.chosen.fits
    with pytest.raises(PlanError, match="Received: batch_size=0"):
        search(TILED_GEMMA, "v5e", 2, 0, 64)


@needs_compilers
def test_cli_search_prints_one_json_object(
    tiny_presets_dir, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv(search_cache.COMPILE_CACHE_ENV, str(tmp_path))
    argv = ["plan", tiny_presets_dir["gemma_mqa"], "--device", "t4"]
    argv += ["--devices", "2", "--batch", "2", "--seq", "32", "--search", "--json"]
    argv += ["--remat", "full"]
    assert cli.main(argv) == 0
    answer = json.loads(capsys.readouterr().out)
    assert {"chosen", "rule_choice", "candidates"} <= set(answer)
    assert answer["chosen"]["modelled_by"] == "roofline"
    assert len(answer["candidates"]) >= 4


def test_cli_search_names_the_missing_flags(capsys):
    status = cli.main(["plan", "./p", "--search", "--batch", "8", "--seq", "64"])
    assert status == 2
    assert "--device, --devices" in capsys.readouterr().err
    status = cli.main(
        ["plan", "./p", "--mesh", "batch=1", "--batch", "auto", "--seq", "64"]
    )
    assert status == 2
    assert "add --search" in capsys.readouterr().err


def test_from_preset_keeps_the_rule_off_accelerators():
    cpu = types.SimpleNamespace(platform="cpu", device_kind="cpu")
    options = PlanOptions()
    assert local_device_name([cpu]) is None
    assert local_device_name(["cpu:0"]) is None  # Keras' names of devices
    assert searched_layout("./p", "auto", options, [cpu]) == ("auto", options, "")
    v5e = types.SimpleNamespace(platform="tpu", device_kind="TPU v5 lite")
    t4 = types.SimpleNamespace(platform="gpu", device_kind="Tesla T4")
    assert local_device_name([v5e]) == "v5e" and local_device_name([t4]) == "t4"
    mesh = {"batch": 2}
    assert searched_layout("./p", mesh, options, [v5e]) == (mesh, options, "")


def _stored():
    return {path.stem: json.loads(path.read_text()) for path in STORED.glob("*.json")}


def test_the_stored_reference_rankings_hold():
    stored = _stored()
    assert {"gemma_7b_lora_2x_t4", "llama3_8b_full_v5e_8"} <= set(stored)
    for name, answer in stored.items():
        assert len(answer["candidates"]) >= 4, name
        assert all(entry["why"] for entry in answer["candidates"]), name
        chosen, rule = answer["chosen"], answer["rule_choice"]
        assert chosen["compiled_peak_bytes_per_device"] is not None, name
        assert rule["compiled_peak_bytes_per_device"] is not None, name
        if chosen["fits"] and rule["fits"]:
            per_token = [
                e["modelled_step_seconds"] / e["batch_size"] for e in (chosen, rule)
            ]
            assert per_token[0] <= per_token[1], name
        assert answer["warm_seconds"] < 5, name
    assert Candidate({"batch": 1}, "tp", None, 1) == Candidate(
        {"batch": 1, "model": 1}, "tp", None, 1
    )


@needs_compilers
def test_auto_on_a_known_accelerator_takes_the_winner_and_says_why(
    tiny_presets_dir, tmp_path, monkeypatch
):
    # Two TPU v5e chips as from_preset would list them; the search compiles
    # for the TPU compiler's stand-ins of them.
    from keras_hub_autodist.fitting.planner import plan
    from keras_hub_autodist.searching import auto_mesh as auto_search
    from keras_hub_autodist.summary_line import summary_line

    monkeypatch.setattr(auto_search, "FROM_PRESET_SEQUENCE", 32)
    monkeypatch.setenv(search_cache.COMPILE_CACHE_ENV, str(tmp_path))
    v5e = types.SimpleNamespace(platform="tpu", device_kind="TPU v5 lite")
    preset = tiny_presets_dir["gemma_mqa"]
    mesh, options, reason = searched_layout(
        preset, "auto", PlanOptions(remat=None), [v5e, v5e]
    )
    assert isinstance(mesh, dict) and options.strategy in ("tp", "fsdp")
    assert reason.startswith("searched for 2 x v5e: the fastest modelled step")
    layout = plan(preset, mesh, strategy=options.strategy)
    line = summary_line(layout.replace(mesh_reason=reason))
    assert "searched for 2 x v5e" in line and "\n" not in line
    monkeypatch.setenv(auto_search.SEARCH_ENV, "0")
    assert searched_layout(preset, "auto", options, [v5e])[2] == ""


def test_only_what_the_closed_forms_verdict_says_no_to_is_pruned(tmp_path):
    # A ladder of one v5e from batches that fit to ones far too large: an
    # entry is pruned exactly where its verdict is NO (even its least is
    # over the memory), and one estimated over the memory whose least fits
    # (a maybe) stays to be compiled: the compiler may fit it.
    pytest.importorskip("libtpu")
    from keras_hub_autodist.fitting.planner import plan

    result = search(
        TILED_GEMMA,
        "v5e",
        1,
        sequence_length=32768,
        per_device_batch=(1, 4096),
        max_compiles=0,
        remats=(None,),
        gradient_accumulation=False,
        cache_dir=tmp_path,
    )
    capacity = plan(TILED_GEMMA, {"batch": 1}, device_memory="v5e")
    capacity = capacity.device_memory_bytes
    entries = [e for e in result.entries if not e.rule]
    assert {e.stage == PRUNED for e in entries} == {True, False}
    for entry in entries:
        assert (entry.stage == PRUNED) == (entry.least_bytes > capacity), entry.why
    assert any(e.stage != PRUNED and e.estimate_bytes > capacity for e in entries), [
        (e.candidate.batch_size, e.estimate_bytes, e.least_bytes) for e in entries
    ]
