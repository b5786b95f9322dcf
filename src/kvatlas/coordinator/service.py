"""The coordinator service: the fleet state behind one lock, with logs and metrics.

Owns the `FleetState`, the lock that serialises every access to it, the consumer
positions stored with it (Kafka offsets, changed under the same lock as the state they
led to, so a snapshot is always consistent), readiness, and the operator's log lines
(registrations, fences, expiries, gaps). Every transport (HTTP handlers, the Kafka
consumer, the expiry loop) changes state only through these methods.

Lock discipline: CPU-heavy work happens outside the lock (hashing a prompt's chunks,
validating and decoding bodies, building responses); the lock covers only the
directory/membership operation itself, so a large lookup never holds up ingest for more
than the time of its dictionary probes.

Must not: do network or file I/O, read a clock (times are parameters: the HTTP shell
passes its clock, the Kafka shell the record's timestamp), or know about HTTP.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

import msgspec

from kvatlas.coordinator.directory_walk import keys_page
from kvatlas.coordinator.fence_log import record_expiry, record_fence
from kvatlas.coordinator.metrics import CoordinatorMetrics, StateSample
from kvatlas.coordinator.views import stats_response
from kvatlas.core.coordinator.blend import BlendMatch
from kvatlas.core.coordinator.fleet import Fenced, FenceReason, FleetState
from kvatlas.core.coordinator.gate import Verdict
from kvatlas.core.coordinator.membership import InstanceInfo, RegisterOutcome
from kvatlas.core.coordinator.placements import KeyColumns, KeyResult, PrefixResult
from kvatlas.core.credentials import Bounds
from kvatlas.core.errors import (
    ChunkSizeConflict,
    ContractMismatch,
    CredentialRefused,
    InvalidInput,
    OutOfBounds,
    Unauthenticated,
)
from kvatlas.core.events import EventBatch
from kvatlas.core.keys import ChainMemo, Namespace, ObjectKey, chunk_hashes
from kvatlas.core.types import ChunkHash, EventType, Incarnation, InstanceId, Tier
from kvatlas.wire.coordinator_views import KeysPage, StatsResponse
from kvatlas.wire.events_api import AnyBatch, EventsResponse
from kvatlas.wire.instances_api import FleetUsageResponse, InstanceWire, fleet_usage

log = logging.getLogger(__name__)

_REFUSAL_REASON: dict[type[InvalidInput], str] = {
    Unauthenticated: "unauthenticated",
    CredentialRefused: "wrong_credential",
    OutOfBounds: "out_of_bounds",
}
_OUTCOME = {Verdict.APPLY: "applied", Verdict.DUPLICATE: "duplicate", Verdict.STALE: "stale"}
_MAX_UNKNOWN_TYPES = 32
"""Distinct unknown event types that get their own metric label; the rest are "other"
(the names come from senders, and a label per name would grow without bound)."""

Position = tuple[str, int]
"""(position key, next offset): where a consumer stands once a record is applied."""


class CoordinatorService:
    """Thread-safe front of one `FleetState`."""

    def __init__(
        self,
        fleet: FleetState,
        metrics: CoordinatorMetrics,
        bounds: Bounds | None = None,
        memo: ChainMemo | None = None,
    ) -> None:
        """``bounds``: the credential requirement and cursor bounds every request about an
        instance is held to (`core.credentials`). ``memo``: recent links of the token
        hash chain, for lookups by tokens (`--token-hash-memo-bytes`)."""
        self.fleet = fleet
        self._memo = memo
        self.metrics = metrics
        self.bounds = bounds if bounds is not None else Bounds()
        self.lock = threading.Lock()
        self.positions: dict[str, int] = {}
        """Consumer positions (``kafka:<topic>:<partition>`` -> next offset)."""
        self._ready = threading.Event()
        self._not_ready_reason = "starting"
        self._snapshot_failure = ""
        self._unknown_types: set[str] = set()
        self.observers: list[Callable[[EventBatch], None]] = []
        """Called under the lock with every batch applied (the quota controller's book)."""
        self.drop_observers: list[Callable[[InstanceId], None]] = []
        """Called under the lock with every instance whose placements of every tier were
        dropped (its L2 retention ran out, or it never registered)."""
        self.companion: Callable[[], msgspec.Struct] | None = None
        """State kept beside the fleet's, captured in the same lock hold by `snapshot_parts`
        (the L2 usage book)."""

    # ---- readiness -------------------------------------------------------------------

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

    def readiness(self) -> tuple[bool, str]:
        """What `/readyz` answers: serving (`ready`) and the last snapshot write, if
        any, succeeded; else the reason. A failed snapshot does not stop ingest or
        membership (only `ready` gates those): it tells the orchestrator that a
        restart would lose state, until a later write succeeds."""
        if not self._ready.is_set():
            return False, self._not_ready_reason
        if self._snapshot_failure:
            return False, self._snapshot_failure
        return True, ""

    def _advance(self, position: Position | None) -> None:
        if position is not None:
            self.positions[position[0]] = position[1]

    # ---- membership ------------------------------------------------------------------

    def register(
        self,
        info: InstanceInfo,
        now: float,
        position: Position | None = None,
        proof: bytes = b"",
        *,
        check_contract: bool = True,
    ) -> RegisterOutcome:
        """Register ``info``; raises InvalidInput (ContractMismatch, StaleIncarnation, and
        for a live bound instance without its ``proof`` Unauthenticated or
        CredentialRefused; OutOfBounds). ``check_contract`` off: its contract was
        decided where it was received (a Kafka record that carries the decision)."""
        with self.lock:
            try:
                outcome, fenced = self.fleet.register(
                    info, now, proof, self.bounds, check_contract=check_contract
                )
            except InvalidInput as exc:
                self.metrics.registrations.labels("refused").inc()
                self._count_refusal("register", exc, "http" if position is None else "kafka")
                log.warning(
                    "Refused registration of instance %s incarnation %d: %s",
                    info.instance_id,
                    info.incarnation,
                    exc,
                )
                raise
            finally:
                self._advance(position)
        self.metrics.registrations.labels("re_registered" if outcome.re_registered else "new").inc()
        log.info(
            "%s instance %s at %s:%d (incarnation %d)",
            "Re-registered" if outcome.re_registered else "Registered",
            info.instance_id,
            info.ip,
            info.http_port,
            info.incarnation,
        )
        if fenced is not None:
            self._log_fence(fenced)
        return outcome

    def heartbeat(
        self,
        instance_id: InstanceId,
        now: float,
        position: Position | None = None,
        proof: bytes | None = None,
    ) -> bool:
        """False: unknown instance (the caller answers 404 so it re-registers). With
        ``proof`` (None: checked where the request arrived), a live bound instance's
        heartbeat needs its own (Unauthenticated, CredentialRefused)."""
        with self.lock:
            try:
                if proof is not None:
                    self._authorize("heartbeat", instance_id, proof)
                known = self.fleet.heartbeat(instance_id, now)
            finally:
                self._advance(position)
        if not known:
            log.info("Heartbeat from unknown instance %s; asked to re-register", instance_id)
        return known

    def check_contract(self, info: InstanceInfo) -> None:
        """Raise ContractMismatch (counted, logged) when ``info``'s contract contradicts
        that of a live instance of its model in this replica's view."""
        if info.contract is None:
            return
        with self.lock:
            fleet = self.fleet.membership.fleet_contract(
                info.contract.model_name, excluding=info.instance_id
            )
        try:
            if fleet is not None:
                fleet.check_compatible(info.contract)
        except ContractMismatch as exc:
            self.refused_registration(info, exc)
            raise

    def refused_registration(self, info: InstanceInfo, exc: InvalidInput) -> None:
        """Count and log a registration refused before its record was published."""
        self.metrics.registrations.labels("refused").inc()
        log.warning(
            "Refused registration of instance %s incarnation %d: %s",
            info.instance_id, info.incarnation, exc,
        )  # fmt: skip

    def check_heartbeat(self, instance_id: InstanceId, proof: bytes) -> bool:
        """Is ``instance_id`` live, and may ``proof`` speak for it? False: unknown. Raises
        like `heartbeat` (the log's heartbeat records are checked here, before publishing)."""
        with self.lock:
            self._authorize("heartbeat", instance_id, proof)
            return self.fleet.membership.get(instance_id) is not None

    def _authorize(self, request: str, instance_id: InstanceId, proof: bytes) -> None:
        """`FleetState.authorize` under the caller's lock hold; refusals counted."""
        try:
            self.fleet.authorize(instance_id, proof, require=self.bounds.require_credentials)
        except InvalidInput as exc:
            self._count_refusal(request, exc, "http")
            log.warning("Refused %s of instance %s: %s", request, instance_id, exc)
            raise

    def _count_refusal(self, request: str, exc: InvalidInput, transport: str) -> None:
        reason = _REFUSAL_REASON.get(type(exc))
        if reason is not None:
            self.metrics.refusals.labels(request, reason, transport).inc()

    def is_live(self, instance_id: InstanceId) -> bool:
        with self.lock:
            return self.fleet.membership.get(instance_id) is not None

    def deregister(
        self,
        instance_id: InstanceId,
        now: float,
        position: Position | None = None,
        proof: bytes | None = None,
    ) -> bool:
        """Remove an instance and fence its L1 slice (its L2 retention starts at ``now``);
        False if it was unknown. With ``proof``, a live bound instance leaves only with
        its own (Unauthenticated, CredentialRefused: nothing changes)."""
        with self.lock:
            try:
                if proof is not None:
                    transport = "http" if position is None else "kafka"
                    try:
                        self.fleet.authorize(instance_id, proof)
                    except InvalidInput as exc:
                        self._count_refusal("deregister", exc, transport)
                        log.warning("Refused deregistration of %s: %s", instance_id, exc)
                        raise
                fenced = self.fleet.deregister(instance_id, now)
            finally:
                self._advance(position)
        if fenced is None:
            log.info("Deregistration of unknown instance %s ignored", instance_id)
            return False
        log.info("Deregistered instance %s (incarnation %d)", instance_id, fenced.incarnation)
        self._log_fence(fenced)
        return True

    def expire(self, now: float) -> list[Fenced]:
        """Expire every instance silent for longer than the timeout (single coordinator)."""
        with self.lock:
            fenced = self.fleet.expire(now)
            self._dropped(fenced)
        for f in fenced:
            self._log_expiry(f)
        return fenced

    def expire_departed(self, now: float) -> list[Fenced]:
        """Drop what is left of the instances gone for the L2 retention at ``now``
        (replicas: the time of the record they apply)."""
        with self.lock:
            dropped = self.fleet.expire_departed(now)
            self._dropped(dropped)
        for f in dropped:
            self._log_fence(f)
        return dropped

    def expiry_candidates(self, now: float) -> list[tuple[InstanceId, Incarnation, float]]:
        """(instance, incarnation, last seen) of every instance silent for too long."""
        timeout = self.fleet.instance_timeout
        with self.lock:
            out = [
                (i.instance_id, i.incarnation, i.last_heartbeat)
                for i in self.fleet.instances()
                if now - i.last_heartbeat > timeout
            ]
            out.extend(
                (iid, inc, seen)
                for iid, (inc, seen) in sorted(self.fleet.provisional().items())
                if now - seen > timeout
            )
        return out

    def expire_instance(
        self,
        instance_id: InstanceId,
        incarnation: Incarnation,
        last_seen: float,
        position: Position | None = None,
    ) -> Fenced | None:
        """Expire one instance, if it is still the incarnation ``incarnation`` and nothing
        was heard of it after ``last_seen`` (replicas apply expiry records from the log
        with this condition, so a heartbeat that overtook the expiry wins everywhere)."""
        with self.lock:
            fenced = self.fleet.expire_instance(instance_id, incarnation, last_seen)
            self._dropped([] if fenced is None else [fenced])
            self._advance(position)
        if fenced is not None:
            self._log_expiry(fenced)
        return fenced

    def instances(self, now: float) -> list[InstanceWire]:
        with self.lock:
            infos = self.fleet.instances()
        return [InstanceWire.from_core(i, now) for i in infos]

    def usage(self) -> FleetUsageResponse:
        """`GET /instances/usage`: placements' bytes against declared capacities."""
        with self.lock:
            fl = self.fleet
            owners = fl.stats().owners
            declarations = fl.capacity.declarations()
            registered = {i.instance_id for i in fl.instances()}
        return fleet_usage(owners, declarations, registered)

    def _dropped(self, fenced: Sequence[Fenced]) -> None:
        """Tell the drop observers (under the lock) of instances that lost every tier."""
        for f in fenced:
            if f.reason in (FenceReason.L2_RETENTION, FenceReason.EXPIRED_UNREGISTERED):
                for observe in self.drop_observers:
                    observe(f.instance_id)

    def _log_expiry(self, f: Fenced) -> None:
        record_expiry(self.metrics, f, self.fleet.instance_timeout, self.fleet.l2_retention)

    def _log_fence(self, f: Fenced) -> None:
        record_fence(self.metrics, f, self.fleet.l2_retention)

    # ---- the chunk size --------------------------------------------------------------

    def bind_chunk_size(self, chunk_size: int, position: Position | None = None) -> int:
        """Bind the fleet's chunk size (`FleetState.bind_chunk_size`); returns it. Raises
        ChunkSizeConflict (counted, logged) when refused. ``position``: the log record
        that carried the request (replicas apply it from Kafka)."""
        with self.lock:
            try:
                bound = self.fleet.bind_chunk_size(chunk_size)
            except ChunkSizeConflict as exc:
                self.metrics.chunk_size_binds.labels("refused").inc()
                log.warning("Refused chunk size %d: %s", chunk_size, exc)
                raise
            finally:
                self._advance(position)
        self.metrics.chunk_size_binds.labels("bound" if bound else "same").inc()
        if bound:
            memo = self._memo
            log.info(
                "Chunk size bound to %d by the fleet's servers%s",
                chunk_size,
                ""
                if memo is None or memo.chunk_size == chunk_size
                else f" (the token hash memo holds {memo.chunk_size}-token links: lookups"
                " by tokens hash without it; start with --chunk-size at the fleet's size)",
            )
        return chunk_size

    # ---- events ----------------------------------------------------------------------

    def ingest(
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
        m = self.metrics
        with self.lock:
            try:
                self.fleet.check_batches(batches, proof, now, self.bounds)
            except InvalidInput as exc:
                self._advance(position)
                m.ingest_batches.labels("refused", transport).inc(len(batches))
                self._count_refusal("events", exc, transport)
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
            with self.lock:
                try:
                    out = self.fleet.ingest(b, now)
                    if out.verdict is Verdict.APPLY and isinstance(b, EventBatch):
                        for observe in self.observers:
                            observe(b)
                finally:
                    if i == len(batches) - 1:
                        self._advance(position)
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
            with self.lock:
                self._advance(position)
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
        self.metrics.skipped_batches.labels(label, transport).inc()

    def advance(self, position: Position) -> None:
        """Move a consumer position past a record that changes nothing (undecodable)."""
        with self.lock:
            self._advance(position)

    # ---- lookups ---------------------------------------------------------------------

    def hash_tokens(self, tokens: Sequence[int] | bytes) -> list[ChunkHash]:
        """The prompt's chunk hashes; CPU work done outside the lock (the memo has its
        own, and a call that finds it taken hashes without it). The memo serves only the
        chunk size it was made for: once the fleet bound another, hashing goes without."""
        size = self.fleet.chunk_size
        memo = self._memo
        return chunk_hashes(
            tokens, size, memo=memo if memo is not None and memo.chunk_size == size else None
        )

    def lookup_hashes(self, hashes: Sequence[ChunkHash], ns: Namespace) -> PrefixResult:
        with self.lock:
            return self.fleet.directory.lookup_prefix(hashes, ns)

    def lookup_blob(self, blob: bytes, ns: Namespace) -> KeyColumns:
        """Placements per hash of a blob of concatenated full hashes (the keys form)."""
        with self.lock:
            return self.fleet.directory.lookup_blob(blob, ns)

    def lookup_keys(self, keys: Sequence[ObjectKey]) -> list[KeyResult]:
        with self.lock:
            return self.fleet.lookup_keys(keys)

    @property
    def blend_enabled(self) -> bool:
        return self.fleet.blend is not None

    def blend_lookup(self, tokens: bytes, ns: Namespace) -> list[BlendMatch]:
        with self.lock:
            return self.fleet.blend_lookup(tokens, ns)

    # ---- views -----------------------------------------------------------------------

    def stats(self, with_digest: bool = False, redact: bool = False) -> StatsResponse:
        """The lock covers the counters and, with ``with_digest``, a copy of the
        directory; the digest (seconds at 1M keys) and the views are made after.
        ``redact``: the cursors without incarnation and last seq."""
        with self.lock:
            fl = self.fleet
            stats = fl.stats()
            cursors = dict(fl.cursors)
            live = len(fl.membership)
            provisional = sorted(fl.provisional())
            active = [i.instance_id for i in fl.instances()] + provisional
            blend = fl.blend_stats()
            declarations = fl.capacity.declarations()
            keep_tokens = fl.directory.keep_tokens
            positions = dict(self.positions)
            capture = fl.directory.capture() if with_digest else None
        return stats_response(
            stats=stats,
            cursors=cursors,
            live=live,
            provisional=provisional,
            blend=blend,
            declarations=declarations,
            keep_tokens=keep_tokens,
            digest=capture.digest() if capture is not None else None,
            positions=positions,
            redact=redact,
            active=active,
        )

    def keys_page(
        self,
        offset: int,
        limit: int,
        tier: Tier | None,
        instance_id: InstanceId | None,
        backend: str | None,
    ) -> KeysPage:
        return keys_page(
            self.lock,
            self.fleet.directory,
            offset,
            limit,
            tier=tier,
            instance_id=instance_id,
            backend=backend,
        )

    def sample(self, now: float) -> StateSample:
        """Scrape-time state for metrics."""
        with self.lock:
            fl = self.fleet
            st = fl.stats()
            blend = fl.blend_stats()
            return StateSample(
                keys=st.keys,
                placements_by_tier=dict(st.placements_by_tier),
                bytes_by_tier=dict(st.bytes_by_tier),
                live_instances=len(fl.membership),
                provisional_instances=len(fl.provisional()),
                departed_instances=len(fl.departed()),
                heartbeat_age=fl.membership.heartbeat_ages(now),
                gaps={iid: c.gaps for iid, c in fl.cursors.items()},
                missing={iid: c.missing for iid, c in fl.cursors.items()},
                dropped={iid: c.dropped for iid, c in fl.cursors.items()},
                chunk_size=fl.chunk_size,
                chunk_size_bound=fl.chunk_size_bound,
                blend_chunks=blend.chunks if blend else 0,
                token_bytes=st.token_bytes,
                declared_capacity=[
                    (iid, c.tier.value, c.backend, c.capacity_bytes)
                    for iid, d in sorted(fl.capacity.declarations().items())
                    for c in d.compartments
                ],
            )

    def snapshot_parts(self) -> tuple[bytes, bytes | None, float]:
        """`snapshot`, and the `companion` state captured in the same lock hold (a copy;
        encoded as msgpack after)."""
        with self.lock:
            t0 = time.perf_counter()
            capture = self.fleet.capture(extra=dict(self.positions))
            extra = self.companion() if self.companion is not None else None
            locked = time.perf_counter() - t0
        return (
            capture.encode(),
            None if extra is None else msgspec.msgpack.encode(extra),
            locked,
        )

    def snapshot(self) -> tuple[bytes, float]:
        """The state and the consumer positions that led to it, encoded together, and
        the seconds the state was locked for it (the copy only, not the encoding)."""
        body, _, locked = self.snapshot_parts()
        return body, locked
