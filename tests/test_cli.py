"""The `keras-hub-autodist` command: light imports, flags, one-line errors."""

import json
import os
import subprocess
import sys

import pytest
from real_presets import REAL_PRESETS

from keras_hub_autodist import cli

HEAVY = ("keras", "keras_hub", "jax", "tensorflow")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A Hugging Face GPT-2 config: keras-hub converts it, no handler lays it out.
GPT2_CONFIG = {
    "model_type": "gpt2",
    "vocab_size": 64,
    "n_layer": 2,
    "n_head": 4,
    "n_embd": 32,
    "n_positions": 16,
    "resid_pdrop": 0.0,
}
KERAS_GEMMA_CONFIG = {
    "module": "keras_hub.src.models.gemma.gemma_backbone",
    "class_name": "GemmaBackbone",
    "config": {
        "name": "gemma_backbone",
        "trainable": True,
        "vocabulary_size": 256,
        "num_layers": 2,
        "num_query_heads": 8,
        "num_key_value_heads": 1,
        "hidden_dim": 64,
        "intermediate_dim": 128,
        "head_dim": 8,
    },
    "registered_name": "keras_hub>GemmaBackbone",
}


def run(argv, capsys):
    try:
        status = cli.main(argv)
    except SystemExit as exit_:
        status = exit_.code
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def assert_one_line_error(status, err, message):
    assert status == 2, err
    assert message in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith("keras-hub-autodist: error: ")


def test_help_and_planning_a_local_config_again_import_nothing_heavy(tmp_path):
    # `import keras_hub` imports TensorFlow (~10 s), keras ~7 s, jax ~3 s:
    # `--help` needs none of them, and neither does planning local configs
    # (Keras and Hugging Face format) that an earlier process planned (their
    # conversion and abstract build are on disk); nor does either print
    # CUDA/TensorFlow log noise.
    keras_folder = tmp_path / "keras_gemma"
    keras_folder.mkdir()
    (keras_folder / "config.json").write_text(json.dumps(KERAS_GEMMA_CONFIG))
    script = f"""
import sys
from keras_hub_autodist.cli import main
try:
    main(["--help"])
except SystemExit:
    pass
after_help = sorted(m for m in {HEAVY!r} if m in sys.modules)
statuses = [
    main(["plan", {str(REAL_PRESETS / "gemma_2b")!r}, "--mesh", "batch=2,model=4"]),
    main(["plan", {str(REAL_PRESETS / "llama3_8b")!r}, "--mesh", "auto",
          "--devices", "8", "--device-memory", "40"]),
    main(["plan", {str(keras_folder)!r}, "--mesh", "batch=1,model=2"]),
]
after_plan = sorted(m for m in {HEAVY!r} if m in sys.modules)
print("RESULT", after_help, after_plan, statuses)
"""
    env = {
        **os.environ,
        "PYTHONPATH": ROOT,
        "KERAS_HUB_AUTODIST_CACHE": str(tmp_path / "cache"),
    }
    env.pop("KERAS_BACKEND", None)
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)
    runs = [
        subprocess.run(
            [sys.executable, "-c", script],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        for _ in range(2)
    ]
    first, again = (
        [line for line in done.stdout.splitlines() if line.startswith("RESULT")]
        for done in runs
    )
    # The first process builds with keras-hub; the second reads the cache.
    assert first == ["RESULT [] ['jax', 'keras', 'keras_hub', 'tensorflow'] [0, 0, 0]"]
    assert again == ["RESULT [] [] [0, 0, 0]"], runs[1].stdout[-2000:]
    # Neither prints TensorFlow's native start-up notices (the first imports it).
    assert runs[0].stderr == "", runs[0].stderr
    assert runs[1].stderr == ""


def test_demo_still_silences_tensorflow_logs(monkeypatch):
    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)
    seen = {}
    monkeypatch.setattr(cli, "_use_virtual_devices_without_accelerator", lambda: 0)
    monkeypatch.setattr(
        cli,
        "_run_demo",
        lambda args: (
            seen.setdefault("level", os.environ.get("TF_CPP_MIN_LOG_LEVEL")) and 0
        ),
    )
    assert cli.main(["demo", "--steps", "1"]) == 0
    assert seen["level"] == "3"


def test_builtin_name_without_network_is_one_line(monkeypatch, capsys):
    import kagglehub
    import requests

    def offline(*args, **kwargs):
        raise requests.exceptions.ConnectionError("Failed to resolve 'kaggle.com'")

    monkeypatch.setattr(kagglehub, "model_download", offline)
    status, _, err = run(["plan", "gemma_2b_en", "--mesh", "batch=2,model=4"], capsys)
    assert_one_line_error(status, err, "the network is unreachable")
    assert "preset='gemma_2b_en'" in err


def test_mesh_auto_with_a_device_count(capsys):
    preset = str(REAL_PRESETS / "gemma_7b")
    status, out, _ = run(
        ["plan", preset, "--mesh", "auto", "--devices", "8", "--dtype", "bfloat16"],
        capsys,
    )
    assert status == 0
    assert "auto over 8 devices" in out and "mesh: batch=" in out


def test_mesh_auto_uses_the_visible_devices(capsys):
    # conftest gives JAX 8 virtual CPU devices.
    status, out, _ = run(
        ["plan", str(REAL_PRESETS / "gemma_2b"), "--mesh", "auto"], capsys
    )
    assert status == 0 and "auto over 8 devices" in out


def test_device_memory_flag(capsys):
    preset = str(REAL_PRESETS / "gemma_7b")
    status, out, _ = run(
        ["plan", preset, "--mesh", "batch=1,model=3", "--device-memory", "80"],
        capsys,
    )
    assert status == 0
    assert "of 80.00 GiB (given)" in out and "fits: yes" in out


def test_plan_output_names_flags(capsys, monkeypatch):
    for name in ("KERAS_HUB_AUTODIST_DEVICE_MEMORY_GIB",):
        monkeypatch.delenv(name, raising=False)
    status, out, _ = run(
        ["plan", str(REAL_PRESETS / "gemma_2b"), "--mesh", "batch=2,model=4"], capsys
    )
    assert status == 0
    assert "give yours with `--device-memory`" in out, out
    assert "device_memory=" not in out


def test_messages_name_flags_from_the_cli(capsys):
    status, _, err = run(
        ["plan", str(REAL_PRESETS / "gemma_2b"), "--mesh", "model=8"], capsys
    )
    assert_one_line_error(status, err, "no batch axis")
    assert "--batch-axis" in err and "batch_axis=" not in err
    assert "--mesh batch=1,model=8" in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["plan", "PRESET", "--mesh", "batch=2,batch=4"],
            "--mesh names axis 'batch' twice",
        ),
        (["plan", "PRESET", "--mesh", "batch=8", "--dtype", "123"], "dtype"),
        (
            ["plan", "kaggle://keras/../../../etc/1", "--mesh", "batch=8"],
            "Each segment of a Kaggle handle is a name",
        ),
        (
            ["plan", "PRESET", "--mesh", "batch=8", "--device-memory", "-1"],
            "--device-memory takes a positive number of GiB",
        ),
        (
            ["plan", "PRESET", "--mesh", "batch=8", "--devices", "8"],
            "`--devices` goes with `--mesh auto`",
        ),
        (
            ["plan", "PRESET", "--mesh", "auto", "--devices", "0"],
            "--devices takes a positive number",
        ),
        (
            ["plan", "BAD_CONFIG", "--mesh", "batch=2"],
            "`num_layers=-1`; it must be a positive integer",
        ),
        (
            ["plan", "GPT2", "--mesh", "batch=2"],
            "no layout for GPT2Backbone",
        ),
        (["plan", "./no/such/preset", "--mesh", "batch=2"], "No such folder: "),
        (
            ["plan", "PRESET", "--mesh", "batch=8", "--devices", "8"],
            "Received: --devices 8, --mesh",
        ),
    ],
)
def test_bad_input_is_one_line_with_status_2(argv, message, capsys, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    config = json.loads(json.dumps(KERAS_GEMMA_CONFIG))
    config["config"]["num_layers"] = -1
    (bad / "config.json").write_text(json.dumps(config))
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps(GPT2_CONFIG))
    replace = {
        "PRESET": str(REAL_PRESETS / "gemma_2b"),
        "BAD_CONFIG": str(bad),
        "GPT2": str(gpt2),
    }
    status, _, err = run([replace.get(a, a) for a in argv], capsys)
    assert_one_line_error(status, err, message)
