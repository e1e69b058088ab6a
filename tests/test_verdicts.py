"""One verdict per answer: the closed form's yes, NO or maybe (within the
estimate's measured margins, or on a TPU, whose compiler rematerializes),
checked against steps measured on a TPU v5e chip; its advice, the
command's text and `--json` each say that one verdict, and with
`--compiled` the compiled step's."""

import importlib.util
import json

import pytest
from chip_steps import CHIP_STEPS
from chip_steps import chip_source
from chip_steps import chip_step_id
from real_presets import REAL_PRESETS

import keras_hub_autodist
from keras_hub_autodist import cli
from keras_hub_autodist.fitting import report
from keras_hub_autodist.fitting import step_memory
from keras_hub_autodist.fitting import verdicts
from keras_hub_autodist.fitting.device_profiles import GIB
from keras_hub_autodist.fitting.memory_factors import ESTIMATE_MARGIN


def _chip_plan(preset, untied, lora_rank):
    return keras_hub_autodist.plan(
        chip_source(preset, untied),
        {"batch": 1, "model": 1},
        dtype="bfloat16",
        device_memory="v5e",
        lora_rank=lora_rank,
    )


@pytest.mark.parametrize("case", CHIP_STEPS, ids=chip_step_id)
def test_the_closed_form_is_never_wrong_about_the_chip(case):
    preset, untied, lora_rank, batch, sequence, runs, chip_gib = case
    plan = _chip_plan(preset, untied, lora_rank)
    verdict = verdicts.step_verdict(plan, batch, sequence, platform="v5e")
    # Never NO for a step that runs, never yes for one that doesn't.
    assert verdict.answer in (
        (verdicts.YES, verdicts.MAYBE)
        if runs
        else (
            verdicts.NO,
            verdicts.MAYBE,
        )
    ), (verdict.answer, verdict.least_bytes / GIB)
    # The least the step could need is a lower bound of what the chip's
    # compiler needed, rematerializing as much as it could.
    assert verdict.least_bytes <= chip_gib * GIB
    assert verdict.least_bytes <= verdict.estimate.total_bytes
    # The plan made for a v5e answers for one by default, in Python too.
    fits, _, line = report.memory_verdict(plan, batch, sequence)
    assert fits is verdict.fits
    assert line.startswith(f"fits: {verdict.answer},")


def test_the_chip_steps_get_each_verdict():
    answers = {
        verdicts.step_verdict(_chip_plan(p, u, r), b, s, platform="v5e").answer
        for p, u, r, b, s, _, _ in CHIP_STEPS
    }
    assert answers == {verdicts.YES, verdicts.MAYBE}
    # NO where even full rematerialization leaves more than the chip has:
    # the lower bound is never above what the chip's compiler needed (above).
    plan = _chip_plan("gemma_2b", False, 8)
    verdict = verdicts.step_verdict(plan, 128, 1024, platform="v5e")
    assert verdict.answer == verdicts.NO
    assert verdict.least_bytes > plan.device_memory_bytes


def test_a_gpu_answers_by_the_estimates_measured_margins():
    plan = _chip_plan("gemma_2b", False, 8)
    answers = set()
    for batch in (1, 2, 4, 8, 12, 16, 32):
        verdict = verdicts.step_verdict(plan, batch, 1024, platform="h100")
        total = step_memory.step_estimate(plan, batch, 1024, platform="h100")
        total = total.total_bytes
        capacity = plan.device_memory_bytes
        assert verdict.margin == ESTIMATE_MARGIN["gpu"] > 0
        if total * (1 + verdict.margin) <= capacity:
            assert verdict.answer == verdicts.YES
        elif total / (1 + verdict.over_margin) > capacity:
            assert verdict.answer == verdicts.NO
        else:
            assert verdict.answer == verdicts.MAYBE
        answers.add(verdict.answer)
    assert answers == {verdicts.YES, verdicts.MAYBE, verdicts.NO}


def test_the_advice_is_the_verdicts():
    plan = _chip_plan("gemma_2b", False, 8)
    for batch in (1, 2, 4, 8, 16, 96, 128):
        verdict = verdicts.step_verdict(plan, batch, 1024)
        advice = plan.fit_advice(batch, 1024)
        fits, _, line = report.memory_verdict(plan, batch, 1024)
        assert fits is verdict.fits
        if verdict.answer == verdicts.YES:
            assert advice == []
        elif verdict.answer == verdicts.MAYBE:
            assert advice == [report.SETTLE_ADVICE]
            assert report.SETTLE_ADVICE in line
        else:
            assert advice[-1].startswith("check this estimate")
            maybe = [a for a in advice if "may fit" in a]
            for item in maybe:
                proposed = int(item.split("batch of ")[1].split(" ")[0])
                again = verdicts.step_verdict(plan, proposed, 1024)
                assert again.answer == verdicts.MAYBE, item
            smaller = [a for a in advice if a.startswith("a smaller batch")]
            # What it proposes is a step whose own verdict is yes.
            for item in smaller:
                proposed = int(item.split("batch: ")[1].split(" ")[0])
                again = verdicts.step_verdict(plan, proposed, 1024)
                assert again.answer == verdicts.YES, item
    # A NO on a TPU names the largest batch that may fit, to be compiled.
    assert any("may fit" in item for item in plan.fit_advice(96, 1024))
    assert {verdicts.step_verdict(plan, b, 1024).answer for b in (1, 8, 96)} == {
        verdicts.YES,
        verdicts.MAYBE,
        verdicts.NO,
    }


def _run(capfd, args):
    capfd.readouterr()
    status = cli.main(["plan", *args])
    captured = capfd.readouterr()
    assert status == 0, captured.err
    return captured.out


def _fit_lines(text):
    return [line for line in text.splitlines() if line.startswith("fits")]


@pytest.mark.parametrize("memory", [None, "0.05", "1000"])
def test_the_text_prints_one_verdict(capfd, tiny_presets_dir, memory):
    args = [tiny_presets_dir["gemma_mqa"], "--mesh", "batch=2,model=2"]
    args += ["--batch", "8", "--seq", "512"]
    args += ["--device-memory", memory] if memory else []
    text = _run(capfd, args)
    (line,) = _fit_lines(text)
    assert "fits: yes" in line or "fits: NO" in line
    assert "no activations" not in text
    # Without a step, the state's verdict, once.
    (state,) = _fit_lines(_run(capfd, args[:3]))
    assert "no activations" in state


def test_compiled_answers_say_the_compiled_verdict_and_its_advice(
    capfd, tiny_presets_dir
):
    args = [tiny_presets_dir["gemma_mqa"], "--mesh", "batch=2,model=2"]
    args += ["--batch", "8", "--seq", "64", "--compiled", "--json"]
    first = json.loads(_run(capfd, args))
    peak = first["compiled_peak_bytes_per_device"]
    estimate = first["estimate_bytes_per_device"]
    # Memories where the two answers disagree, and where they agree on NO.
    between = (peak + estimate) / 2 / GIB
    for gib in (between, peak / 4 / GIB):
        answer = json.loads(_run(capfd, [*args, "--device-memory", f"{gib:.9f}"]))
        assert answer["fits"] == (
            answer["compiled_peak_bytes_per_device"] <= answer["device_memory_bytes"]
        )
        assert answer["verdict"] == ("yes" if answer["fits"] else "no")
        if answer["fits"]:
            assert answer["advice"] == []
        else:
            assert answer["advice"]
            assert not any("--compiled" in item for item in answer["advice"])
        text = _run(capfd, [*args[:-1], "--device-memory", f"{gib:.9f}"])
        (line,) = _fit_lines(text)
        assert line.startswith("fits (compiled for")
        assert ("to fit:" in line) is (not answer["fits"])
    assert peak != estimate  # the two disagreed, the case was put to the test


def test_json_says_maybe_with_its_range_and_the_command_that_settles_it(capfd):
    args = [str(REAL_PRESETS / "gemma_2b"), "--mesh", "batch=1,model=1"]
    args += ["--dtype", "bfloat16", "--device", "v5e", "--lora-rank", "8"]
    args += ["--batch", "16", "--seq", "1024", "--closed-form", "--json"]
    answer = json.loads(_run(capfd, args))
    assert not answer["compiled_by_default"] and "compiled_for" not in answer
    assert answer["fits"] is None and answer["verdict"] == "maybe"
    assert answer["estimate_verdict"] == "maybe"
    low = answer["estimate_least_bytes_per_device"]
    assert low <= answer["device_memory_bytes"] < answer["estimate_bytes_per_device"]
    (advice,) = answer["advice"]
    assert "`--compiled`" in advice
    (line,) = _fit_lines(_run(capfd, args[:-1]))
    assert line.startswith("fits: maybe") and "`--compiled`" in line


TPU_STEP = ["--device", "v5e", "--mesh", "batch=2,model=2", "--batch", "4"]
TPU_STEP += ["--seq", "16", "--json"]


@pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="the TPU compiler is not installed",
)
def test_a_tpu_device_is_compiled_by_default_where_its_compiler_is(
    capfd, tiny_presets_dir
):
    answer = json.loads(_run(capfd, [tiny_presets_dir["gemma_mqa"], *TPU_STEP]))
    assert answer["compiled_by_default"]
    assert answer["compiled_for"]["device_kind"] == "TPU v5 lite"
    assert answer["fits"] == (
        answer["compiled_peak_bytes_per_device"] <= answer["device_memory_bytes"]
    )
    text = _run(capfd, [tiny_presets_dir["gemma_mqa"], *TPU_STEP[:-1]])
    (line,) = _fit_lines(text)
    assert line.startswith("fits (compiled for") and "`--closed-form`" in line


def test_without_the_tpu_compiler_the_closed_form_answers(
    capfd, tiny_presets_dir, monkeypatch
):
    found = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "libtpu" else found(name, *a),
    )
    answer = json.loads(_run(capfd, [tiny_presets_dir["gemma_mqa"], *TPU_STEP]))
    assert not answer["compiled_by_default"] and "compiled_for" not in answer


def test_closed_form_and_compiled_together_are_refused(capfd, tiny_presets_dir):
    capfd.readouterr()
    args = [tiny_presets_dir["gemma_mqa"], *TPU_STEP, "--closed-form", "--compiled"]
    assert cli.main(["plan", *args]) == 2
    error = capfd.readouterr().err
    assert "--closed-form" in error and "Received: --closed-form, --compiled" in error
