"""The one locked fleet state every part of the coordinator's service shares.

Owns the `FleetState`, the lock that serialises every access to it, the consumer
positions stored with it (Kafka offsets, changed under the same lock as the state they
led to, so a snapshot is always consistent), the credential bounds requests are held
to, and the refusal counter the parts share. The parts (`membership`, `expiry`,
`ingest`, `lookups`, `views`, `snapshots`) hold this object, never a copy of what is
in it.

Lock discipline: CPU-heavy work happens outside the lock (hashing a prompt's chunks,
validating and decoding bodies, building responses); the lock covers only the
directory/membership operation itself, so a large lookup never holds up ingest for more
than the time of its dictionary probes.

Must not: do network or file I/O, read a clock, log, or know about HTTP.
"""

from __future__ import annotations

import threading

from kvatlas.coordinator.metrics import CoordinatorMetrics
from kvatlas.core.coordinator.fleet import FleetState
from kvatlas.core.credentials import Bounds
from kvatlas.core.errors import CredentialRefused, InvalidInput, OutOfBounds, Unauthenticated

_REFUSAL_REASON: dict[type[InvalidInput], str] = {
    Unauthenticated: "unauthenticated",
    CredentialRefused: "wrong_credential",
    OutOfBounds: "out_of_bounds",
}

Position = tuple[str, int]
"""(position key, next offset): where a consumer stands once a record is applied."""


class LockedFleet:
    """A `FleetState`, its lock and the consumer positions that led to it."""

    def __init__(
        self, fleet: FleetState, metrics: CoordinatorMetrics, bounds: Bounds | None = None
    ) -> None:
        """``bounds``: the credential requirement and cursor bounds every request about an
        instance is held to (`core.credentials`)."""
        self.fleet = fleet
        self.metrics = metrics
        self.bounds = bounds if bounds is not None else Bounds()
        self.lock = threading.Lock()
        self.positions: dict[str, int] = {}
        """Consumer positions (``kafka:<topic>:<partition>`` -> next offset)."""

    def move(self, position: Position | None) -> None:
        """Record that a consumer stands at ``position`` (the caller holds the lock)."""
        if position is not None:
            self.positions[position[0]] = position[1]

    def advance(self, position: Position) -> None:
        """Move a consumer position past a record that changes nothing (undecodable)."""
        with self.lock:
            self.move(position)

    def count_refusal(self, request: str, exc: InvalidInput, transport: str) -> None:
        """Count a request refused for its credential or its bounds (other refusals are
        counted by the part that knows them)."""
        reason = _REFUSAL_REASON.get(type(exc))
        if reason is not None:
            self.metrics.refusals.labels(request, reason, transport).inc()
