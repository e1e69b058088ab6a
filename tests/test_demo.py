import keras

from keras_hub_autodist import cli
from keras_hub_autodist import demo


def test_demo_runs_end_to_end_on_the_embedded_preset(capsys):
    result = demo.run_demo(steps=2)
    out = capsys.readouterr().out
    plan = result["plan"]
    assert plan.backbone_class == "GemmaBackbone"
    assert plan.mesh_axes.shape == (2, 4)
    assert "num_key_value_heads=1 does not divide by model=4" in out
    assert "per device:" in out and "Completion of 'the quick brown'" in out
    assert isinstance(result["completion"], str)
    assert result["completion"].startswith("the quick brown")
    assert len(result["losses"]) == 2
    assert keras.distribution.distribution() is None


def test_sentencepiece_training_is_deterministic():
    assert demo.sentencepiece_proto() == demo.sentencepiece_proto()


def test_virtual_cpu_devices_are_set_only_when_unset(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    demo.use_virtual_cpu_devices(8)
    import os

    assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=2"
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert demo.has_accelerator() is False


def test_demo_cli_rejects_bad_mesh(capsys):
    try:
        status = cli.main(["demo", "--mesh", "batch=two"])
    except SystemExit as exit_:
        status = exit_.code
    assert status == 2
    assert "--mesh takes name=size pairs" in capsys.readouterr().err
