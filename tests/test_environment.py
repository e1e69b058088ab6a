"""Environment variables: one parser of on/off switches, an unknown value is
an error that names it; the cache folder follows the XDG spec."""

import importlib.util
import io
import os
import sys
import warnings

import keras_hub
import pytest

import keras_hub_autodist
from keras_hub_autodist import environment
from keras_hub_autodist import plugin
from keras_hub_autodist.errors import EnvironmentVariableError
from keras_hub_autodist.errors import PluginOffError
from keras_hub_autodist.loading import progress
from keras_hub_autodist.reading import disk_cache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOOK = os.path.join(ROOT, "startup", "keras_hub_autodist_hook.py")
MESH = {"batch": 2, "model": 4}


def load_hook(monkeypatch, switch):
    """This checkout's startup hook, run as at start-up with `switch` set
    (keras_hub is imported: it acts at once)."""
    monkeypatch.setenv("KERAS_HUB_AUTODIST", switch)
    spec = importlib.util.spec_from_file_location("hook_under_test", HOOK)
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    return hook


@pytest.mark.parametrize(
    "text, value",
    [("1", True), (" On ", True), ("YES", True), ("y", True), ("enabled", True)]
    + [("0", False), ("off", False), ("No", False), ("n", False)]
    + [("disabled", False), ("DISABLE", False), ("false", False), ("none", False)],
)
def test_switch_spellings(text, value):
    assert environment.parse_switch("SOME_SWITCH", text) is value


@pytest.mark.parametrize("text", ["2", "maybe", "of", "offf", "yes please", "-1"])
def test_an_unknown_switch_value_names_the_variable_and_the_values(text):
    with pytest.raises(EnvironmentVariableError) as raised:
        environment.parse_switch("SOME_SWITCH", text)
    message = str(raised.value)
    assert f"Received: SOME_SWITCH={text!r}" in message
    assert "on: 1, enable, enabled" in message and "off: 0, disable" in message


def test_the_startup_hook_spells_the_switch_as_the_parser_does(monkeypatch):
    """The hook can't import the package: its copy of the spellings is the
    parser's."""
    hook = load_hook(monkeypatch, "1")
    assert hook.OFF_VALUES == environment.OFF_VALUES
    assert hook.ON_VALUES == environment.ON_VALUES
    for value in environment.OFF_VALUES:
        assert hook.switched_off({"KERAS_HUB_AUTODIST": value.upper()})
    for value in environment.ON_VALUES:
        environ = {"KERAS_HUB_AUTODIST": value}
        assert not hook.switched_off(environ) and not hook.unknown_switch(environ)


def test_an_unknown_startup_switch_warns_and_guards(monkeypatch):
    plugin.deactivate()
    try:
        with pytest.warns(UserWarning, match=r"KERAS_HUB_AUTODIST='of' is neither"):
            load_hook(monkeypatch, "of")
        with pytest.raises(PluginOffError, match=r"KERAS_HUB_AUTODIST='of'.*off: 0"):
            keras_hub.models.Backbone.from_preset("./unread", device_mesh=MESH)
    finally:
        plugin.activate()


@pytest.mark.parametrize(
    "setting, tty, shown",
    [("disabled", True, False), ("n", True, False), ("No", True, False)]
    + [("1", False, True), ("on", False, True), ("", True, True), ("", False, False)],
)
def test_the_progress_switch(monkeypatch, setting, tty, shown):
    stream = io.StringIO()
    stream.isatty = lambda: tty
    monkeypatch.setattr("sys.stderr", stream)
    monkeypatch.setenv(progress.PROGRESS_ENV, setting)
    assert progress.progress_enabled(None) is shown
    assert progress.progress_enabled(not shown) is (not shown)  # the keyword wins


@pytest.mark.parametrize("setting, shown", [("", True), ("off", False), ("1", True)])
def test_the_progress_bar_is_on_in_a_jupyter_kernel(monkeypatch, setting, shown):
    """Off a terminal (a kernel's stderr is no tty), a notebook shows the bar
    by default; the switch still turns it off."""
    import types

    stream = io.StringIO()
    stream.isatty = lambda: False
    monkeypatch.setattr("sys.stderr", stream)
    monkeypatch.setenv(progress.PROGRESS_ENV, setting)
    shell = types.SimpleNamespace(kernel=object())
    monkeypatch.setitem(
        sys.modules, "IPython", types.SimpleNamespace(get_ipython=lambda: shell)
    )
    assert progress.progress_enabled(None) is shown
    shell.kernel = None  # a terminal IPython: no kernel
    assert progress.progress_enabled(None) is (setting == "1")


@pytest.mark.parametrize("setting", ["maybe", "2", "offf"])
def test_an_unknown_progress_value_fails_before_any_work(monkeypatch, setting):
    """Before the preset is even read."""
    monkeypatch.setenv(progress.PROGRESS_ENV, setting)
    with pytest.raises(
        EnvironmentVariableError,
        match=rf"KERAS_HUB_AUTODIST_PROGRESS is an on/off switch.*"
        rf"Received: KERAS_HUB_AUTODIST_PROGRESS={setting!r}",
    ):
        keras_hub_autodist.from_preset(
            keras_hub.models.Backbone, "./unread", device_mesh=MESH
        )


def test_the_cache_switch_uses_the_parser(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    default = tmp_path / "xdg" / "keras_hub_autodist" / "abstract"
    for value in ["off", "disabled", "n", "NONE", "0"]:
        monkeypatch.setenv(disk_cache.CACHE_ENV, value)
        assert disk_cache.cache_folder() is None, value
    for value in ["1", "on", "yes", "", "  "]:
        monkeypatch.setenv(disk_cache.CACHE_ENV, value)
        assert disk_cache.cache_folder() == default, value
    monkeypatch.setenv(disk_cache.CACHE_ENV, str(tmp_path / "mine"))
    assert disk_cache.cache_folder() == tmp_path / "mine"


@pytest.mark.parametrize("xdg", ["cache", "./cache", "~/cache", ""])
def test_a_relative_xdg_cache_home_is_ignored(monkeypatch, tmp_path, xdg):
    """The XDG spec: a relative path in `XDG_CACHE_HOME` is invalid and
    ignored, so the cache never lands in the working folder."""
    monkeypatch.delenv(disk_cache.CACHE_ENV, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", xdg)
    monkeypatch.chdir(tmp_path)
    folder = disk_cache.cache_folder()
    assert folder == tmp_path / "home" / ".cache" / "keras_hub_autodist" / "abstract"
    assert folder.is_absolute()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert disk_cache.cache_folder() == tmp_path / "xdg" / "keras_hub_autodist" / (
        "abstract"
    )


def test_parsing_a_switch_warns_nothing():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert environment.read_switch("SOME_SWITCH", {"SOME_SWITCH": " "}) is None
