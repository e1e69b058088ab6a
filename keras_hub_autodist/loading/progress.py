"""The progress bar of a sharded load: one line on a terminal or in a
Jupyter notebook (whose kernel redraws a `\r` line in place, as Keras'
`Progbar` relies on), silent otherwise. `progress=` decides; without it,
`$KERAS_HUB_AUTODIST_PROGRESS` (an on/off switch, `environment.py`) turns it
on (anywhere) or off."""

from __future__ import annotations

import sys
import time

from keras_hub_autodist.environment import read_switch

PROGRESS_ENV = "KERAS_HUB_AUTODIST_PROGRESS"
# A progress bar appears once a load has run this long.
PROGRESS_DELAY_SECONDS = 2.0
PROGRESS_INTERVAL_SECONDS = 0.2


class Progress:
    """A one-line progress bar on a terminal; silent otherwise."""

    def __init__(self, total_weights: int, total_bytes: int, enabled: bool):
        self.total_weights = total_weights
        self.total_bytes = total_bytes
        self.enabled = enabled
        self.start = time.perf_counter()
        self.last = 0.0
        self.shown = False

    def update(self, weights: int, nbytes: int, final: bool = False) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        elapsed = now - self.start
        if elapsed < PROGRESS_DELAY_SECONDS and not self.shown:
            return
        if not final and now - self.last < PROGRESS_INTERVAL_SECONDS:
            return
        self.last, self.shown = now, True
        total = max(self.total_weights, weights)
        width = 24
        filled = int(width * weights / total) if total else width
        rate = nbytes / elapsed if elapsed > 0 else 0.0
        line = (
            f"\rLoading weights [{'#' * filled}{'.' * (width - filled)}] "
            f"{weights}/{total} weights, {_mib(nbytes)}/{_mib(self.total_bytes)}"
            f", {_mib(rate)}/s"
        )
        sys.stderr.write(line + ("\n" if final else ""))
        sys.stderr.flush()


def _mib(n: float) -> str:
    return f"{n / 1024**2:.1f} MiB"


def progress_enabled(progress: bool | None) -> bool:
    """Whether to show a progress bar: `progress` if given, else what
    `$KERAS_HUB_AUTODIST_PROGRESS` says (`1`/`on`/`yes`...: shown, even off a
    terminal; `0`/`off`/`no`...: never), else on a terminal or in a Jupyter
    kernel (`in_jupyter_kernel`).

    Raises:
        EnvironmentVariableError: `$KERAS_HUB_AUTODIST_PROGRESS` is neither
            an on nor an off value.

    Example:
    >>> progress_enabled(False)
    False
    """
    if progress is not None:
        return bool(progress)
    setting = read_switch(PROGRESS_ENV)
    if setting is not None:
        return setting
    return sys.stderr.isatty() or in_jupyter_kernel()


def in_jupyter_kernel() -> bool:
    """Whether this process is a Jupyter kernel (IPython with a kernel),
    asked without importing IPython.

    Example:
    >>> in_jupyter_kernel()
    False
    """
    ipython = sys.modules.get("IPython")
    get_ipython = getattr(ipython, "get_ipython", None)
    try:
        shell = get_ipython() if get_ipython is not None else None
    except Exception:
        return False
    return getattr(shell, "kernel", None) is not None
