"""Periodic tasks: one way to run a task every interval on its own thread.

Owns the loop every background sweep of kvatlas had written by hand (``while not
stop.wait(interval)``): a daemon thread that sleeps ``interval_s``, runs the task, logs
an exception with what failed and carries on at the next interval, and ends promptly on
``stop()``. The task never runs at ``start()`` and never after ``stop()`` returns (unless
a join timed out, which ``stop`` reports). Must not: decide what a task does, or run two
passes of one task at once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


class Periodic:
    """``task`` every ``interval_s`` seconds on a thread named ``name``; ``what`` names
    the task in the log line of a pass that raised (the next pass tries again)."""

    def __init__(
        self, name: str, interval_s: float, task: Callable[[], object], *, what: str = ""
    ) -> None:
        if not interval_s > 0:
            raise ValueError(f"the interval of {name} must be positive seconds, got {interval_s}")
        self.name = name
        self.interval_s = interval_s
        self._task = task
        self._what = what or name
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.passes = 0
        """Passes run (a pass that raised included)."""
        self.failures = 0
        """Passes that raised."""

    def start(self) -> None:
        """Start the thread (once; a second call does nothing)."""
        if self._thread is None and not self._stop.is_set():
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float | None = 5.0) -> bool:
        """Stop it and wait up to ``timeout_s`` for a pass in progress; False when the
        thread was still running then (a pass that hangs: the thread is a daemon)."""
        self._stop.set()
        thread = self._thread
        if thread is None or thread is threading.current_thread():
            return True
        thread.join(timeout_s)
        return not thread.is_alive()

    @property
    def running(self) -> bool:
        """Started, not asked to stop, and its thread alive."""
        t = self._thread
        return t is not None and t.is_alive() and not self._stop.is_set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.passes += 1
            try:
                self._task()
            except Exception:
                self.failures += 1
                log.exception(
                    "%s failed; the next pass in %g s tries again", self._what, self.interval_s
                )
