"""One step, one verdict: the estimate, the compiled check, the advice, the
automatic mesh and a bound `fit` agree on the step a mesh runs. A batch the
batch axis doesn't divide is padded to a multiple of it; a sequence the
context axis doesn't divide is refused, with one error naming the flag on
the command line and the argument in Python."""

import json
import re

import keras
import pytest

import keras_hub_autodist
from keras_hub_autodist import MeshError
from keras_hub_autodist import SequenceLengthError
from keras_hub_autodist import cli
from keras_hub_autodist.fitting import report
from keras_hub_autodist.fitting import step_memory
from keras_hub_autodist.planning import step_shape
from keras_hub_autodist.planning.distribution import plan_distribution


def run_plan(capfd, *args):
    """The exit status, the `--json` answer (or None) and stderr."""
    capfd.readouterr()
    status = cli.main(["plan", *args, "--json"])
    captured = capfd.readouterr()
    lines = captured.out.strip().splitlines()
    return status, (json.loads(lines[0]) if lines else None), captured.err


def mesh_of(plan):
    axes = plan.mesh_axes
    devices = keras.distribution.list_devices()[: axes.num_devices]
    return keras.distribution.DeviceMesh(axes.shape, axes.axis_names, devices)


CONTEXT = {"batch": 2, "context": 4}


@pytest.mark.parametrize("compiled", [[], ["--compiled"]])
def test_the_command_refuses_a_sequence_the_context_axis_does_not_split(
    tiny_presets_dir, capfd, compiled
):
    # Before: the estimate answered `fits: true` for 6 tokens on context=4,
    # which `--compiled` and `fit` refuse.
    preset = tiny_presets_dir["gemma_mqa"]
    args = [preset, "--mesh", "batch=2,context=4", "--batch", "2", "--seq", "6"]
    status, answer, err = run_plan(capfd, *args, *compiled)
    assert status == 2 and answer is None, err
    assert len(err.strip().splitlines()) == 1, err
    assert "splits each sequence over 4 devices" in err
    # The flags, never the Python arguments.
    assert "`--seq` that is a multiple of 4 (e.g. 4 or 8)" in err
    assert "`--mesh batch=4,context=2`" in err
    assert "Received: --seq 6" in err
    assert "sequence_length" not in err and "device_mesh" not in err


def test_python_refuses_it_everywhere_with_fits_own_error(tiny_presets_dir):
    plan = keras_hub_autodist.plan(tiny_presets_dir["gemma_mqa"], CONTEXT)
    refusals = {
        "estimate": lambda: step_memory.step_estimate(plan, 2, 6),
        "activations": lambda: plan.activation_bytes_per_device(2, 6),
        "verdict": lambda: report.memory_verdict(plan, 2, 6),
        "advice": lambda: plan.fit_advice(2, 6),
        "compiled": lambda: keras_hub_autodist.compiled_memory(plan, 2, 6),
    }
    # What a bound `fit` asks of its distribution for each batch.
    distribution = plan_distribution(plan, mesh_of(plan))
    with pytest.raises(SequenceLengthError) as fit_error:
        distribution.get_data_layout((2, 6))
    head = str(fit_error.value).split(" Use ")[0]
    for name, refusal in refusals.items():
        with pytest.raises(SequenceLengthError) as error:
            refusal()
        message = str(error.value)
        assert message.split(" Use ")[0] == head, name
        assert "a `sequence_length=` that is a multiple of 4" in message, name
        assert "`device_mesh={'batch': 4, 'context': 2}`" in message, name
        assert "Received: sequence_length=6" in message, name
    # A length the context axis splits is answered.
    assert step_memory.step_estimate(plan, 2, 8).activations > 0


def test_a_padded_batch_is_estimated_and_compiled_as_fit_runs_it(
    tiny_presets_dir, capfd
):
    # Before: the estimate answered for 3 rows on batch=4 while `--compiled`
    # refused them, naming `batch_size=`. A bound `fit` pads them to 4.
    preset = tiny_presets_dir["gemma_mqa"]
    answers = {}
    for batch in ("3", "4"):
        args = [preset, "--mesh", "batch=4", "--batch", batch, "--seq", "32"]
        status, answers[batch], err = run_plan(capfd, *args, "--compiled")
        assert status == 0, err
    padded, whole = answers["3"], answers["4"]
    assert padded["batch_size"] == 3 and padded["padded_batch_size"] == 4
    assert whole["padded_batch_size"] == 4
    assert padded["estimate_bytes_per_device"] == whole["estimate_bytes_per_device"]
    assert (
        padded["compiled_peak_bytes_per_device"]
        == whole["compiled_peak_bytes_per_device"]
    )
    capfd.readouterr()
    assert cli.main(["plan", preset, "--mesh", "batch=4", "--batch", "3"] + [
        "--seq", "32"]) == 0  # fmt: skip
    text = capfd.readouterr().out
    assert "3 x 32 tokens (padded to 4 sequences" in text
    # In Python: the same padded step.
    plan = keras_hub_autodist.plan(preset, {"batch": 4})
    memory = keras_hub_autodist.compiled_memory(plan, 3, 32)
    assert memory.batch_size == 3 and memory.padded_batch_size == 4
    assert "batch 3 (padded to 4) x 32 tokens" in memory.summary()
    assert memory.peak_bytes == whole["compiled_peak_bytes_per_device"]
    assert step_memory.step_estimate(plan, 3, 32) == step_memory.step_estimate(
        plan, 4, 32
    )


def _proposed_steps(advice, batch_size, sequence_length):
    """The (batch, sequence) steps the advice proposes."""
    steps = []
    for line in advice:
        found = re.match(r"a smaller batch: (\d+) sequences of (\d+) tokens", line)
        found = found or re.match(r"shorter sequences: (\d+) x (\d+) tokens", line)
        if found:
            steps.append((int(found[1]), int(found[2])))
    return steps


@pytest.mark.parametrize(
    "mesh, batch_size, sequence_length",
    [
        ({"batch": 1, "context": 8}, 1, 64),
        ({"batch": 2, "context": 4}, 2, 24),
        ({"batch": 4, "model": 2}, 6, 64),
        ({"batch": 8}, 12, 40),
    ],
)
def test_the_advice_proposes_only_steps_the_mesh_runs(
    tiny_presets_dir, mesh, batch_size, sequence_length
):
    # Before: on context=8 the advice proposed "1 x 4 tokens", which the
    # mesh refuses; and batches below the batch axis, which cost as much.
    # A LoRA fine-tune: the state is small, the activations count.
    # Judged as this CPU's compiler counts (no margin: its estimate is its
    # buffers), so that every budget below the step's is a NO with advice.
    plan = keras_hub_autodist.plan(tiny_presets_dir["gemma_mqa"], mesh, lora_rank=4)
    axes = plan.mesh_axes
    full = step_memory.step_estimate(
        plan, batch_size, sequence_length, platform="cpu"
    ).total_bytes
    state = step_memory.step_estimate(plan, None, None, platform="cpu").total_bytes
    proposed = []
    # Every budget between the state alone and the whole step.
    for step in range(1, 61):
        capacity = state + (full - state) * step // 60
        tight = plan.replace(device_memory_bytes=capacity)
        advice = tight.fit_advice(batch_size, sequence_length, platform="cpu")
        for batch, sequence in _proposed_steps(advice, batch_size, sequence_length):
            proposed.append((batch, sequence))
            # The mesh runs it: the context axis splits the sequence ...
            assert sequence % axes.size(axes.context_axis) == 0, advice
            runs = step_shape.runnable_step(axes, batch, sequence)
            assert batch < batch_size or sequence < sequence_length
            # ... and a smaller batch is whole rows per device, not one the
            # mesh pads back to the size of a larger one.
            if batch < batch_size:
                assert batch % axes.size(axes.batch_axis) == 0, advice
                assert not runs.padded, (batch, advice)
            fits, _, _ = report.memory_verdict(tight, batch, sequence, platform="cpu")
            assert fits, (batch, sequence, advice)
    assert proposed  # the advice was put to the test


def test_the_advice_names_the_step_as_flags_on_the_command_line(tiny_presets_dir):
    plan = keras_hub_autodist.plan(tiny_presets_dir["gemma_mqa"], {"batch": 4})
    full = step_memory.step_estimate(plan, 64, 32, platform="cpu").total_bytes
    tight = plan.replace(device_memory_bytes=full * 3 // 4, lora_rank=4)
    advice = tight.fit_advice(64, 32, platform="cpu")
    smaller = next(line for line in advice if line.startswith("a smaller batch"))
    assert "(`batch_size=" in smaller
    assert "`--batch " in cli.as_flags(smaller)
    assert "batch_size" not in cli.as_flags(smaller)
    # The compiled check: the Python call in Python, the flag on the command
    # line, never both.
    assert report.COMPILED_CHECK in advice[-1] and "--compiled" not in advice[-1]
    as_flags = cli.as_flags(advice[-1])
    assert "`--compiled`" in as_flags and "compiled_memory(" not in as_flags
    assert cli.as_flags("Received: sequence_length=6, batch_size=3") == (
        "Received: --seq 6, --batch 3"
    )


def test_the_automatic_mesh_accepts_the_requested_batch(tiny_presets_dir, capfd):
    # Before: `--mesh auto --batch 2` chose batch=8, then `--compiled`
    # refused its own choice.
    preset = tiny_presets_dir["gemma_mqa"]
    args = [preset, "--mesh", "auto", "--devices", "8", "--batch", "2"]
    status, answer, err = run_plan(capfd, *args, "--seq", "32", "--compiled")
    assert status == 0, err
    assert answer["mesh"] == {"batch": 2, "model": 4}
    assert answer["padded_batch_size"] == 2
    # Without a batch, the largest batch axis, as `from_preset` chooses.
    unbatched = keras_hub_autodist.plan(preset, "auto", num_devices=8)
    assert unbatched.mesh_axes.size("batch") == 8
    for batch_size in (1, 2, 3, 4, 6, 12):
        chosen = keras_hub_autodist.plan(
            preset, "auto", num_devices=8, batch_size=batch_size
        )
        assert batch_size % chosen.mesh_axes.size("batch") == 0
    with pytest.raises(MeshError, match="`batch_size=` goes with"):
        keras_hub_autodist.plan(preset, {"batch": 8}, batch_size=2)
    with pytest.raises(MeshError, match="Received: batch_size=0"):
        keras_hub_autodist.plan(preset, "auto", num_devices=8, batch_size=0)
