"""When a training run should save and stop: on `SIGTERM`, past a time limit,
and at the same batch in every process.

A preemption notice arrives as `SIGTERM`, and often to one process only; a
time limit runs out on each process's own clock. Orbax saves are collective,
so every process must stop after the same batch. In several processes the
processes therefore agree, every `check_freq` batches, on "does any process
want to stop": one all-gather of one integer per process. Its cost is a
round trip between the processes, and the host waits for the batch just
dispatched to finish (as reading the loss would); with steps of a second or
more it is lost in the noise. In one process nothing is exchanged.
"""

from __future__ import annotations

import signal
import threading
import time

import jax
import numpy as np

from keras_hub_autodist.errors import CheckpointOptionError


def any_process(flag: bool) -> bool:
    """Whether `flag` is true in any of the processes (a collective: every
    process must call it, at the same point of the program).

    Args:
        flag: this process's answer.

    Returns:
        True when at least one process passed True; `flag` itself in a
        single process.

    Example:
    >>> any_process(False)
    False
    """
    if jax.process_count() == 1:
        return bool(flag)
    from jax.experimental import multihost_utils

    flags = multihost_utils.process_allgather(np.asarray(flag, dtype=np.int32))
    return bool(np.asarray(flags).any())


def check_batch_count(keyword: str, value, how: str) -> None:
    """Refuse `value` unless it is a whole number of batches, at least 1.

    Args:
        keyword: the argument's name, for the message.
        value: what was passed.
        how: the sentences telling what to pass instead (`"Pass ..."`).

    Example:
    >>> check_batch_count("save_freq", 2, "Pass an integer >= 1.")
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise CheckpointOptionError(
            f"`{keyword}=` is a number of batches. {how} Received: {keyword}={value!r}"
        )
    if value < 1:
        raise CheckpointOptionError(
            f"`{keyword}=` must be at least 1 batch. {how} Received: "
            f"{keyword}={value!r}"
        )


class StopRequest:
    """Tells after each batch whether training should save and stop.

    A `SIGTERM` handler (installed by `start()` on the main thread only:
    Python delivers signals to the main thread, and other threads can't
    install handlers) or a time limit asks for a stop; `should_stop()` gives
    the same answer in every process. A second `SIGTERM` before `finish()`
    goes to the handler `SIGTERM` had before (by default: the process ends),
    so a run that can't reach the end of its batch can still be stopped.

    Args:
        on_sigterm: stop at the end of the batch during which the process
            receives `SIGTERM`.
        time_limit: seconds after `start()` past which to stop; None for no
            limit.
        check_freq: in several processes, agree every this many batches
            (each agreement is one small collective).

    Example:
    >>> request = StopRequest(on_sigterm=False, time_limit=0.0)
    >>> request.start()
    >>> request.should_stop(batches_trained=1)
    True
    >>> request.finish()
    """

    def __init__(
        self,
        *,
        on_sigterm: bool = True,
        time_limit: float | None = None,
        check_freq: int = 1,
    ):
        check_batch_count("stop_check_freq", check_freq, "Pass an integer >= 1.")
        if time_limit is not None and (
            isinstance(time_limit, bool)
            or not isinstance(time_limit, (int, float))
            or not time_limit >= 0
        ):
            raise CheckpointOptionError(
                "`time_limit=` is a number of seconds >= 0, or None for no "
                f"limit. Received: time_limit={time_limit!r}"
            )
        self.on_sigterm = on_sigterm
        self.time_limit = time_limit
        self.check_freq = check_freq
        self.sigterm_received = False
        self._started = None
        self._handler_installed = False
        self._previous_handler = None

    def start(self) -> None:
        """Start the clock and, on the main thread, handle `SIGTERM`."""
        self._started = time.monotonic()
        self.sigterm_received = False
        if not self.on_sigterm or self._handler_installed:
            return
        if threading.current_thread() is not threading.main_thread():
            return

        def request_stop(signum, frame):
            if self.sigterm_received:  # a second notice: stop right away
                self.finish()
                signal.raise_signal(signum)
            self.sigterm_received = True

        self._previous_handler = signal.signal(signal.SIGTERM, request_stop)
        self._handler_installed = True

    def finish(self) -> None:
        """Give `SIGTERM` back to the handler it had before `start()`."""
        if self._handler_installed:
            # None: the previous handler was not installed from Python.
            previous = self._previous_handler
            signal.signal(
                signal.SIGTERM, signal.SIG_DFL if previous is None else previous
            )
        self._handler_installed = False
        self._previous_handler = None

    def past_time_limit(self) -> bool:
        """Whether this process has run past the time limit."""
        if self.time_limit is None or self._started is None:
            return False
        return time.monotonic() - self._started >= self.time_limit

    def should_stop(self, batches_trained: int) -> bool:
        """Whether to save and stop after this batch, the same answer in
        every process.

        Args:
            batches_trained: batches trained since `start()`, the same count
                in every process (it decides when the processes agree).
        """
        wants = self.sigterm_received or self.past_time_limit()
        if jax.process_count() == 1:
            return wants
        if batches_trained % self.check_freq:
            return False
        return any_process(wants)
