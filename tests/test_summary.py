"""One line after from_preset(device_mesh=): mesh (and what "auto" chose and
why), strategy, GiB per device; also `keras_hub_autodist.summary`."""

import keras
import keras_hub

import keras_hub_autodist


def test_from_preset_prints_one_summary_line(tiny_presets_dir, capsys):
    capsys.readouterr()
    lm = keras_hub.models.CausalLM.from_preset(
        tiny_presets_dir["gemma_mqa"], device_mesh="auto"
    )
    printed = capsys.readouterr().out.splitlines()
    line = keras_hub_autodist.summary(lm)
    assert printed == [line]
    assert line.startswith("GemmaBackbone on mesh batch=")
    assert "(auto over 8 devices: " in line  # what auto chose, and why
    assert ", strategy tp, per device: " in line
    assert "GiB of weights, about " in line and "GiB to train with Adam" in line
    _, plan = keras_hub_autodist.distribution_of(lm)
    assert keras_hub_autodist.summary(plan) == line


def test_the_line_follows_keras_interactive_logging(tiny_presets_dir, capsys):
    capsys.readouterr()
    keras.config.disable_interactive_logging()
    try:
        keras_hub.models.CausalLM.from_preset(
            tiny_presets_dir["gemma_mqa"], device_mesh={"batch": 2, "model": 4}
        )
    finally:
        keras.config.enable_interactive_logging()
    assert "GemmaBackbone on mesh" not in capsys.readouterr().out
