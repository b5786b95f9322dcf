"""Event batches into the fleet state: the credential check, the gate, the apply.

Owns the ingest counters and log lines (refusals, fences by a new incarnation, gaps,
events dropped before they arrived, stale batches), the unknown event types seen (each
logged once, a label each up to a bound), and the observers told of every batch
applied (the quota controller's usage book). Times are parameters (the HTTP shell's
clock, the Kafka record's time). Logs on the service's logger
(``kvatlas.coordinator.service``), so operators' filters keep seeing these lines.

Must not: decode or validate bodies (`wire.events_api` does), read a clock, know about
HTTP or Kafka beyond the ``transport`` label.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from kvatlas.coordinator.state.fleet import LockedFleet, Position
from kvatlas.core.coordinator.gate import Verdict
from kvatlas.core.errors import InvalidInput
from kvatlas.core.events import EventBatch
from kvatlas.core.types import EventType
from kvatlas.wire.events_api import AnyBatch, EventsResponse

log = logging.getLogger("kvatlas.coordinator.service")

_OUTCOME = {Verdict.APPLY: "applied", Verdict.DUPLICATE: "duplicate", Verdict.STALE: "stale"}
_MAX_UNKNOWN_TYPES = 32
"""Distinct unknown event types that get their own metric label; the rest are "other"
(the names come from senders, and a label per name would grow without bound)."""


class Ingest:
    """Gate and apply event batches, one lock hold per batch."""

    def __init__(self, state: LockedFleet) -> None:
        self._state = state
        self._unknown_types: set[str] = set()
        self.observers: list[Callable[[EventBatch], None]] = []
        """Called under the lock with every batch applied (the quota controller's book)."""

    def apply(
        self,
        batches: Sequence[AnyBatch],
        now: float,
        transport: str = "http",
        position: Position | None = None,
        proof: bytes = b"",
    ) -> EventsResponse:
        """Gate and apply validated batches, one lock hold per batch. Batches of unknown
        event types pass the gate and are counted by type in ``skipped``.

        First, in one lock hold, every batch is checked against the credential ``proof``
        and the cursor bounds (`FleetState.check_batches`): a refusal raises
        (Unauthenticated, CredentialRefused, OutOfBounds) with nothing applied, and
        moves ``position`` past the record (a log cannot refuse it)."""
        applied = duplicates = stale = gaps = missing = provisional = 0
        skipped: dict[str, int] = {}
        st = self._state
        m = st.metrics
        with st.lock:
            try:
                st.fleet.check_batches(batches, proof, now, st.bounds)
            except InvalidInput as exc:
                st.move(position)
                m.ingest_batches.labels("refused", transport).inc(len(batches))
                st.count_refusal("events", exc, transport)
                first = batches[0]
                log.warning(
                    "Refused %d batches (%s; the first: instance %s incarnation %d seq %d): %s",
                    len(batches),
                    transport,
                    first.instance_id,
                    first.incarnation,
                    first.seq,
                    exc,
                )
                raise
        for i, b in enumerate(batches):
            with st.lock:
                try:
                    out = st.fleet.ingest(b, now)
                    if out.verdict is Verdict.APPLY and isinstance(b, EventBatch):
                        for observe in self.observers:
                            observe(b)
                finally:
                    if i == len(batches) - 1:
                        st.move(position)
            n = b.n_entries if isinstance(b, EventBatch) else 0
            verdict = "skipped" if out.skipped else _OUTCOME[out.verdict]
            m.ingest_batches.labels(verdict, transport).inc()
            m.ingest_entries.labels(verdict, transport).inc(n)
            if out.verdict is Verdict.APPLY:
                if out.skipped:
                    skipped[out.skipped] = skipped.get(out.skipped, 0) + 1
                    self._count_unknown(out.skipped, transport, b)
                else:
                    applied += 1
                    if isinstance(b, EventBatch) and b.event_type is EventType.CONFIG:
                        m.config_batches.labels(transport).inc()
                provisional += out.provisional
                if out.fenced:
                    m.fences.labels("new").inc()
                    m.fenced_placements.labels("new").inc(out.fenced)
                    log.info(
                        "Fenced %d L1 placements of instance %s below incarnation %d"
                        " (events of a new incarnation arrived)",
                        out.fenced,
                        b.instance_id,
                        b.incarnation,
                    )
                if out.gap or out.dropped:
                    gaps += 1
                    m.ingest_gaps.inc()
                if out.gap:
                    missing += out.gap
                    m.ingest_missing.inc(out.gap)
                    log.warning(
                        "Gap of %d seqs before seq %d of instance %s incarnation %d",
                        out.gap,
                        b.seq,
                        b.instance_id,
                        b.incarnation,
                    )
                if out.dropped:
                    m.ingest_events_dropped.inc(out.dropped)
                    log.warning(
                        "Instance %s incarnation %d reports %d more events dropped before"
                        " they reached the coordinator (seq %d): its slice is incomplete",
                        b.instance_id,
                        b.incarnation,
                        out.dropped,
                        b.seq,
                    )
            elif out.verdict is Verdict.DUPLICATE:
                duplicates += 1
            else:
                stale += 1
                log.debug(
                    "Stale batch seq %d of instance %s incarnation %d dropped",
                    b.seq,
                    b.instance_id,
                    b.incarnation,
                )
        if not batches:
            with st.lock:
                st.move(position)
        return EventsResponse(applied, duplicates, stale, gaps, missing, provisional, skipped)

    def _count_unknown(self, event_type: str, transport: str, b: AnyBatch) -> None:
        """Count a skipped batch; the first of each type is logged (a newer sender)."""
        if event_type not in self._unknown_types and len(self._unknown_types) < _MAX_UNKNOWN_TYPES:
            self._unknown_types.add(event_type)
            log.warning(
                "Skipped a batch of unknown event type %r (instance %s incarnation %d seq %d);"
                " its seq still counts, later ones of this type are skipped silently",
                event_type[:64],
                b.instance_id,
                b.incarnation,
                b.seq,
            )
        label = event_type if event_type in self._unknown_types else "other"
        self._state.metrics.skipped_batches.labels(label, transport).inc()
