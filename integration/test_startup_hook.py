"""The plugin as installed: the startup hook in a fresh virtual environment,
`python -S`, the off switch and a broken install."""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap

import pytest
import venvs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_python_dash_s_guard_then_explicit_import():
    # `python -S` runs no .pth file: the hook is run by hand here, as the .pth
    # would with the plugin switched off; then `import keras_hub_autodist`.
    code = f"""
        import importlib.util, os, sys
        os.environ["KERAS_BACKEND"] = "jax"
        os.environ["KERAS_HUB_AUTODIST"] = "no"
        assert "keras_hub_autodist_hook" not in sys.modules
        spec = importlib.util.spec_from_file_location(
            "keras_hub_autodist_hook",
            {os.path.join(ROOT, "startup", "keras_hub_autodist_hook.py")!r})
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
        import keras_hub
        try:
            keras_hub.models.CausalLM.from_preset("./x", device_mesh={{"batch": 8}})
        except TypeError as error:
            caught = error
        print(type(caught).__name__, "keras_hub_autodist" in sys.modules)
        import keras_hub_autodist
        func = keras_hub.models.Task.__dict__["from_preset"].__func__
        print(isinstance(caught, keras_hub_autodist.AutodistError),
              keras_hub_autodist.errors.PluginOffError is type(caught),
              hasattr(func, "__keras_hub_autodist_guard__"),
              keras_hub_autodist.__file__.startswith({ROOT!r}))
    """
    purelib = sysconfig.get_paths()["purelib"]
    env = {
        **{k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
        "PYTHONPATH": os.pathsep.join([ROOT, purelib]),
    }
    result = subprocess.run(
        [sys.executable, "-S", "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=os.path.dirname(ROOT),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.split("\n")
    assert lines[0].split() == ["PluginOffError", "False"]
    assert lines[1].split() == ["True", "True", "False", "True"]


_run = venvs.run


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory):
    """A new virtual environment with this package installed for real."""
    return venvs.fresh_venv(tmp_path_factory)


@pytest.mark.venv
def test_plugin_works_without_importing_it(fresh_venv, tiny_presets_dir):
    code = f"""
        import os, sys
        os.environ["KERAS_BACKEND"] = "jax"
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
        assert "keras_hub_autodist" not in sys.modules
        import keras_hub
        assert "site-packages" in sys.modules["keras_hub_autodist"].__file__
        lm = keras_hub.models.GemmaCausalLM.from_preset(
            {tiny_presets_dir["gemma_mqa"]!r}, device_mesh={{"batch": 2, "model": 4}})
        print(lm.backbone.weights[0].value.sharding.spec)
    """
    result = _run(fresh_venv, code)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "P('model', None)" in result.stdout


@pytest.mark.venv
def test_plugin_is_off_with_environment_switch(fresh_venv):
    code = """
        import sys
        import keras_hub
        func = keras_hub.models.Backbone.__dict__["from_preset"].__func__
        try:
            keras_hub.models.Backbone.from_preset("./x", device_mesh={"batch": 2})
        except TypeError as error:
            print(type(error).__name__)
        print(hasattr(func, "__keras_hub_autodist_guard__"),
              "keras_hub_autodist" in sys.modules)
    """
    result = _run(fresh_venv, code, {"KERAS_HUB_AUTODIST": "0", "KERAS_BACKEND": "jax"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["PluginOffError", "True", "False"]


# What the startup hook must never import: it runs in every Python process of
# the environment, most of which never use keras-hub.
HEAVY_MODULES = {
    "keras",
    "keras_hub",
    "keras_hub_autodist",
    "jax",
    "numpy",
    "tensorflow",
}


def imported_under(importtime: str, module: str) -> list[str]:
    """The modules `module` imported, from `-X importtime` output.

    Each line reads `import time: self | cumulative | <indent>name`; a
    module's own imports end just before it, indented deeper.
    """
    lines = [line.split("|")[-1] for line in importtime.splitlines() if "|" in line]
    names = [(len(line) - len(line.lstrip()), line.strip()) for line in lines]
    index = max(i for i, (_, name) in enumerate(names) if name == module)
    depth = names[index][0]
    found = []
    for indent, name in reversed(names[:index]):
        if indent <= depth:
            break
        found.append(name)
    return found


@pytest.mark.venv
def test_startup_hook_only_installs_a_finder(fresh_venv):
    code = """
        import json, sys
        finders = [type(f).__module__ for f in sys.meta_path]
        print(json.dumps({"modules": sorted(sys.modules), "finders": finders}))
    """
    result = _run(fresh_venv, code, {"PYTHONPROFILEIMPORTTIME": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    started = json.loads(result.stdout)
    # The hook ran at start-up and left the package's one finder
    # (`keras_hub_autodist/on_import.py`, loaded without the package)
    # waiting for keras_hub...
    assert "keras_hub_autodist_hook" in started["modules"]
    assert "keras_hub_autodist.on_import" in started["finders"]
    # ...having imported nothing heavy, only the standard library.
    assert not HEAVY_MODULES & set(started["modules"])
    hook_imports = imported_under(result.stderr, "keras_hub_autodist_hook")
    assert all(
        name.split(".")[0] in sys.stdlib_module_names for name in hook_imports
    ), hook_imports
    assert "keras_hub" not in result.stderr.replace("keras_hub_autodist_hook", "")


@pytest.mark.venv
def test_broken_hook_never_breaks_start_up(fresh_venv, tmp_path):
    # A keras_hub_autodist that fails to import: start-up and keras_hub still work.
    broken = tmp_path / "keras_hub_autodist"
    broken.mkdir()
    (broken / "__init__.py").write_text("raise RuntimeError('boom')\n")
    (broken / "plugin.py").write_text("")
    # The standard-library module the hook loads by path, as any install has.
    shutil.copy(os.path.join(ROOT, "keras_hub_autodist", "on_import.py"), broken)
    code = """
        import warnings
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import keras_hub
        print(any("could not add `device_mesh=`" in str(w.message) for w in caught))
    """
    result = _run(
        fresh_venv, code, {"PYTHONPATH": str(tmp_path), "KERAS_BACKEND": "jax"}
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "True"
