import contextlib
import io
import warnings

import keras
import pytest
from real_presets import REAL_PRESETS

import keras_hub_autodist
from keras_hub_autodist import cli
from keras_hub_autodist import demo
from keras_hub_autodist import devices


def noted_rows(text: str) -> list[str]:
    """The rows of the first plan table in `text` that have a note."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("weight "))
    column = lines[start].index("note")
    rows = []
    for line in lines[start + 1 :]:
        if not line.strip():
            break
        if line[column:].strip():
            rows.append(line)
    return rows


@pytest.fixture(scope="module")
def demo_run():
    """One default run of the demo: its result, printed text and warnings."""
    out, err = io.StringIO(), io.StringIO()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            result = demo.run_demo()
    return result, out.getvalue(), err.getvalue(), caught


def test_demo_runs_end_to_end_on_the_embedded_preset(demo_run):
    result, out, _, _ = demo_run
    plan = result["plan"]
    assert plan.backbone_class == "GemmaBackbone"
    assert plan.mesh_axes.shape == (2, 4)
    assert "num_key_value_heads=1 does not divide by model=4" in out
    assert "per device:" in out
    assert result["steps"] == demo.STEPS  # --steps: optimizer steps
    assert keras.distribution.distribution() is None


def test_demo_shows_what_fine_tuning_changed(demo_run):
    result, out, _, _ = demo_run
    assert result["loss_after"] < result["loss_before"] / 2
    assert result["completion_before"] != result["completion"]
    assert demo.TARGET not in result["completion_before"]
    assert demo.TARGET in result["completion"]
    assert f"Before fine-tuning: loss {result['loss_before']:.3f}" in out
    assert f"After fine-tuning: loss {result['loss_after']:.3f}" in out
    assert f"completion of 'the quick brown': {result['completion']!r}" in out
    assert "'the quick brown' completes to the demo sentence" in out


def test_demo_names_its_devices_and_counts_fallbacks_as_shown(demo_run):
    _, out, _, _ = demo_run
    assert "Devices: 8 virtual CPU devices (" in out
    assert len(noted_rows(out)) == 3
    assert f"fallbacks: {len(noted_rows(out))} table rows (5 weights)" in out


def test_demo_prints_no_warnings(demo_run):
    _, out, err, caught = demo_run
    # Python hides these categories by default; everything else is shown.
    # (keras-hub's SentencePieceTokenizer leaves its proto file open.)
    hidden = (
        DeprecationWarning,
        PendingDeprecationWarning,
        ImportWarning,
        ResourceWarning,
    )
    shown = [
        f"{w.category.__name__}: {w.message}"
        for w in caught
        if not issubclass(w.category, hidden)
    ]
    assert shown == []
    assert "warn" not in (out + err).lower()


def test_fallbacks_are_counted_in_layout_keys_with_their_weights():
    plan = keras_hub_autodist.plan(
        str(REAL_PRESETS / "gemma_7b"), {"batch": 2, "model": 3}
    )
    text = demo.describe_plan(plan)
    noted = noted_rows(plan.table())
    assert noted and len(plan.fallbacks) > len(noted)
    assert f"fallbacks: {len(noted)} table rows ({len(plan.fallbacks)} weights)" in text
    assert text.count("fallbacks:") == 1


def test_sentencepiece_training_is_deterministic():
    assert demo.sentencepiece_proto(demo.SENTENCES) == demo.sentencepiece_proto(
        demo.SENTENCES
    )


def test_virtual_cpu_devices_are_set_only_when_unset(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    devices.use_virtual_cpu_devices(8)
    import os

    assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=2"
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert devices.has_accelerator() is False


def test_demo_cli_rejects_bad_mesh(capsys):
    try:
        status = cli.main(["demo", "--mesh", "batch=two"])
    except SystemExit as exit_:
        status = exit_.code
    assert status == 2
    assert "--mesh takes name=size pairs" in capsys.readouterr().err
