"""Whether the coordinator serves, and what `/readyz` answers.

Owns the ready flag (set by the composition root alone, or by the Kafka consumer once
caught up), the reason it is not set, and the last snapshot write's failure. Apart from
the fleet lock: readiness is read on every request of a replica and changes rarely.
Must not: touch the fleet state, or decide when a snapshot is written.
"""

from __future__ import annotations

import threading


class Readiness:
    """Serving or not, and why not."""

    def __init__(self) -> None:
        self._ready = threading.Event()
        self._not_ready_reason = "starting"
        self._snapshot_failure = ""

    def set_ready(self) -> None:
        self._not_ready_reason = ""
        self._ready.set()

    def set_not_ready(self, reason: str) -> None:
        self._not_ready_reason = reason
        self._ready.clear()

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    @property
    def not_ready_reason(self) -> str:
        return self._not_ready_reason

    def set_snapshot_failure(self, reason: str) -> None:
        """Record that the last snapshot write failed (``reason``), or succeeded ("")."""
        self._snapshot_failure = reason

    def status(self) -> tuple[bool, str]:
        """What `/readyz` answers: serving (`ready`) and the last snapshot write, if
        any, succeeded; else the reason. A failed snapshot does not stop ingest or
        membership (only `ready` gates those): it tells the orchestrator that a
        restart would lose state, until a later write succeeds."""
        if not self._ready.is_set():
            return False, self._not_ready_reason
        if self._snapshot_failure:
            return False, self._snapshot_failure
        return True, ""
