"""The search over batches (`searching.batches`): a global batch tried
whole and as micro-steps whose gradients accumulate, a range of batches
per device searched for the largest that fits per layout and remat with
few compiles, the chosen configuration always one a compile showed to fit,
each loser explained, the code that trains with the winner, and
`remat="auto"` (only with `device_mesh="auto"`) loading the winner's remat.

Most tests replace the compiler (`search.compiled_memory`) by a stand-in
that refuses a step over a number of sequences per device, as the TPU
compiler refuses one over its memory: what is under test is the search's
bookkeeping. One compiles for a v5e (compile-only, libtpu), with the
refusals put in front of the real compiles."""

import importlib.util
import json
import math

import pytest
from search_stand_ins import GIB
from search_stand_ins import REFUSAL
from search_stand_ins import TILED_GEMMA
from search_stand_ins import batch_limited_compiler
from search_stand_ins import search_tiny_gemma
from search_stand_ins import tpu_memory

import keras_hub_autodist
from keras_hub_autodist import cli
from keras_hub_autodist.errors import AutodistError
from keras_hub_autodist.errors import PlanError
from keras_hub_autodist.planning.options import PlanOptions
from keras_hub_autodist.searching import search as search_module
from keras_hub_autodist.searching.batches import batch_candidates
from keras_hub_autodist.searching.batches import next_rung
from keras_hub_autodist.searching.batches import per_device_batches
from keras_hub_autodist.searching.report import COMPILED
from keras_hub_autodist.searching.report import to_json
from keras_hub_autodist.searching.search import search


@pytest.fixture
def compiler(monkeypatch):
    """`search_stand_ins.batch_limited_compiler` in place of the search's
    compiler."""
    return batch_limited_compiler(monkeypatch)


def test_a_global_batch_is_tried_whole_and_as_accumulated_micro_steps():
    found = batch_candidates(
        1, 64, batch_size=8, strategies=("tp",), remats=(None, "full")
    )
    pairs = {(c.per_device_batch, c.accumulation, c.remat) for c in found}
    assert pairs == {
        (b, k, remat)
        for b, k in ((8, 1), (4, 2), (2, 4), (1, 8))
        for remat in (None, "full")
    }
    # On d replicas of the batch axis: b * k * d == B, every one.
    found = batch_candidates(
        4, 64, batch_size=8, strategies=("tp", "fsdp"), remats=(None,)
    )
    assert {c.per_device_batch * c.accumulation * c.mesh["batch"] for c in found} == {8}
    assert {(c.mesh["batch"], c.accumulation) for c in found} >= {
        (4, 1),
        (4, 2),
        (1, 8),
    }
    # Without accumulation, the whole batch alone.
    whole = batch_candidates(
        1, 64, batch_size=8, accumulate=False, strategies=("tp",), remats=(None,)
    )
    assert [(c.batch_size, c.accumulation) for c in whole] == [(8, 1)]
    # A range per device: its ends and the powers of two between.
    assert per_device_batches(1, 16) == [1, 2, 4, 8, 16]
    assert per_device_batches(3, 3) == [3]
    ranged = batch_candidates(
        2, 64, per_device=(1, 4), strategies=("tp",), remats=(None,)
    )
    assert {c.per_device_batch for c in ranged} == {1, 2, 4}
    assert all(c.accumulation == 1 for c in ranged)


@pytest.mark.parametrize("rungs", [5, 8, 11])
def test_the_largest_fitting_rung_is_found_with_few_compiles(rungs):
    # Every limit (none fits .. all fit), every rung compiled first.
    for limit in range(-1, rungs):
        for first in range(rungs):
            known = [None] * rungs
            index, compiles = first, 0
            while index is not None:
                known[index] = index <= limit
                compiles += 1
                index = next_rung(known, [True] * rungs)
            assert max((i for i, k in enumerate(known) if k), default=-1) == limit
            assert compiles <= 2 + math.ceil(math.log2(rungs)), (limit, first)
    # The closed form's guess one rung off: two compiles.
    known = [None] * rungs
    known[3] = False
    assert next_rung(known, [True] * rungs) == 2
    # Upwards, only to rungs the closed form doesn't prune.
    known = [None] * rungs
    known[1] = True
    assert next_rung(known, [True, True] + [False] * (rungs - 2)) is None


def test_a_range_search_chooses_a_fitting_configuration_and_explains_each_loser(
    tmp_path, compiler
):
    result = search_tiny_gemma(
        tmp_path, per_device_batch=(1, 16), remats=(None, "full")
    )
    chosen = result.chosen
    # Never one the compiler refused, never one not compiled.
    assert chosen.stage == COMPILED and chosen.fits
    assert not chosen.compiled.out_of_memory
    # The largest per-device batch that fits per remat: remat off fits 4,
    # full 16, and 16 with remat beats 4 without it (9/8 x 1.3 < 3).
    assert (chosen.candidate.remat, chosen.candidate.per_device_batch) == ("full", 16)
    best = {}
    for entry in result.entries:
        if entry.stage == COMPILED and entry.fits:
            remat = entry.candidate.remat
            best[remat] = max(best.get(remat, 0), entry.candidate.per_device_batch)
    assert best == {None: 4, "full": 16}
    # Few compiles: never every batch of every remat.
    assert result.compiles == len(compiler.calls) <= 6 < len(result.entries)
    assert (16, "full", 1) in compiler.calls
    # Each loser says why, in its own terms.
    whys = {
        (e.candidate.remat, e.candidate.per_device_batch): e.why for e in result.entries
    }
    assert whys[("full", 16)].startswith("chosen: the fastest modelled step")
    assert whys[(None, 8)].startswith("does not fit: the compiler refuses it")
    assert whys[(None, 4)].startswith("fits, 0.")
    assert "x the chosen one's tokens/s" in whys[(None, 4)]
    assert "4 sequences per device per step, not 16" in whys[(None, 4)]
    assert "without the chosen one's remat full" in whys[(None, 4)]
    assert whys[(None, 1)] == (
        "not compiled: a larger batch of this layout fits by its compile (4 per device)"
    )
    assert whys[("full", 8)].startswith("not compiled: a larger batch")
    # With remat at a batch that fits without it: remat only recomputes.
    assert whys[("full", 4)].startswith("not compiled: with a remat that recomputes")
    assert all(entry.why for entry in result.entries)
    # The table and the JSON say what to write.
    code = result.run_code
    assert "keras_hub.models.GemmaCausalLM.from_preset(" in code
    assert 'device_mesh={"batch": 1, "model": 1}' in code
    assert 'strategy="tp"' in code and 'remat="full"' in code
    assert "lm.fit(data, batch_size=16)" in code
    assert "gradient_accumulation_steps" not in code
    assert code in str(result)
    answer = json.loads(json.dumps(to_json(result)))
    assert answer["run"]["per_device_batch"] == 16
    assert answer["run"]["gradient_accumulation_steps"] == 1
    assert answer["per_device_batch_range"] == [1, 16]


def test_the_matmul_keeping_remat_wins_where_it_fits_a_batch_fast_enough(
    tmp_path, compiler
):
    # Off fits 2 per device, "dots" 8 and "full" 16: "dots" recomputes
    # little (1.05x) and "full" much (1.5x), so 8 with "dots" is the
    # fastest per token ((1 + 8/8) x 1.05 < (1 + 8/16) x 1.5 < 1 + 8/2).
    compiler.limits = {None: 2, "dots": 8, "full": 16}
    compiler.remat_cost = {"dots": 1.05, "full": 1.5}
    result = search_tiny_gemma(tmp_path, per_device_batch=(1, 16))
    chosen = result.chosen
    assert chosen.stage == COMPILED and chosen.fits
    assert (chosen.candidate.remat, chosen.candidate.per_device_batch) == ("dots", 8)
    assert 'remat="dots"' in result.run_code
    whys = {
        (e.candidate.remat, e.candidate.per_device_batch): e.why for e in result.entries
    }
    assert whys[("full", 16)].startswith("fits, 0.")
    assert "x the chosen one's tokens/s" in whys[("full", 16)]
    assert whys[("full", 8)].startswith("not compiled: with a remat that recomputes")
    assert result.compiles == len(compiler.calls) <= 9


def test_of_two_steps_as_fast_the_one_with_more_memory_to_spare_is_chosen(
    tmp_path, compiler
):
    # The same time per token at every batch and with "dots" (a step costed
    # at the device's peak on its model flops): every compiled step that
    # fits ties, and the one of the smallest peak is chosen.
    compiler.per_token = lambda rows: 1e-6
    compiler.remat_cost = {"dots": 1.0, "full": 1.3}
    result = search_tiny_gemma(
        tmp_path, per_device_batch=(1, 16), remats=(None, "dots")
    )
    fitting = [e for e in result.entries if e.stage == COMPILED and e.fits]
    assert {(e.candidate.remat, e.candidate.per_device_batch) for e in fitting} >= {
        (None, 4),
        ("dots", 8),
    }
    chosen = result.chosen
    assert chosen.compiled.peak_bytes == min(e.compiled.peak_bytes for e in fitting)
    whys = {
        (e.candidate.remat, e.candidate.per_device_batch): e.why for e in result.entries
    }
    assert whys[("dots", 8)].startswith(
        "fits, as fast as the chosen one by the model, with a larger compiled peak"
    )
    assert "8 sequences per device per step" in whys[("dots", 8)]


def test_remat_off_that_fits_the_whole_range_leaves_remat_uncompiled(
    tmp_path, compiler
):
    compiler.limits = {None: 64, "dots": 64, "full": 64}
    result = search_tiny_gemma(tmp_path, per_device_batch=(1, 16))
    assert result.chosen.candidate.remat is None
    assert all(remat is None for _, remat, _ in compiler.calls)
    skipped = [e for e in result.entries if e.candidate.remat in ("dots", "full")]
    assert {e.candidate.remat for e in skipped} == {"dots", "full"}
    assert all(
        e.why.startswith("not compiled: with a remat that recomputes less")
        or e.why.startswith("not compiled: a larger batch")
        for e in skipped
    )


def test_a_global_batch_that_does_not_fit_whole_is_accumulated(tmp_path, compiler):
    # Remat off fits 4 per device; with remat the step is so much slower
    # that 4 micro-steps of 4 beat one step of 16.
    compiler.remat_cost = {"dots": 3.0, "full": 3.0}
    result = search_tiny_gemma(tmp_path, batch_size=16)
    chosen = result.chosen.candidate
    assert result.chosen.stage == COMPILED and result.chosen.fits
    assert (chosen.remat, chosen.per_device_batch, chosen.accumulation) == (None, 4, 4)
    # The compile of an accumulated step is of that step (its key too).
    assert (4, None, 4) in compiler.calls
    code = result.run_code
    assert "keras.optimizers.Adam(gradient_accumulation_steps=4)" in code
    assert "lm.fit(data, batch_size=4)" in code
    assert "16 per optimizer update" in code
    (whole,) = [
        e
        for e in result.entries
        if e.candidate.remat is None and e.candidate.accumulation == 1
    ]
    assert whole.why.startswith("does not fit: the compiler refuses it")
    # Every candidate trains the global batch asked for.
    for entry in result.entries:
        candidate = entry.candidate
        assert candidate.batch_size * candidate.accumulation == 16
    assert "x4 accum" in str(result)


def test_nothing_chosen_is_refused_when_nothing_fits(tmp_path, compiler):
    compiler.limits = {None: 0, "dots": 0, "full": 0}
    result = search_tiny_gemma(tmp_path, per_device_batch=(1, 4))
    assert not result.chosen.fits and result.chosen.stage == COMPILED
    assert result.chosen.why.startswith("nothing compiled fits")
    assert result.run_code == "" and to_json(result)["run"] is None


def test_the_batch_arguments_are_checked(tmp_path):
    with pytest.raises(PlanError, match="not both"):
        search_tiny_gemma(tmp_path, batch_size=8, per_device_batch=(1, 4))
    with pytest.raises(PlanError, match="Received: batch_size=None"):
        search_tiny_gemma(tmp_path)
    for wrong in ((4, 1), (0, 4), "1:4", (1, 2, 3)):
        with pytest.raises(PlanError, match="Received: per_device_batch="):
            search_tiny_gemma(tmp_path, per_device_batch=wrong)
    with pytest.raises(PlanError, match="Received: gradient_accumulation="):
        search_tiny_gemma(tmp_path, batch_size=8, gradient_accumulation="yes")


def test_remat_auto_is_taken_only_with_device_mesh_auto(tiny_presets_dir):
    preset = tiny_presets_dir["gemma_mqa"]
    with pytest.raises(PlanError, match="device_mesh='auto'") as raised:
        keras_hub_autodist.from_preset(
            __import__("keras_hub").models.GemmaCausalLM,
            preset,
            device_mesh={"batch": 2, "model": 4},
            remat="auto",
        )
    assert isinstance(raised.value, AutodistError)
    assert "Received: device_mesh={'batch': 2, 'model': 4}, remat='auto'" in str(
        raised.value
    )
    with pytest.raises(PlanError, match="Received: remat='auto'"):
        keras_hub_autodist.plan(preset, "auto", remat="auto")
    with pytest.raises(PlanError, match="only from_preset"):
        PlanOptions(remat="auto")


@pytest.mark.parametrize(
    "limits, loaded",
    [
        ({None: 0, "dots": 0, "full": 4}, "full"),
        ({None: 0, "dots": 4, "full": 4}, "dots"),
        ({None: 4, "dots": 4, "full": 4}, None),
    ],
)
def test_device_mesh_auto_with_remat_auto_loads_the_winners_remat(
    tiny_presets_dir, tmp_path, monkeypatch, compiler, limits, loaded
):
    import keras_hub

    from keras_hub_autodist.searching import auto_mesh
    from keras_hub_autodist.searching import cache

    compiler.limits = limits
    monkeypatch.setattr(auto_mesh, "FROM_PRESET_SEQUENCE", 32)
    monkeypatch.setattr(auto_mesh, "local_device_name", lambda devices: "v5e")
    monkeypatch.setenv(cache.COMPILE_CACHE_ENV, str(tmp_path))
    lm = keras_hub_autodist.from_preset(
        keras_hub.models.GemmaCausalLM,
        tiny_presets_dir["gemma_mqa"],
        device_mesh="auto",
        remat="auto",
    )
    plan = keras_hub_autodist.distribution_of(lm).plan
    assert plan.remat == loaded
    # The remats were searched, at one step of one sequence per device.
    assert {remat for _, remat, _ in compiler.calls} <= {None, "dots", "full"}
    assert {steps for _, _, steps in compiler.calls} == {1}
    assert "searched for 8 x v5e" in plan.mesh_reason


def test_remat_auto_without_a_search_loads_remat_off(tiny_presets_dir, monkeypatch):
    import keras_hub

    from keras_hub_autodist.searching import search as search_module

    def never(*args, **kwargs):
        raise AssertionError("no search runs on a CPU")

    # On this CPU no search runs: the memory rule's mesh, remat off.
    monkeypatch.setattr(search_module, "search", never)
    lm = keras_hub_autodist.from_preset(
        keras_hub.models.GemmaCausalLM,
        tiny_presets_dir["gemma_mqa"],
        device_mesh="auto",
        remat="auto",
    )
    plan = keras_hub_autodist.distribution_of(lm).plan
    assert plan.remat is None and "searched" not in plan.mesh_reason


def test_the_command_searches_a_range_per_device_and_prints_the_code(
    tiny_presets_dir, tmp_path, monkeypatch, capsys, compiler
):
    from keras_hub_autodist.searching import cache

    compiler.limits = {None: 4, "dots": 2, "full": 2}
    monkeypatch.setenv(cache.COMPILE_CACHE_ENV, str(tmp_path))
    argv = ["plan", tiny_presets_dir["gemma_mqa"], "--device", "v5e", "--devices"]
    argv += ["1", "--per-device-batch", "1:8", "--seq", "32", "--search"]
    assert cli.main(argv + ["--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["run"]["per_device_batch"] == 4 and answer["run"]["remat"] is None
    assert "from_preset(" in answer["run"]["code"]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert "To train with the chosen configuration:" in text
    assert "lm.fit(data, batch_size=4)" in text
    # The range asks for the search; the global batch and it exclude each other.
    assert cli.main(argv[:-1] + ["--mesh", "batch=1"]) == 2
    assert "add --search" in capsys.readouterr().err
    assert cli.main(argv + ["--batch", "4"]) == 2
    assert "not both" in capsys.readouterr().err


@pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="the TPU compiler is not installed: keras-hub-autodist[tpu-compile]",
)
def test_target_compiles_for_a_v5e_choose_a_configuration_they_show_fits(
    tmp_path, monkeypatch
):
    # The real compiles for a v5e (compile-only), behind a stand-in
    # refusal of more than 2 sequences per device without remat.
    real = search_module.compiled_memory
    compiled = []

    def refusing(layout, batch_size, *args, **kwargs):
        steps = kwargs["gradient_accumulation_steps"]
        compiled.append((batch_size, layout.remat, steps))
        if layout.remat is None and batch_size > 2:
            return tpu_memory(
                batch_size, 64, 1, peak_bytes=21 * GIB, out_of_memory=REFUSAL
            )
        return real(layout, batch_size, *args, **kwargs)

    monkeypatch.setattr(search_module, "compiled_memory", refusing)
    result = search(
        TILED_GEMMA,
        "v5e",
        1,
        4,
        64,
        remats=(None,),
        cache_dir=tmp_path,
    )
    chosen = result.chosen
    assert chosen.stage == COMPILED and chosen.fits
    assert (chosen.candidate.batch_size, chosen.candidate.accumulation) == (2, 2)
    assert chosen.compiled.target == "v5e" and chosen.cost.source == "xla"
    # Keras' accumulators are in the compiled step: more state than the
    # same micro-batch without accumulation.
    layout = keras_hub_autodist.plan(TILED_GEMMA, {"batch": 1}, device_memory="v5e")
    plain = keras_hub_autodist.compiled_memory(
        layout, 2, 64, preset=TILED_GEMMA, device="v5e"
    )
    assert chosen.compiled.argument_bytes > plain.argument_bytes
    assert "gradient_accumulation_steps=2" in result.run_code
    assert compiled[0] == (4, None, 1)  # the memory rule's: the whole batch
