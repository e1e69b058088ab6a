"""The accelerator bench's report: each measured peak against the answers
given before the run, from a saved result (no run, no device)."""

from bench import accelerator_render
from bench import accelerator_steps


def _results():
    return dict(
        machine="1 x NVIDIA H200, 143771 MiB",
        versions={"jax": "0.11.2", "keras": "3.15.1"},
        date="2026-12-04",
        tiny=False,
        elapsed_s=400.0,
        loading=[
            dict(
                variant="autodist",
                dtype="bfloat16",
                seconds=9.0,
                peak_bytes=17.2e9,
                final_bytes=17.2e9,
                warnings=["UserWarning: a sharding warning"],
            ),
            dict(variant="keras-hub", dtype=None, error=["OOM"]),
        ],
        training=[
            dict(
                step="gemma_2b full 4x1024",
                variant="autodist",
                step_s=0.128,
                tokens_per_s=32000.0,
                tflops=480.0,
                first_step_s=14.0,
                peak_bytes=32e9,
                compiled_peak_bytes=30e9,
                closed_form_bytes=40e9,
                calibrated_bytes=36e9,
            ),
            dict(step="gemma_7b full 2x1024", variant="autodist", error=["OOM"]),
            dict(
                step="gemma_7b lora8 4x1024",
                variant="keras-hub",
                error=["RESOURCE_EXHAUSTED [executable_name='jit_train_step'] | x"],
            ),
        ],
        long_context=[
            dict(
                variant="autodist-context",
                seq=32768,
                step_s=1.5,
                tokens_per_s=21845.0,
                first_step_s=30.0,
                peak_bytes=20e9,
                attention_kernels=["__cudnn$fmhaSoftmax"],
            ),
        ],
    )


def test_each_answer_is_reported_as_a_ratio_of_the_measured_peak():
    predictions = {
        "gemma_2b full 4x1024": {
            "target_peak_bytes": 33.6e9,
            "closed_form_verdict": "maybe",
        }
    }
    text = accelerator_render.render(_results(), predictions)
    row = next(
        line
        for line in text.splitlines()
        if line.startswith("| gemma_2b full 4x1024 | yes | 32.00 GB")
    )
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[1] == "yes"  # it ran
    assert cells[3:5] == ["33.60 GB (1.05)", ""]  # the target compile
    assert cells[5:] == [
        "30.00 GB (0.94)",  # the local compile on the device
        "40.00 GB (1.25)",  # the plan's closed form
        "36.00 GB (1.12)",  # the calibrated closed form
        "maybe",  # its verdict, given before the run
    ]
    # A "maybe" is never wrong; a "NO" for a step that ran is.
    assert (
        "| closed form's verdict is not wrong | gemma_2b full 4x1024 (maybe) |" in text
    )
    predictions["gemma_2b full 4x1024"]["closed_form_verdict"] = "NO"
    text = accelerator_render.render(_results(), predictions)
    assert (
        "| closed form's verdict is not wrong | gemma_2b full 4x1024 (NO) "
        "| 0.000 | >= 1 | **no** |"
    ) in text


def test_failures_warnings_and_kernels_are_shown_not_dropped():
    text = accelerator_render.render(_results(), {})
    # In a code span (the docs' build reads bare brackets as links), without
    # the bars that would split the table's cell.
    assert "fails: `RESOURCE_EXHAUSTED [executable_name='jit_train_step'] / x`" in text
    assert "| gemma_7b full 2x1024 | autodist | | | fails: `OOM`" in text
    assert "`UserWarning: a sharding warning`" in text
    assert "`__cudnn$fmhaSoftmax`" in text


def test_the_committed_h200_predictions_name_every_measured_step():
    predicted = accelerator_steps.read_predictions("h200")
    steps = accelerator_steps.steps_of("gpu", tiny=False)
    assert set(predicted) == {name for step in steps for name in step.names()}
    for figures in predicted.values():
        assert figures["compiled_for"]["device_kind"] == "NVIDIA H200"
        assert figures["target_peak_bytes"] > figures["target_argument_bytes"] > 0


def test_the_committed_v5e_predictions_name_every_step_the_chip_trains():
    # The training, long and search parts' steps: each measured on the chip
    # is held to a target compile made before the run.
    predicted = accelerator_steps.read_predictions("v5e")
    steps = (
        accelerator_steps.steps_of("tpu", tiny=False)
        + accelerator_steps.long_steps_of("tpu", tiny=False)
        + accelerator_steps.search_steps_of("tpu", tiny=False)
    )
    names = {name for step in steps for name in step.names()}
    assert names <= set(predicted), sorted(names - set(predicted))
    for name in names:
        figures = predicted[name]
        assert figures["compiled_for"]["device_kind"] == "TPU v5 lite"
        assert figures["target_peak_bytes"] > figures["target_argument_bytes"] > 0


def test_targets_are_met_on_their_bounds_and_missed_past_them():
    from bench import accelerator_targets

    results = _results()
    # 34 GB predicted against 32 measured: 1.0625, outside 5%; 33.5: within.
    outside = accelerator_targets.verdicts(
        results, {"gemma_2b full 4x1024": {"target_peak_bytes": 34e9}}
    )
    inside = accelerator_targets.verdicts(
        results, {"gemma_2b full 4x1024": {"target_peak_bytes": 30.5e9}}
    )
    name = "target compile's peak / measured peak"
    assert [v[3] for v in outside if v[0] == name] == [False]
    assert [v[3] for v in inside if v[0] == name] == [True]
    # A bound is met exactly on it (binary fractions: no rounding).
    assert accelerator_targets.met("load without dtype= / load in bfloat16", 1.125)
    assert not accelerator_targets.met(
        "device peak / final bytes while loading", 1.0625
    )
    assert accelerator_targets.met("device peak / final bytes while loading", 1.0)


def test_the_target_compile_is_held_to_the_chips_program_by_the_same_measure():
    # A TPU target compile reports the compiler's peak (the buffers live at
    # once), which is less than the program's parts summed: each is held
    # to the chip's figure of the same kind, whichever the chip gave.
    from bench import accelerator_targets

    predicted = {"target_peak_bytes": 9.0e9, "target_program_bytes": 10.0e9}
    chip = {"program_bytes": 10.2e9, "compiler_peak_bytes": 9.1e9}
    pair = accelerator_targets.target_against_chip
    assert pair(chip, predicted) == (9.0e9, 9.1e9)
    assert pair({"program_bytes": 10.2e9}, predicted) == (10.0e9, 10.2e9)
    # Predictions saved with the peak alone: the chip's program, as before.
    assert pair({"program_bytes": 10.2e9}, {"target_peak_bytes": 9.0e9}) == (
        9.0e9,
        10.2e9,
    )
    assert pair({"program_bytes": 10.2e9}, {}) is None
