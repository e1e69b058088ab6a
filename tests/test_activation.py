"""The plugin: `device_mesh=` on from_preset, the startup hook, the off switch."""

import os
import subprocess
import sys
import sysconfig
import textwrap

import keras_hub
import pytest

import keras_hub_autodist
from keras_hub_autodist import activation

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
    activation.deactivate()
    try:
        func = keras_hub.models.Task.__dict__["from_preset"].__func__
        assert not hasattr(func, "__keras_hub_autodist_original__")
    finally:
        activation.activate()


def test_switched_off_by_environment(monkeypatch):
    monkeypatch.setenv("KERAS_HUB_AUTODIST", "0")
    assert activation.activate() is False


def _run(python, code, env=None):
    base = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env = {**base, **(env or {})}
    return subprocess.run(
        [python, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=os.path.dirname(python),  # not the repository: import the installed copy
    )


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory):
    """A new virtual environment with a non-editable `pip install .`.

    Heavy dependencies (keras, keras-hub, jax, TensorFlow) come from this
    environment through a path file, so the test stays offline and fast; the
    package itself, its startup hook and its metadata are installed for real.
    """
    venv = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    site = _run(python, "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    purelib = site.stdout.strip()
    with open(os.path.join(purelib, "_outer_dependencies.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    wheel_dir = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "-q",
            "-w",
            str(wheel_dir),
            ROOT,
        ],
        check=True,
    )
    wheel = next(wheel_dir.glob("keras_hub_autodist-*.whl"))
    subprocess.run(
        [python, "-m", "pip", "install", "--no-deps", "-q", str(wheel)], check=True
    )
    assert os.path.exists(os.path.join(purelib, "keras_hub_autodist.pth"))
    return python


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
        print(hasattr(func, "__keras_hub_autodist_original__"),
              "keras_hub_autodist" in sys.modules)
    """
    result = _run(fresh_venv, code, {"KERAS_HUB_AUTODIST": "0", "KERAS_BACKEND": "jax"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["False", "False"]


@pytest.mark.venv
def test_startup_hook_costs_under_5ms(fresh_venv):
    result = _run(fresh_venv, "pass", {"PYTHONPROFILEIMPORTTIME": "1"})
    lines = [
        line for line in result.stderr.splitlines() if "keras_hub_autodist_hook" in line
    ]
    assert lines, result.stderr[-2000:]
    cumulative_us = int(lines[-1].split("|")[1])
    assert cumulative_us < 5000
    assert "keras_hub" not in result.stderr.replace("keras_hub_autodist_hook", "")


@pytest.mark.venv
def test_broken_hook_never_breaks_start_up(fresh_venv, tmp_path):
    # A keras_hub_autodist that fails to import: start-up and keras_hub still work.
    broken = tmp_path / "keras_hub_autodist"
    broken.mkdir()
    (broken / "__init__.py").write_text("raise RuntimeError('boom')\n")
    (broken / "activation.py").write_text("")
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
