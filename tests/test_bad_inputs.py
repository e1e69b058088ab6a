"""Bad inputs: one line and exit status 2 from the command, the package's own
error (or a coerced value) from Python."""

import os
import subprocess
import sys
import time

import keras
import numpy as np
import pytest
from real_presets import REAL_PRESETS
from test_cli import assert_one_line_error
from test_cli import run

import keras_hub_autodist
from keras_hub_autodist import cli
from keras_hub_autodist import demo
from keras_hub_autodist.errors import DemoError
from keras_hub_autodist.errors import MeshError
from keras_hub_autodist.planning.mesh import MAX_DEVICES
from keras_hub_autodist.planning.mesh import build_device_mesh
from keras_hub_autodist.planning.mesh import resolve_mesh_axes
from keras_hub_autodist.reading import network

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --- The command -------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["plan", "PRESET", "--mesh", "batch=2", "--device-memory", "1e300"],
            "from one byte to 1048576 GiB",
        ),
        (
            ["plan", "PRESET", "--mesh", "batch=2", "--device-memory", "1e-300"],
            "from one byte to 1048576 GiB",
        ),
        (
            ["plan", "PRESET", "--mesh", "auto", "--devices", str(10**12)],
            f"--devices takes at most {MAX_DEVICES} (2**20) devices",
        ),
        (
            ["plan", "PRESET", "--mesh", f"batch=2,model={10**12}"],
            f"A mesh spans at most {MAX_DEVICES} (2**20) devices",
        ),
        (
            ["demo", "--steps", "0"],
            "--steps takes a positive number of fine-tuning",
        ),
        (
            ["demo", "--steps", "-3"],
            "--steps takes a positive number of fine-tuning",
        ),
    ],
    ids=[
        "huge-device-memory",
        "tiny-device-memory",
        "huge-device-count",
        "huge-mesh",
        "zero-steps",
        "negative-steps",
    ],
)
def test_out_of_range_numbers_are_one_line(argv, message, capsys, monkeypatch):
    ran = []
    monkeypatch.setattr(cli, "_run_demo", ran.append)
    argv = [str(REAL_PRESETS / "gemma_2b") if a == "PRESET" else a for a in argv]
    status, _, err = run(argv, capsys)
    assert_one_line_error(status, err, message)
    assert ran == []  # refused before the demo builds anything


def test_an_overflow_is_one_line(capsys, monkeypatch):
    def overflow(args):
        raise OverflowError("int too large to convert to float")

    monkeypatch.setattr(cli, "_run_plan", overflow)
    status, _, err = run(["plan", "PRESET", "--mesh", "batch=2"], capsys)
    assert_one_line_error(status, err, "int too large to convert to float")


def test_a_config_json_holding_null_is_one_line(tmp_path, capsys):
    (tmp_path / "config.json").write_text("null")
    status, _, err = run(["plan", str(tmp_path), "--mesh", "batch=2"], capsys)
    assert_one_line_error(status, err, "config.json")


# Folders keras-hub's loaders refuse with a bare ValueError: each one is the
# package's own error (`except AutodistError` catches it), from `plan()`, from
# `from_preset(device_mesh=)` and from the command.
UNLOADABLE_CONFIGS = {
    "bogus": ({"model_type": "bogus_model", "hidden_size": 8}, "bogus_model"),
    "number": ({"model_type": 5}, "model_type='5'"),
    "neither": ({"hidden_size": 8}, "neither a Keras preset config nor"),
    "unregistered": (
        {"registered_name": "mine>NoSuchBackbone", "config": {}},
        "No class is registered with Keras as 'mine>NoSuchBackbone'",
    ),
}


@pytest.mark.parametrize("kind", sorted(UNLOADABLE_CONFIGS))
def test_a_folder_keras_hub_cant_load_is_our_error(tmp_path, capsys, kind):
    import json

    import keras_hub

    from keras_hub_autodist.errors import AutodistError

    config, message = UNLOADABLE_CONFIGS[kind]
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    for load in (
        lambda: keras_hub_autodist.plan(str(folder), {"batch": 2}),
        lambda: keras_hub.models.Backbone.from_preset(
            str(folder), device_mesh={"batch": 2, "model": 4}
        ),
    ):
        with pytest.raises(AutodistError, match=f"{message}.*Received: .*preset="):
            load()
    status, _, err = run(["plan", str(folder), "--mesh", "batch=2"], capsys)
    assert_one_line_error(status, err, message)
    assert "preset=" in err


def test_python_dash_m_runs_the_command(tmp_path):
    env = {**os.environ, "PYTHONPATH": ROOT}
    done = subprocess.run(
        [sys.executable, "-m", "keras_hub_autodist", "plan", "--help"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: keras-hub-autodist plan")
    done = subprocess.run(
        [sys.executable, "-m", "keras_hub_autodist", "plan", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.startswith("keras-hub-autodist: error:")
    assert "--mesh" in done.stderr


# --- An hf:// handle without network ---------------------------------------


@pytest.fixture
def hugging_face_hub(monkeypatch):
    """huggingface_hub's requests answered by `answer(request)`; its
    requests for `config.json` and its back-off sleeps are recorded (it may
    also ask for its own registries)."""
    import httpx2
    import huggingface_hub
    from huggingface_hub.utils import _http

    seen = {"requests": [], "sleeps": []}

    def record_sleep(seconds):
        seen["sleeps"].append(seconds)

    monkeypatch.setattr(time, "sleep", record_sleep)

    def use(answer):
        def handler(request):
            if str(request.url).endswith("/config.json"):
                seen["requests"].append(str(request.url))
            return answer(request)

        huggingface_hub.set_client_factory(
            lambda: httpx2.Client(transport=httpx2.MockTransport(handler))
        )
        return seen

    yield use
    huggingface_hub.set_client_factory(_http.default_client_factory)


def _offline(request):
    import httpx2

    raise httpx2.ConnectError("[Errno -2] Name or service not known", request=request)


def test_an_hf_handle_without_network_fails_fast_in_one_line(hugging_face_hub, capsys):
    seen = hugging_face_hub(_offline)
    preset = "hf://nobody-autodist/offline-model"
    status, _, err = run(["plan", preset, "--mesh", "batch=2,model=4"], capsys)
    assert_one_line_error(status, err, "the network is unreachable")
    assert f"preset={preset!r}" in err
    assert len(seen["requests"]) == 1 and seen["sleeps"] == []


def test_an_hf_handle_without_network_from_python(hugging_face_hub):
    seen = hugging_face_hub(_offline)
    with pytest.raises(keras_hub_autodist.PresetError, match="network is unreach"):
        keras_hub_autodist.plan("hf://nobody-autodist/offline", {"batch": 8})
    assert len(seen["requests"]) == 1 and seen["sleeps"] == []


def test_a_cached_hf_handle_asks_nothing_of_the_network(
    hugging_face_hub, tmp_path, monkeypatch
):
    import huggingface_hub

    seen = hugging_face_hub(_offline)
    repo = tmp_path / "models--someone--cached"
    sha = "0123456789abcdef0123456789abcdef01234567"
    (repo / "snapshots" / sha).mkdir(parents=True)
    (repo / "snapshots" / sha / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(sha)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    network.check_hugging_face_reachable("hf://someone/cached")
    assert seen["requests"] == []
    with pytest.raises(ConnectionError, match="did not answer"):
        network.check_hugging_face_reachable("hf://someone/not-cached")


def test_a_hub_that_answers_is_reachable(hugging_face_hub):
    import httpx2

    seen = hugging_face_hub(lambda request: httpx2.Response(404, request=request))
    network.check_hugging_face_reachable("hf://nobody-autodist/missing")
    assert len(seen["requests"]) == 1


# --- Mesh input types ------------------------------------------------------


def test_numpy_integer_axis_sizes_are_accepted():
    mesh = {"batch": np.int64(2), "model": np.int32(4)}
    given = dict(mesh)
    axes = resolve_mesh_axes(mesh)
    assert axes.shape == (2, 4) and all(type(n) is int for n in axes.shape)
    assert build_device_mesh(mesh).shape == (2, 4)
    plan = keras_hub_autodist.plan(str(REAL_PRESETS / "gemma_2b"), mesh)
    assert plan.mesh_axes.shape == (2, 4)
    assert mesh == given and type(mesh["batch"]) is np.int64


@pytest.mark.parametrize("size", [np.bool_(True), True, 2.0, "2", np.float32(2)])
def test_other_axis_sizes_are_refused(size):
    with pytest.raises(MeshError, match="Received"):
        resolve_mesh_axes({"batch": size})


def test_a_device_mesh_over_non_devices_is_a_mesh_error():
    for devices in [list(range(8)), ["tpu:0"] * 1 + [f"cpu:{i}" for i in range(1, 8)]]:
        mesh = keras.distribution.DeviceMesh((2, 4), ("batch", "model"), devices)
        with pytest.raises(MeshError, match=r"list_devices\(\)`.*Received: mesh"):
            resolve_mesh_axes(mesh)
        with pytest.raises(MeshError, match="name no device of this machine"):
            keras_hub_autodist.plan(str(REAL_PRESETS / "gemma_2b"), mesh)


def test_device_meshes_over_devices_or_their_names_are_accepted():
    import jax

    for devices in [keras.distribution.list_devices(), jax.devices()]:
        mesh = keras.distribution.DeviceMesh((2, 4), ("batch", "model"), devices)
        assert resolve_mesh_axes(mesh).shape == (2, 4)


# --- The demo from Python --------------------------------------------------


@pytest.mark.parametrize("steps", [0, -1, 1.5, True])
def test_the_demo_refuses_a_number_of_epochs_below_one(steps, monkeypatch):
    monkeypatch.setattr(demo, "build_tiny_gemma_preset", pytest.fail)
    with pytest.raises(DemoError, match=f"Received: steps={steps!r}"):
        demo.run_demo(steps=steps)
