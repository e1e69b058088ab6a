"""Quiet logs: TensorFlow's native start-up notices below the log level,
JAX's start of backends with no device here, and Orbax's single-process
merge warning are dropped; nothing else is."""

import importlib.util
import logging
import os
import re
import subprocess
import sys
import types

import pytest

from keras_hub_autodist import quiet

CUDART = (
    "I0000 00:00:1796188109.244303   14276 cudart_stub.cc:31] Could not find "
    "cuda drivers on your machine, GPU will not be used.\n"
)
CPU_GUARD = (
    "I0000 00:00:1796188437.889720   16128 cpu_feature_guard.cc:227] This "
    "TensorFlow binary is optimized to use available CPU instructions.\n"
    "To enable the following instructions: AVX2 FMA, in other operations, "
    "rebuild TensorFlow with the appropriate compiler flags.\n"
)
CUDNN = (
    "E0000 00:00:1796188109.3   14276 cuda_dnn.cc:8310] Unable to register "
    "cuDNN factory\n"
)
FATAL = "F0000 00:00:1796188109.3   14276 a.cc:1] check failed\n"
PREAMBLE = quiet.ABSL_PREAMBLE + "\n"


def test_lines_below_the_level_are_dropped_with_their_preamble():
    text = PREAMBLE + CUDART + CPU_GUARD + "a user's own line\n" + CUDNN + FATAL
    assert quiet.kept_lines(text, 3) == "a user's own line\n" + FATAL
    assert quiet.kept_lines(text, 2) == "a user's own line\n" + CUDNN + FATAL


def test_a_preamble_before_kept_lines_stays():
    text = PREAMBLE + CUDNN
    assert quiet.kept_lines(text, 1) == text


def test_a_continuation_line_of_a_kept_line_stays():
    text = "To enable the following instructions: printed by the user\n"
    assert quiet.kept_lines(text, 3) == text


LIBTPU_START = (
    "Failed to find host bounds for accelerator type: WARNING: could not "
    "determine TPU accelerator type, please set env var `TPU_ACCELERATOR_TYPE` "
    "manually, otherwise libtpu.so may not properly initialize.\n"
    "WARNING: Logging before InitGoogle() is written to STDERR\n"
    "E0000 00:00:1796452583.360404   32353 common_lib.cc:554] INVALID_ARGUMENT: "
    "Error: unexpected worker hostname\n"
    "=== Source Location Trace: === \n"
    "learning/45eac/tfrc/runtime/libtpu_init_utils.cc:327\n"
)


def test_libtpu_start_notices_off_a_tpu_vm_are_dropped_at_the_default_level():
    assert quiet.kept_lines(LIBTPU_START + "a user's own line\n", 3) == (
        "a user's own line\n"
    )
    # At TensorFlow's warning level, libtpu's warning and error stay whole.
    assert quiet.kept_lines(LIBTPU_START, 1) == LIBTPU_START


def test_a_source_location_line_of_a_user_stays():
    text = "my_module.cc:12\n"
    assert quiet.kept_lines(text, 3) == text


def test_native_stderr_of_the_body_is_filtered(monkeypatch, tmp_path):
    # A child process: its file descriptor 2 is a file this test reads.
    script = (
        "import os\n"
        "from keras_hub_autodist import quiet\n"
        "with quiet.native_stderr_filtered():\n"
        f"    os.write(2, {(PREAMBLE + CUDART + 'kept' + chr(10)).encode()!r})\n"
        "os.write(2, b'after\\n')\n"
    )
    for level, expected in (("3", "kept\nafter\n"), ("0", None)):
        env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": level}
        done = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, env=env
        )
        assert done.returncode == 0, done.stderr
        if expected is None:
            assert CUDART in done.stderr and done.stderr.endswith("after\n")
        else:
            assert done.stderr == expected


def test_only_the_single_process_orbax_merge_notice_is_dropped():
    notice = logging.LogRecord(
        "absl",
        logging.WARNING,
        __file__,
        1,
        "[process=%s][thread=%s] Skipping merge of OCDBT checkpoints: No"
        " per-process OCDBT checkpoint subdirs found in %s, ",
        (0, "MainThread", "/tmp/x"),
        None,
    )
    other = logging.LogRecord(
        "absl", logging.WARNING, __file__, 1, "a warning", (), None
    )
    import jax  # noqa: F401  (the filter asks JAX for the process count)

    flt = quiet.OrbaxMergeNotice()
    assert not flt.filter(notice)
    assert flt.filter(other)
    assert any(
        isinstance(f, quiet.OrbaxMergeNotice) for f in logging.getLogger("absl").filters
    )


def test_the_users_log_level_is_kept(monkeypatch):
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "1")
    quiet.quiet_tensorflow_start()
    assert os.environ["TF_CPP_MIN_LOG_LEVEL"] == "1"


def _fake_cuda_plugin(monkeypatch, error):
    """The CUDA plugin as `quiet` finds it, its `initialize` raising `error`."""
    plugin = types.ModuleType(quiet.CUDA_PLUGIN)

    def initialize():
        raise error

    plugin.initialize = initialize
    monkeypatch.setitem(sys.modules, quiet.CUDA_PLUGIN, plugin)
    quiet._filter_plugin_start()
    return plugin


def test_the_cuda_check_without_an_nvidia_device_is_logged_at_debug(
    monkeypatch, tmp_path, caplog
):
    monkeypatch.delenv(quiet.SKIP_CUDA_CHECK, raising=False)
    monkeypatch.setattr(quiet, "NVIDIA_DEVICE_FILES", (str(tmp_path / "nvidia0"),))
    plugin = _fake_cuda_plugin(monkeypatch, RuntimeError("Unable to load CUDA."))
    with caplog.at_level(logging.DEBUG, logger=quiet.__name__):
        assert plugin.initialize() is None
    assert "no NVIDIA device" in caplog.text and "Unable to load CUDA." in caplog.text


def test_the_cuda_plugin_fails_as_before_where_a_gpu_is_or_no_check_ran(
    monkeypatch, tmp_path
):
    device = tmp_path / "nvidia0"
    device.touch()
    monkeypatch.setattr(quiet, "NVIDIA_DEVICE_FILES", (str(device),))
    monkeypatch.delenv(quiet.SKIP_CUDA_CHECK, raising=False)
    plugin = _fake_cuda_plugin(monkeypatch, RuntimeError("Unable to load CUDA."))
    with pytest.raises(RuntimeError, match="Unable to load CUDA"):
        plugin.initialize()
    # Registered without the check (as the GPU target compile does), any
    # failure is the plugin's own, GPU or not.
    monkeypatch.setattr(quiet, "NVIDIA_DEVICE_FILES", (str(tmp_path / "none"),))
    monkeypatch.setenv(quiet.SKIP_CUDA_CHECK, "1")
    plugin = _fake_cuda_plugin(monkeypatch, ValueError("bad target"))
    with pytest.raises(ValueError, match="bad target"):
        plugin.initialize()


def _cuda_plugin_installed() -> bool:
    # `find_spec` of a dotted name raises where its parent package is missing.
    return (
        importlib.util.find_spec("jax_plugins") is not None
        and importlib.util.find_spec(quiet.CUDA_PLUGIN) is not None
    )


@pytest.mark.skipif(
    any(os.path.exists(path) for path in quiet.NVIDIA_DEVICE_FILES)
    or not (_cuda_plugin_installed() or importlib.util.find_spec("libtpu")),
    reason="needs a machine without a GPU, with a compile extra installed",
)
def test_jax_starts_quietly_here_with_the_compilers_installed():
    """With the `tpu-compile` or `gpu-compile` extra on a machine without
    their devices, JAX's start writes no traceback and no libtpu notice,
    and still finds its CPU."""
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("JAX_PLATFORMS", "TF_CPP_MIN_LOG_LEVEL", "XLA_FLAGS")
    }
    script = "import keras_hub_autodist, jax; print(jax.devices()[0].platform)"
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "cpu"
    assert done.stderr == "", done.stderr


# A traceback's frames and source lines (indented), and what makes one run's
# absl line differ from another's (its time and thread; libtpu ends some
# lines with a space or not, from run to run).
_ABSL_STAMP = re.compile(r"^([IWEF])\d{4} \d\d:\d\d:\d+\.\d+ +\d+ ")


def _what_the_user_sees(script: str, platforms: str) -> tuple[int, list[str]]:
    """The exit status of `script` under `JAX_PLATFORMS=platforms`, and the
    lines of its stderr but the traceback frames, absl's times taken out."""
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("JAX_PLATFORMS", "TF_CPP_MIN_LOG_LEVEL", "XLA_FLAGS")
    }
    env["JAX_PLATFORMS"] = platforms
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env
    )
    lines = [
        _ABSL_STAMP.sub(r"\1 ", line).rstrip()
        for line in done.stderr.splitlines()
        if line and not line[0].isspace()
    ]
    return done.returncode, lines


@pytest.mark.parametrize(
    "platforms, installed",
    [
        ("cuda", _cuda_plugin_installed),
        ("gpu", _cuda_plugin_installed),
        ("tpu", lambda: importlib.util.find_spec("libtpu") is not None),
    ],
)
def test_a_platform_the_user_asks_for_starts_as_jax_starts_it(platforms, installed):
    """With `JAX_PLATFORMS` naming an accelerator whose start the package
    quiets, the user sees JAX's own messages and error, whole: the same as
    without the package."""
    if not installed():
        pytest.skip(f"the compiler of {platforms} is not installed")
    script = "import jax; print(jax.devices()[0].platform)"
    alone = _what_the_user_sees(script, platforms)
    ours = _what_the_user_sees("import keras_hub_autodist; " + script, platforms)
    assert ours == alone
    if platforms != "tpu" and not any(
        os.path.exists(path) for path in quiet.NVIDIA_DEVICE_FILES
    ):
        status, lines = ours
        assert status != 0
        assert any("Unable to load CUDA. Is it installed?" in line for line in lines)


def test_the_platforms_asked_are_read_at_the_start(monkeypatch):
    assert quiet.accelerator_asked({"JAX_PLATFORMS": "cpu,tpu"})
    assert not quiet.accelerator_asked({"JAX_PLATFORMS": "cpu"})
    assert not quiet.accelerator_asked({})
    # Set through JAX's config after its import, it is read there.
    import jax

    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    previous = jax.config.jax_platforms
    jax.config.update("jax_platforms", "cuda")
    try:
        assert quiet.accelerator_asked()
        error = RuntimeError("Unable to load CUDA. Is it installed?")
        plugin = _fake_cuda_plugin(monkeypatch, error)
        with pytest.raises(RuntimeError, match="Unable to load CUDA"):
            plugin.initialize()
    finally:
        jax.config.update("jax_platforms", previous)
