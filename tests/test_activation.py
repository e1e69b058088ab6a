"""The plugin: `device_mesh=` on from_preset, the startup hook, the off switch."""

import importlib.util
import os

import keras_hub
import pytest

import keras_hub_autodist
from keras_hub_autodist import plugin

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_activate_is_idempotent():
    before = keras_hub.models.Backbone.__dict__["from_preset"].__func__
    assert keras_hub_autodist.activate() and keras_hub_autodist.activate()
    after = keras_hub.models.Backbone.__dict__["from_preset"].__func__
    assert before is after
    original = after.__keras_hub_autodist_original__
    assert getattr(original, "__keras_hub_autodist_original__", None) is None
    assert "device_mesh" in keras_hub.models.CausalLM.from_preset.__doc__


def test_deactivate_restores_the_original():
    plugin.deactivate()
    try:
        func = keras_hub.models.Task.__dict__["from_preset"].__func__
        assert not hasattr(func, "__keras_hub_autodist_original__")
    finally:
        plugin.activate()


def load_hook(monkeypatch, switch):
    """This checkout's startup hook, run as at start-up with `switch` set.

    The installed copy of the hook was imported when the interpreter started;
    this loads startup/keras_hub_autodist_hook.py under another name.
    """
    monkeypatch.setenv("KERAS_HUB_AUTODIST", switch)
    path = os.path.join(ROOT, "startup", "keras_hub_autodist_hook.py")
    spec = importlib.util.spec_from_file_location("hook_under_test", path)
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)  # keras_hub is imported: acts at once
    return hook


def from_preset_func(base=keras_hub.models.Backbone):
    return base.__dict__["from_preset"].__func__


@pytest.fixture
def plugin_off(monkeypatch):
    """keras-hub as the startup hook leaves it with the plugin switched off."""
    plugin.deactivate()
    try:
        yield load_hook(monkeypatch, "off")
    finally:
        plugin.activate()


def test_explicit_activation_ignores_the_environment_switch(monkeypatch):
    monkeypatch.setenv("KERAS_HUB_AUTODIST", "0")
    plugin.deactivate()
    try:
        assert plugin.activate() is True
        assert from_preset_func().__keras_hub_autodist_original__
    finally:
        plugin.activate()


@pytest.mark.parametrize(
    "value, off",
    [("0", True), ("off", True), ("OFF", True), ("No", True), (" false ", True)]
    + [("n", True), ("1", False), ("on", False), ("", False), ("yes", False)],
)
def test_switch_spellings(monkeypatch, value, off):
    hook = load_hook(monkeypatch, "1")
    assert hook.switched_off({"KERAS_HUB_AUTODIST": value}) is off


def test_switched_off_device_mesh_raises(plugin_off, tiny_presets_dir):
    assert from_preset_func().__keras_hub_autodist_guard__
    preset = tiny_presets_dir["gemma_mqa"]
    with pytest.raises(
        keras_hub_autodist.errors.PluginOffError,
        match=r"KERAS_HUB_AUTODIST='off' switched.*`import keras_hub_autodist`.*"
        r"unset KERAS_HUB_AUTODIST\. Received: device_mesh=\{'batch': 8\}",
    ):
        keras_hub.models.Backbone.from_preset(preset, device_mesh={"batch": 8})
    with pytest.raises(TypeError, match="Received: strategy='tp'"):
        keras_hub.models.CausalLM.from_preset(preset, strategy="tp")
    # Everything else passes through to keras-hub.
    backbone = keras_hub.models.Backbone.from_preset(preset, load_weights=False)
    assert isinstance(backbone, keras_hub.models.GemmaBackbone)


def test_explicit_activation_replaces_the_guard(plugin_off):
    assert plugin.activate()
    func = from_preset_func(keras_hub.models.Task)
    assert not getattr(func, "__keras_hub_autodist_guard__", False)
    original = func.__keras_hub_autodist_original__
    assert not hasattr(original, "__keras_hub_autodist_original__")


def test_positional_arguments_rejected_as_keras_hub_does(tiny_presets_dir):
    preset = tiny_presets_dir["gemma_mqa"]
    mesh = {"batch": 8}
    cls = keras_hub.models.CausalLM
    with pytest.raises(TypeError, match="positional"):
        cls.from_preset(preset, True, False)  # keras-hub's own error
    with pytest.raises(
        keras_hub_autodist.errors.ArgumentError,
        match=r"too many positional arguments. Pass options as keywords.*"
        r"Received: args=\(True, False\)",
    ):
        cls.from_preset(preset, True, False, device_mesh=mesh)
    with pytest.raises(
        keras_hub_autodist.errors.ArgumentError,
        match="multiple values for argument 'load_weights'",
    ):
        cls.from_preset(preset, True, load_weights=False, device_mesh=mesh)


def test_positional_load_weights_is_kept(tiny_presets_dir, monkeypatch):
    seen = {}

    def spy(cls, preset, **kwargs):
        seen.update(kwargs)
        raise RuntimeError("stop before loading")

    monkeypatch.setattr(plugin, "from_preset", spy)
    with pytest.raises(RuntimeError, match="stop before loading"):
        keras_hub.models.CausalLM.from_preset(
            tiny_presets_dir["gemma_mqa"], False, device_mesh={"batch": 8}
        )
    assert seen["load_weights"] is False


def test_empty_strategy_is_an_error(tiny_presets_dir):
    with pytest.raises(keras_hub_autodist.StrategyError, match="strategy=''"):
        keras_hub.models.CausalLM.from_preset(
            tiny_presets_dir["gemma_mqa"], device_mesh={"batch": 8}, strategy=""
        )


def test_package_errors_for_bad_classes_and_unbound_models(tiny_presets_dir):
    with pytest.raises(
        keras_hub_autodist.errors.ModelClassError,
        match="int has no from_preset.*Received: cls=<class 'int'>",
    ):
        keras_hub_autodist.from_preset(
            int, tiny_presets_dir["gemma_mqa"], device_mesh={"batch": 8}
        )
    with pytest.raises(
        keras_hub_autodist.errors.NotBoundError,
        match="not bound to a distribution.*Received: model of type object",
    ):
        keras_hub_autodist.distribution_of(object())
