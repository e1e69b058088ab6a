"""Quiet logs: TensorFlow's C++ start-up notices, JAX's start of backends
that have no device here, and Orbax's one warning of every single-process
checkpoint save, kept off stderr; nothing else hidden.

keras-hub imports TensorFlow (for its tokenizers), and TensorFlow's shared
libraries log through absl as they load, before anything reads
`TF_CPP_MIN_LOG_LEVEL` (`cudart_stub.cc] Could not find cuda drivers`,
`cpu_feature_guard.cc] This TensorFlow binary is optimized...`, cuDNN
factory registrations on GPU machines). `native_stderr_filtered` runs the
import of TensorFlow with the process's stderr (file descriptor 2) caught,
then writes back every line but the absl lines whose severity (`I`, `W`,
`E`; never `F`) is below `TF_CPP_MIN_LOG_LEVEL`, the threshold TensorFlow
itself applies once it has started. A user who sets `TF_CPP_MIN_LOG_LEVEL=0`
sees every line; the package sets it to `DEFAULT_TF_LOG_LEVEL` only when it
is unset.

JAX's start of its backends on a machine without their devices, where the
`tpu-compile` and `gpu-compile` extras are installed: the CUDA plugin's
failed check of the CUDA libraries is logged at debug level where no NVIDIA
device exists, and libtpu's notices off a TPU VM are filtered as
TensorFlow's are (`quiet_jax_cuda_plugin_start`,
`quiet_jax_tpu_backend_start`). Where the user asked JAX for one of those
platforms (`JAX_PLATFORMS` naming cuda, gpu or tpu), nothing of JAX's start
is filtered: its failure to start it, and every message on the way, is
the user's to see, as JAX alone shows it (`accelerator_asked`).

Orbax warns "Skipping merge of OCDBT checkpoints: No per-process OCDBT
checkpoint subdirs found" on every save by one process, where there are no
per-process folders to merge: `OrbaxMergeNotice` drops that record, and
only in a single-process run (with several processes, missing folders are
worth a warning).

Standard library only (the package's import stays cheap).

Example:
>>> absl_severity("I0000 00:00:1796188109.244303   14276 cudart_stub.cc:31] x")
0
>>> absl_severity("Traceback (most recent call last):") is None
True
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import tempfile
from collections.abc import Iterator

TF_LOG_LEVEL = "TF_CPP_MIN_LOG_LEVEL"
# Errors and warnings of TensorFlow's C++ start-up hidden, fatal ones shown.
DEFAULT_TF_LOG_LEVEL = "3"
# absl's line prefix letter -> TensorFlow's log level of that severity.
SEVERITIES = {"I": 0, "W": 1, "E": 2, "F": 3}
# `I0000 00:00:1796188109.244303   14276 cudart_stub.cc:31] ...`: before
# absl starts, the seconds field counts from the epoch.
_ABSL_LINE = re.compile(r"^([IWEF])\d{4} \d\d:\d\d:\d+\.\d+ +\d+ [^\]]+\] ")
# Lines that continue an absl line rather than start one: TensorFlow's CPU
# feature notice, and the source trace libtpu appends to its errors (a
# header, then `file.cc:123` lines).
CONTINUATIONS = ("To enable the following instructions:", "=== Source Location Trace")
_SOURCE_LOCATION = re.compile(r"^[\w./-]+\.(cc|h):\d+\s*$")
# absl's notice before its first line (and libtpu's own, as it loads);
# dropped with the lines it announces.
ABSL_PREAMBLE = (
    "WARNING: All log messages before absl::InitializeLog() is called are "
    "written to STDERR"
)
PREAMBLES = (ABSL_PREAMBLE, "WARNING: Logging before InitGoogle() is written to STDERR")
# Warnings that native libraries print without absl's prefix, at
# TensorFlow's warning level: libtpu's, when it starts its compiler on a
# machine that is not a TPU VM (the compile-only TPU devices need neither).
PLAIN_WARNINGS = ("Failed to find host bounds for accelerator type: WARNING: ",)
# The Orbax message dropped in a single-process run (its format string).
ORBAX_MERGE_NOTICE = "Skipping merge of OCDBT checkpoints: No per-process OCDBT"


def absl_severity(line: str) -> int | None:
    """TensorFlow's log level of an absl C++ log line, None for other lines.

    Example:
    >>> absl_severity("E0000 00:00:17.1 99 cuda_dnn.cc:8310] Unable to register")
    2
    """
    match = _ABSL_LINE.match(line)
    return None if match is None else SEVERITIES[match.group(1)]


def tf_log_level(environ=None) -> int:
    """The `TF_CPP_MIN_LOG_LEVEL` in force (TensorFlow's default 0 when
    unset or not a number).

    Example:
    >>> tf_log_level({"TF_CPP_MIN_LOG_LEVEL": "2"})
    2
    """
    environ = os.environ if environ is None else environ
    text = environ.get(TF_LOG_LEVEL, "0").strip()
    return int(text) if text.isdigit() else 0


def kept_lines(text: str, min_level: int) -> str:
    """`text` without the absl lines below `min_level` (and absl's preamble
    when a line after it was dropped). Fatal lines are always kept.

    Example:
    >>> kept_lines("I0000 00:00:1.2 7 a.cc:1] noise\\nkept\\n", 1)
    'kept\\n'
    """
    lines = text.splitlines(keepends=True)
    kept, previous_dropped = [], False
    for index, line in enumerate(lines):
        following = lines[index + 1] if index + 1 < len(lines) else ""
        continues = line.startswith(CONTINUATIONS) or _SOURCE_LOCATION.match(line)
        dropped = (
            _dropped(line, min_level)
            or (previous_dropped and bool(continues))
            or (line.rstrip("\n") in PREAMBLES and _dropped(following, min_level))
            or (line.startswith(PLAIN_WARNINGS) and min_level > SEVERITIES["W"])
        )
        if not dropped:
            kept.append(line)
        previous_dropped = dropped
    return "".join(kept)


def _dropped(line: str, min_level: int) -> bool:
    severity = absl_severity(line)
    return severity is not None and severity < min(min_level, SEVERITIES["F"])


@contextlib.contextmanager
def native_stderr_filtered() -> Iterator[None]:
    """Run the body with file descriptor 2 caught, then write back what
    `kept_lines` keeps at the `TF_CPP_MIN_LOG_LEVEL` in force.

    Nothing is caught when the level is 0 or stderr has no descriptor.

    Example:
    ```python
    with native_stderr_filtered():
        import tensorflow
    ```
    """
    min_level = tf_log_level()
    try:
        saved = os.dup(2)
    except OSError:
        saved = None
    if min_level == 0 or saved is None:
        if saved is not None:
            os.close(saved)
        yield
        return
    with tempfile.TemporaryFile() as caught:
        _flush_stderr()
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            _flush_stderr()
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            text = kept_lines(caught.read().decode(errors="replace"), min_level)
            if text:
                os.write(2, text.encode())


def _flush_stderr() -> None:
    with contextlib.suppress(Exception):
        sys.stderr.flush()


class OrbaxMergeNotice(logging.Filter):
    """Drops Orbax's "Skipping merge of OCDBT checkpoints" warning of a
    single-process save; passes every other record."""

    def filter(self, record: logging.LogRecord) -> bool:
        if ORBAX_MERGE_NOTICE not in str(record.msg):
            return True
        jax = sys.modules.get("jax")
        try:
            return jax is None or jax.process_count() > 1
        except Exception:
            return True


def quiet_tensorflow_start() -> None:
    """Default `TF_CPP_MIN_LOG_LEVEL` to `DEFAULT_TF_LOG_LEVEL` when unset,
    and filter TensorFlow's import (`native_stderr_filtered`) unless
    TensorFlow is imported already."""
    from keras_hub_autodist.on_import import while_importing

    os.environ.setdefault(TF_LOG_LEVEL, DEFAULT_TF_LOG_LEVEL)
    while_importing("tensorflow", native_stderr_filtered)


def quiet_jax_cuda_plugin_start() -> None:
    """Filter the start-up notices of JAX's CUDA plugin (the `gpu-compile`
    extra: the GPU compiler on a machine without a GPU) as TensorFlow's are:
    the plugin logs TensorFlow's own `cudart_stub.cc] Could not find cuda
    drivers` as JAX imports it, and again when JAX starts its backends and
    calls the plugin's `initialize`. On a machine with no NVIDIA device,
    that `initialize` also fails its check of the CUDA libraries, which JAX
    logs with the whole traceback: there it is logged at debug level
    instead (`_no_gpu_to_check`), and the plugin stays unregistered as it
    would have (`fitting.compile_targets` registers it for compiling,
    without the check). Nothing changes without the plugin."""
    from keras_hub_autodist.on_import import when_imported
    from keras_hub_autodist.on_import import while_importing

    while_importing("jax", jax_start_filtered)
    when_imported(CUDA_PLUGIN, "quiet_cuda_plugin_start", _filter_plugin_start)


# The platforms whose start this module quiets, as `JAX_PLATFORMS` names
# them: the CUDA plugin's ("gpu" is JAX's other name for it) and the TPU
# backend's.
QUIETED_PLATFORMS = ("cuda", "gpu", "tpu")
JAX_PLATFORMS = "JAX_PLATFORMS"


def asked_platforms(environ=None) -> set[str]:
    """The platforms the user asked JAX for: `jax.config.jax_platforms`
    once JAX is imported (it reads `JAX_PLATFORMS`, and `jax.config.update`
    may change it), else `JAX_PLATFORMS`; empty where JAX chooses.

    Example:
    >>> sorted(asked_platforms({"JAX_PLATFORMS": "cuda,cpu"}))
    ['cpu', 'cuda']
    """
    value = None
    if environ is None:
        environ = os.environ
        with contextlib.suppress(Exception):  # JAX partly imported
            value = sys.modules["jax"].config.jax_platforms
    if value is None:
        value = environ.get(JAX_PLATFORMS, "")
    return {name.strip().lower() for name in str(value).split(",") if name.strip()}


def accelerator_asked(environ=None) -> bool:
    """Whether the user asked JAX for a platform whose start this module
    quiets (`QUIETED_PLATFORMS`). Then JAX's start is left as JAX makes it,
    its messages and errors whole: they are about what the user asked for.

    Example:
    >>> accelerator_asked({"JAX_PLATFORMS": "cuda"})
    True
    """
    return bool(asked_platforms(environ) & set(QUIETED_PLATFORMS))


def jax_start_filtered() -> contextlib.AbstractContextManager:
    """`native_stderr_filtered()` around a step of JAX's start, unless the
    user asked for a platform whose start it would quiet
    (`accelerator_asked`); then nothing is filtered."""
    if accelerator_asked():
        return contextlib.nullcontext()
    return native_stderr_filtered()


# The module JAX imports for its CUDA plugin (a `jax_plugins` namespace
# package member), whose `initialize()` JAX calls as it starts its backends.
CUDA_PLUGIN = "jax_plugins.xla_cuda12"


def _filter_plugin_start() -> None:
    plugin = sys.modules[CUDA_PLUGIN]
    start = getattr(plugin, "initialize", None)
    if start is None or getattr(start, "quiet", False):
        return

    def initialize(*args, **kwargs):
        if accelerator_asked():  # JAX's own start, its error whole
            return start(*args, **kwargs)
        with native_stderr_filtered():
            try:
                return start(*args, **kwargs)
            except Exception as error:
                if not _no_gpu_to_check():
                    raise
                logging.getLogger(__name__).debug(
                    "JAX's CUDA plugin is not started: this machine has no "
                    "NVIDIA device (%s)",
                    error,
                )
                return None

    initialize.quiet = True
    initialize.__doc__ = start.__doc__
    plugin.initialize = initialize


# The device files of an NVIDIA GPU, as JAX looks for them before it starts
# its CUDA backend (the last is WSL2's).
NVIDIA_DEVICE_FILES = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg")
# Set, the CUDA plugin skips its check of the CUDA libraries.
SKIP_CUDA_CHECK = "JAX_SKIP_CUDA_CONSTRAINTS_CHECK"
# The JAX module that registers the TPU backend as it is imported.
XLA_BRIDGE = "jax._src.xla_bridge"


def _no_gpu_to_check() -> bool:
    """Whether a failure of the CUDA plugin's start is its check of the CUDA
    libraries on a machine with no NVIDIA device to use them."""
    return not os.environ.get(SKIP_CUDA_CHECK) and not any(
        os.path.exists(path) for path in NVIDIA_DEVICE_FILES
    )


def quiet_jax_tpu_backend_start() -> None:
    """Filter libtpu's start-up notices when JAX tries its TPU backend on a
    machine without a TPU chip (`compat.jax_start`), from JAX's import on."""
    from keras_hub_autodist.on_import import when_imported

    when_imported(XLA_BRIDGE, "quiet_tpu_backend_start", _quiet_tpu_backend_start)


def _quiet_tpu_backend_start() -> None:
    from keras_hub_autodist.compat import jax_start

    jax_start.quiet_tpu_backend_start(jax_start_filtered)


def quiet_orbax_merge_notice() -> None:
    """Put `OrbaxMergeNotice` on absl's logger (once)."""
    absl_logger = logging.getLogger("absl")
    if not any(isinstance(f, OrbaxMergeNotice) for f in absl_logger.filters):
        absl_logger.addFilter(OrbaxMergeNotice())
