"""What a new user sees first: the command's stderr holds no TensorFlow,
CUDA or absl log lines, and a closed pipe ends it quietly."""

import os
import re
import subprocess
import sys

from keras_hub_autodist.demo import build_tiny_gemma_preset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Lines of native (absl/TensorFlow) and Python absl logging.
LOG_LINE = re.compile(
    r"^([IWEF]\d{4} |WARNING: All log messages before absl|"
    r"(INFO|WARNING|ERROR):absl:)|cudart_stub|cpu_feature_guard|"
    r"To enable the following instructions",
    re.MULTILINE,
)


def _environment(tmp_path):
    env = {
        **os.environ,
        "PYTHONPATH": ROOT,
        "KERAS_HUB_AUTODIST_CACHE": str(tmp_path / "cache"),
    }
    # A user's shell: no TensorFlow log level, no virtual devices preset.
    for name in ("TF_CPP_MIN_LOG_LEVEL", "XLA_FLAGS", "KERAS_BACKEND"):
        env.pop(name, None)
    return env


def test_demo_stderr_has_no_log_lines(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "keras_hub_autodist", "demo", "--steps", "24"],
        capture_output=True,
        text=True,
        env=_environment(tmp_path),
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "completes to the demo sentence" in done.stdout
    assert not LOG_LINE.search(done.stderr), done.stderr
    assert done.stderr == "", done.stderr


def test_plan_into_a_closed_pipe_ends_quietly(tmp_path):
    preset = build_tiny_gemma_preset(str(tmp_path / "tiny_gemma"))
    process = subprocess.Popen(
        [sys.executable, "-m", "keras_hub_autodist", "plan", preset, "--mesh", "auto"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_environment(tmp_path),
    )
    # `| head -1` that reads nothing: every write to stdout meets EPIPE.
    process.stdout.close()
    _, err = process.communicate(timeout=600)
    err = err.decode()
    assert "Broken pipe" not in err and "Traceback" not in err, err
    assert err == "", err
    assert process.returncode == 1


def test_keras_imported_first_on_another_backend_is_a_backend_error(tmp_path):
    preset = build_tiny_gemma_preset(str(tmp_path / "tiny_gemma"))
    script = f"""
import keras  # KERAS_BACKEND unset: Keras chooses TensorFlow
import keras_hub
import keras_hub_autodist
try:
    keras_hub.models.CausalLM.from_preset({preset!r}, device_mesh={{"batch": 1}})
except keras_hub_autodist.BackendError as error:
    print("BackendError:", error)
"""
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env=_environment(tmp_path),
        timeout=600,
    )
    assert "BackendError: " in done.stdout, done.stdout + done.stderr[-3000:]
    assert "Received: backend='tensorflow'" in done.stdout
    assert "KERAS_BACKEND=jax" in done.stdout and "restart" in done.stdout
