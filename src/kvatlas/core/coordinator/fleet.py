"""The fleet state: membership, gate cursors, key directory, declared capacities and
blend index together.

This is the coordinator's whole brain as one single-threaded, clock-free object: every
state change comes in through one method that returns an outcome (`register`,
`heartbeat`, `deregister`, `expire`, `ingest`), and every consumer (HTTP, Kafka, snapshot
replay) goes through the same methods. The shell adds locks, I/O, logs and metrics.

Rules it enforces (DESIGN.md section 3):
- A new incarnation, a deregistration and an expiry fence the instance's L1 slice.
  L2 placements stay, so that a restarted node's disk is found again, and leave through
  their own DELETE events, or when the instance has been gone (deregistered or expired,
  and neither registered nor sent events since) for ``l2_retention`` seconds: then every
  placement it still has is dropped (`FenceReason.L2_RETENTION`).
- Events of an instance that is not registered are applied provisionally: the instance
  gets a provisional membership that expires like any other unless a registration
  arrives, so events that reach the coordinator before the registration (Kafka) are not
  lost. When a provisional instance that never registered expires, all its placements
  go, L2 too: no disk of a fleet member stands behind them.
- Events of an incarnation lower than the highest seen for that instance are stale,
  also after a deregistration or an expiry.
- CONFIG batches declare capacity (`core.capacity`); a declaration is fenced with its
  instance's L1 slice and forgotten when the instance leaves.
- A batch of an event type this coordinator does not know (`UnknownBatch`) passes the
  gate, so its seq is not counted as a gap, and changes nothing else.
- Who may speak for an instance and how far one request may move it
  (`core.credentials`): a live bound instance's registration, heartbeat, deregistration
  and events need its proof; `check_batches` and `register` enforce the `Bounds`.
- The chunk size binds once (`bind_chunk_size`, LMCache 0.5.7's
  ``CoordinatorContext.bind_chunk_size``): until a server binds it, ``chunk_size`` is
  the configured minimum; the first size at or above it binds (token hashing and the
  blend index follow it), the same size again is a no-op, any other is refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum
from typing import Final

import msgspec
import numpy as np

from kvatlas.core.coordinator.blend import BlendIndex, BlendMatch, BlendStats
from kvatlas.core.coordinator.capacity import CapacityRegistry, Compartment, Declaration
from kvatlas.core.coordinator.directory import KeyDirectory
from kvatlas.core.coordinator.directory_snapshot import DirectoryCapture
from kvatlas.core.coordinator.gate import Cursor, Verdict, admit
from kvatlas.core.coordinator.membership import InstanceInfo, Membership, RegisterOutcome
from kvatlas.core.coordinator.placements import Applied, DirectoryStats, KeyResult, PrefixResult
from kvatlas.core.credentials import (
    Bounds,
    check_incarnation,
    check_proof,
    check_seq,
)
from kvatlas.core.errors import (
    ChunkSizeConflict,
    SnapshotError,
    StaleIncarnation,
    Unauthenticated,
)
from kvatlas.core.events import EventBatch, UnknownBatch
from kvatlas.core.keys import DEFAULT_CHUNK_SIZE, Namespace, ObjectKey, chunk_hashes
from kvatlas.core.types import EventType, Incarnation, InstanceId

SNAPSHOT_VERSION = 4
"""2 added the declared capacities and whether token ids are kept; a version 1 snapshot
restores with no declaration, keeping token ids if it had blend lookup on. 3 added the
departed instances (their L2 retention clocks); an older one restores with none. 4 added
whether the chunk size is bound; an older one restores unbound."""
_READABLE_VERSIONS = frozenset({1, 2, 3, 4})
DEFAULT_L2_RETENTION = 24 * 3600.0
"""Seconds the L2 placements of an instance that is gone stay for it to come back."""


class IngestOutcome(msgspec.Struct, frozen=True):
    """What happened to one batch."""

    verdict: Verdict
    gap: int = 0
    fenced: int = 0
    """L1 placements of an older incarnation fenced before this batch applied."""
    applied: Applied | None = None
    provisional: bool = False
    """The instance was not registered; it now has a provisional membership."""
    skipped: str = ""
    """The event type of an admitted `UnknownBatch` (nothing of it was applied)."""
    dropped: int = 0
    """Events the sender reported dropping since its last applied batch (a gap)."""


class FenceReason(StrEnum):
    """Why an instance's L1 slice was fenced (the value is the metrics label)."""

    NEW_INCARNATION = "new_incarnation"
    """A newer process of the same instance id registered or sent events."""
    DEREGISTERED = "deregistered"
    EXPIRED = "expired"
    """No heartbeat for the instance timeout."""
    EXPIRED_UNREGISTERED = "expired_unregistered"
    """Events arrived, but the instance never registered and fell silent: every tier."""
    L2_RETENTION = "l2_retention"
    """The instance has been gone for the L2 retention: what it still had, every tier."""

    @property
    def description(self) -> str:
        return _FENCE_DESCRIPTIONS[self]


_FENCE_DESCRIPTIONS: Final = {
    FenceReason.NEW_INCARNATION: "new incarnation",
    FenceReason.DEREGISTERED: "deregistered",
    FenceReason.EXPIRED: "expired",
    FenceReason.EXPIRED_UNREGISTERED: "expired (never registered)",
    FenceReason.L2_RETENTION: "gone for longer than the L2 retention",
}


class Fenced(msgspec.Struct, frozen=True):
    """An instance whose L1 slice was fenced, and why."""

    instance_id: InstanceId
    incarnation: Incarnation
    placements: int
    reason: FenceReason


class _Provisional(msgspec.Struct, array_like=True):
    incarnation: Incarnation
    last_seen: float


class _Departed(msgspec.Struct, array_like=True):
    incarnation: Incarnation
    at: float
    """When it was deregistered or expired (the caller's clock: wall time)."""


class _Snapshot(msgspec.Struct, array_like=True):
    version: int
    instance_timeout: float
    chunk_size: int
    blend_enabled: bool
    instances: list[InstanceInfo]
    high_water: dict[InstanceId, Incarnation]
    """The membership's marks (registrations only)."""
    event_high_water: dict[InstanceId, Incarnation]
    """Highest incarnation seen in registrations or applied events."""
    cursors: dict[InstanceId, Cursor]
    provisional: dict[InstanceId, _Provisional]
    directory: bytes
    blend: list[tuple[Namespace, bytes, bytes, int]]
    extra: dict[str, int]
    capacity: dict[str, Declaration] = {}
    """Version 2: the declared capacities, with the stamps that ordered them."""
    keep_tokens: bool | None = None
    """Version 2: whether the directory kept token ids (None: as ``blend_enabled``)."""
    departed: dict[InstanceId, _Departed] = {}
    """Version 3: instances gone, whose L2 placements wait out the retention."""
    chunk_size_bound: bool = False
    """Version 4: whether ``chunk_size`` was bound by a server (else the minimum)."""


class FleetCapture:
    """A point-in-time copy of a `FleetState` (see `FleetState.capture`)."""

    def __init__(self, head: _Snapshot, directory: DirectoryCapture) -> None:
        self._head = head
        self._directory = directory

    def encode(self) -> bytes:
        """The snapshot bytes; `FleetState.restore` reads them."""
        snap = msgspec.structs.replace(self._head, directory=self._directory.encode())
        return msgspec.msgpack.encode(snap)


class FleetState:
    """Membership + cursors + directory (+ blend index). Single-threaded, time-free."""

    def __init__(
        self,
        instance_timeout: float = 30.0,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        enable_blend: bool = False,
        keep_tokens: bool = True,
        l2_retention: float = DEFAULT_L2_RETENTION,
    ) -> None:
        """``keep_tokens``: keep the token ids that senders send with STORE (LMCache's
        servers do; lookups then answer them, as LMCache's coordinator does). The blend
        index needs them, so ``enable_blend`` keeps them whatever this says.
        ``l2_retention``: seconds an instance may stay gone before its L2 placements
        are dropped (0: at once)."""
        self.instance_timeout = instance_timeout
        self.l2_retention = l2_retention
        self.chunk_size = chunk_size
        """Tokens per chunk: the configured minimum until `bind_chunk_size` binds it."""
        self.chunk_size_bound = False
        self.membership = Membership(instance_timeout)
        self.directory = KeyDirectory(keep_tokens=keep_tokens or enable_blend)
        self.blend: BlendIndex | None = BlendIndex(chunk_size) if enable_blend else None
        self.capacity = CapacityRegistry()
        self.cursors: dict[InstanceId, Cursor] = {}
        self._provisional: dict[InstanceId, _Provisional] = {}
        self._high_water: dict[InstanceId, Incarnation] = {}
        self._departed: dict[InstanceId, _Departed] = {}

    # ---- membership ------------------------------------------------------------------

    def _max_incarnation(self, instance_id: InstanceId) -> Incarnation | None:
        a = self.membership.max_incarnation(instance_id)
        b = self._high_water.get(instance_id)
        if a is None:
            return b
        return a if b is None else max(a, b)

    def register(
        self,
        info: InstanceInfo,
        now: float,
        proof: bytes = b"",
        bounds: Bounds | None = None,
        *,
        check_contract: bool = True,
    ) -> tuple[RegisterOutcome, Fenced | None]:
        """Register (or re-register) an instance; fences a superseded incarnation.

        Raises StaleIncarnation below the highest incarnation seen (also from events),
        ContractMismatch when the hash contract contradicts the fleet's (unless
        ``check_contract`` is off: the replica that received the registration decided it,
        and the record carries the decision, `core.contract_claims`). An instance that
        registers without an incarnation (``incarnation_from_events``) takes the highest
        one known for its id, so it is never stale; its events move it up from there.
        A live bound instance is re-registered only with its ``proof`` (Unauthenticated,
        CredentialRefused); with ``bounds``, an unbound registration is refused when
        credentials are required and an incarnation ahead of ``now`` is OutOfBounds.
        """
        iid = info.instance_id
        live = self.membership.get(iid)
        if live is not None:
            check_proof(iid, live.credential_digest, proof)
        if info.incarnation_from_events:
            known = self._max_incarnation(iid)
            info = msgspec.structs.replace(info, incarnation=known or 0)
        high = self._max_incarnation(iid)
        if high is not None and info.incarnation < high:
            raise StaleIncarnation(iid, info.incarnation, high)
        if bounds is not None:
            if bounds.require_credentials and not info.credential_digest:
                raise Unauthenticated(
                    f"instance {iid!r} registered without asking for a credential and this"
                    " coordinator requires one (--require-instance-credentials)"
                )
            check_incarnation(iid, info.incarnation, high, now, bounds)
        outcome = self.membership.register(info, now, check_contract=check_contract)
        self._departed.pop(info.instance_id, None)
        prov = self._provisional.pop(info.instance_id, None)
        fenced = None
        old = outcome.fenced_incarnation
        if old is None and prov is not None and prov.incarnation < info.incarnation:
            old = prov.incarnation
        if old is not None:
            n = self.directory.fence_below(info.instance_id, info.incarnation)
            self.capacity.fence_below(info.instance_id, info.incarnation)
            fenced = Fenced(info.instance_id, old, n, FenceReason.NEW_INCARNATION)
        self._high_water[info.instance_id] = max(
            info.incarnation, self._high_water.get(info.instance_id, info.incarnation)
        )
        return outcome, fenced

    def authorize(self, instance_id: InstanceId, proof: bytes, *, require: bool = False) -> bool:
        """May a request with ``proof`` speak for ``instance_id``? True: the live instance
        is bound and this is its proof; False: it is not bound (or not live) and
        ``require`` is off. Raises Unauthenticated or CredentialRefused
        (`core.credentials.check_proof`)."""
        live = self.membership.get(instance_id)
        digest = live.credential_digest if live is not None else b""
        return check_proof(instance_id, digest, proof, require=require)

    def heartbeat(self, instance_id: InstanceId, now: float) -> bool:
        """False: unknown (or only provisional) instance, which must re-register. The
        caller checks the credential first (`authorize`)."""
        return self.membership.heartbeat(instance_id, now)

    def deregister(
        self, instance_id: InstanceId, now: float, proof: bytes | None = None
    ) -> Fenced | None:
        """Remove an instance, fence its L1 slice and forget its cursor; its L2
        placements wait out the retention from ``now``. With ``proof`` (None: already
        checked), a live bound instance leaves only with its own."""
        if proof is not None:
            self.authorize(instance_id, proof)
        info = self.membership.deregister(instance_id)
        prov = self._provisional.pop(instance_id, None)
        self.cursors.pop(instance_id, None)
        self.capacity.forget(instance_id)
        if info is not None:
            inc = info.incarnation
        elif prov is not None:
            inc = prov.incarnation
        else:
            return None
        n = self._gone(instance_id, inc, now)
        return Fenced(instance_id, inc, n, FenceReason.DEREGISTERED)

    def _gone(self, instance_id: InstanceId, incarnation: Incarnation, at: float) -> int:
        """The instance left at ``at``: fence its L1 slice and start its L2 retention
        clock, or drop every placement at once when it never registered. Placements
        removed."""
        if self.membership.max_incarnation(instance_id) is None:
            return self.directory.drop(instance_id)
        self._departed[instance_id] = _Departed(incarnation, at)
        return self.directory.fence(instance_id)

    def expire(self, now: float) -> list[Fenced]:
        """Expire silent instances (registered or provisional) and fence their L1 slices
        (a provisional one that never registered loses every tier), then drop what is
        left of instances gone for the L2 retention."""
        out = []
        for info in self.membership.expire(now):
            n = self._gone(info.instance_id, info.incarnation, now)
            self.capacity.forget(info.instance_id)
            out.append(Fenced(info.instance_id, info.incarnation, n, FenceReason.EXPIRED))
        for iid, prov in sorted(self._provisional.items()):
            if now - prov.last_seen > self.instance_timeout:
                del self._provisional[iid]
                n = self._gone(iid, prov.incarnation, now)
                self.capacity.forget(iid)
                reason = (
                    FenceReason.EXPIRED
                    if iid in self._departed
                    else FenceReason.EXPIRED_UNREGISTERED
                )
                out.append(Fenced(iid, prov.incarnation, n, reason))
        out.extend(self.expire_departed(now))
        return out

    def expire_departed(self, now: float) -> list[Fenced]:
        """Drop every placement of the instances gone for ``l2_retention`` at ``now``.
        Replicas call it with the times of the records they apply, so that all of them
        drop at the same point of the log."""
        out = []
        for iid, gone in sorted(self._departed.items()):
            if now - gone.at >= self.l2_retention:
                del self._departed[iid]
                n = self.directory.drop(iid)
                out.append(Fenced(iid, gone.incarnation, n, FenceReason.L2_RETENTION))
        return out

    def departed(self) -> dict[InstanceId, tuple[Incarnation, float]]:
        """Instances gone whose L2 placements wait out the retention: id ->
        (incarnation, when it left)."""
        return {k: (v.incarnation, v.at) for k, v in self._departed.items()}

    def expire_instance(
        self, instance_id: InstanceId, incarnation: Incarnation, last_seen: float
    ) -> Fenced | None:
        """Expire one instance if it is still ``incarnation`` and nothing was heard of it
        after ``last_seen``. Replicas apply expiry decisions from a log with this
        condition, so a heartbeat that overtook the expiry wins everywhere."""
        live = self.membership.get(instance_id)
        if live is not None:
            if live.incarnation != incarnation or live.last_heartbeat > last_seen:
                return None
            self.membership.deregister(instance_id)
            n = self._gone(instance_id, incarnation, last_seen)
            self.capacity.forget(instance_id)
            return Fenced(instance_id, incarnation, n, FenceReason.EXPIRED)
        prov = self._provisional.get(instance_id)
        if prov is None or prov.incarnation != incarnation or prov.last_seen > last_seen:
            return None
        del self._provisional[instance_id]
        n = self._gone(instance_id, incarnation, last_seen)
        self.capacity.forget(instance_id)
        reason = (
            FenceReason.EXPIRED
            if instance_id in self._departed
            else FenceReason.EXPIRED_UNREGISTERED
        )
        return Fenced(instance_id, incarnation, n, reason)

    def instances(self) -> list[InstanceInfo]:
        return self.membership.instances()

    def provisional(self) -> dict[InstanceId, tuple[Incarnation, float]]:
        """Instances known only from their events: id -> (incarnation, last seen)."""
        return {k: (v.incarnation, v.last_seen) for k, v in self._provisional.items()}

    # ---- the chunk size --------------------------------------------------------------

    def bind_chunk_size(self, chunk_size: int) -> bool:
        """Bind the fleet's chunk size once; True when this call bound it, False when it
        was bound to ``chunk_size`` already. Raises ChunkSizeConflict (nothing changes)
        when another size is bound, or, unbound, when ``chunk_size`` is below the
        configured minimum (``chunk_size`` until bound). The blend index is rebuilt for
        the new size from what it holds."""
        if self.chunk_size_bound:
            if chunk_size == self.chunk_size:
                return False
            raise ChunkSizeConflict(
                f"Coordinator is already bound to chunk size {self.chunk_size}; use a"
                f" separate coordinator for a fleet requiring chunk size {chunk_size}"
            )
        if chunk_size < self.chunk_size:
            raise ChunkSizeConflict(
                f"Chunk size {chunk_size} is smaller than the coordinator's configured"
                f" minimum {self.chunk_size}"
            )
        if self.blend is not None and chunk_size != self.chunk_size:
            rebuilt = BlendIndex(chunk_size)
            for ns, h, toks, start in self.blend.snapshot_items():
                rebuilt.add(ns, h, toks, start)
            self.blend = rebuilt
        self.chunk_size = chunk_size
        self.chunk_size_bound = True
        return True

    # ---- events ----------------------------------------------------------------------

    def check_batches(
        self,
        batches: Sequence[EventBatch | UnknownBatch],
        proof: bytes,
        now: float,
        bounds: Bounds,
    ) -> None:
        """Refuse, before anything of them applies, batches that ``proof`` may not send
        (Unauthenticated, CredentialRefused) or that move a cursor past ``bounds``
        (OutOfBounds). Each batch is measured against the state before the first."""
        for b in batches:
            iid = b.instance_id
            proven = self.authorize(iid, proof, require=bounds.require_credentials)
            high = self._max_incarnation(iid)
            if high is not None and b.incarnation < high:
                continue  # stale: the gate drops it
            check_incarnation(iid, b.incarnation, high, now, bounds)
            cursor = self.cursors.get(iid)
            if cursor is None and proven:
                continue  # this coordinator lost the cursor; the instance proved itself
            same = cursor is not None and cursor.incarnation == b.incarnation
            base = cursor.last_seq if cursor is not None and same else 0
            check_seq(iid, b.incarnation, b.seq, base, bounds)

    def ingest(self, batch: EventBatch | UnknownBatch, now: float) -> IngestOutcome:
        """Gate and apply one batch. Raises InvalidInput (nothing applied) on bad data.

        An `UnknownBatch` is gated like any batch (it may fence an older incarnation and
        it moves the cursor) and applies nothing: its outcome names it in ``skipped``.
        """
        iid = batch.instance_id
        high = self._max_incarnation(iid)
        if high is not None and batch.incarnation < high:
            return IngestOutcome(Verdict.STALE)
        dropped_events = batch.dropped_events if isinstance(batch, EventBatch) else None
        adm = admit(self.cursors.get(iid), batch.incarnation, batch.seq, dropped_events)
        if adm.verdict is not Verdict.APPLY:
            return IngestOutcome(adm.verdict)
        live = self.membership.get(iid)
        provisional = False
        if live is None or live.incarnation != batch.incarnation:
            if live is not None and live.incarnation > batch.incarnation:
                return IngestOutcome(Verdict.STALE)
            # A live instance registered without an incarnation takes its events' own
            # (LMCache's servers); anyone else sending an unknown incarnation is provisional.
            provisional = not self.membership.adopt_incarnation(iid, batch.incarnation)
        fenced = 0
        if adm.fence_incarnation is not None:
            fenced = self.directory.fence_below(iid, batch.incarnation)
            self.capacity.fence_below(iid, batch.incarnation)
        applied = None
        skipped = ""
        placed: EventBatch | None = None
        if isinstance(batch, UnknownBatch):
            skipped = batch.event_type
        elif batch.event_type is EventType.CONFIG:
            self.capacity.declare(
                iid,
                batch.incarnation,
                batch.capacity_revision,
                Compartment(batch.tier, batch.backend, batch.capacity_bytes, batch.shared),
            )
        else:
            applied = self.directory.apply(batch)
            placed = batch
        self.cursors[iid] = adm.cursor
        self._departed.pop(iid, None)  # back: its L2 placements are its own again
        self._high_water[iid] = max(batch.incarnation, self._high_water.get(iid, batch.incarnation))
        if provisional:
            self._provisional[iid] = _Provisional(batch.incarnation, now)
        if self.blend is not None and placed is not None:
            self._update_blend(placed)
        return IngestOutcome(
            Verdict.APPLY, adm.gap, fenced, applied, provisional, skipped, adm.dropped
        )

    def _update_blend(self, batch: EventBatch) -> None:
        assert self.blend is not None
        if batch.event_type is EventType.STORE:
            for e in batch.entries:  # only entries carry tokens; a block never does
                if e.token_ids is not None and e.token_offset >= 0:
                    self.blend.add(e.key.namespace, e.key.chunk_hash, e.token_ids, e.token_offset)
        elif batch.event_type is EventType.DELETE:
            # Every deleted key, the block's too: one may have been bound by an earlier
            # STORE with tokens.
            keys = [e.key for e in batch.all_entries()]
            for key, res in zip(keys, self.directory.lookup_keys(keys), strict=True):
                if not res.placements:  # the last copy is gone
                    self.blend.remove(key.namespace, key.chunk_hash)

    # ---- lookups ---------------------------------------------------------------------

    def lookup_tokens(self, tokens: Sequence[int] | bytes, ns: Namespace) -> PrefixResult:
        """Hash the full chunks of ``tokens`` and report who holds each and the prefixes."""
        return self.directory.lookup_prefix(chunk_hashes(tokens, self.chunk_size), ns)

    def lookup_keys(self, keys: Sequence[ObjectKey]) -> list[KeyResult]:
        return self.directory.lookup_keys(keys)

    def blend_lookup(self, tokens: Sequence[int] | bytes, ns: Namespace) -> list[BlendMatch]:
        """Chunks cached anywhere in ``tokens`` whose key still has a placement."""
        if self.blend is None:
            return []
        matches = self.blend.lookup(ns, tokens)
        keys = [
            ObjectKey(m.chunk_hash, ns.model_name, ns.kv_rank, ns.object_group_id, ns.cache_salt)
            for m in matches
        ]
        held = self.directory.lookup_keys(keys)
        return [m for m, r in zip(matches, held, strict=True) if r.placements]

    def stats(self) -> DirectoryStats:
        return self.directory.stats()

    def blend_stats(self) -> BlendStats | None:
        return None if self.blend is None else self.blend.stats()

    # ---- snapshot --------------------------------------------------------------------

    def digest(self) -> str:
        """Digest of the directory content (placements and access counts)."""
        return self.directory.digest()

    def snapshot(self, extra: dict[str, int] | None = None) -> bytes:
        """Encode the whole state; ``extra`` carries the shell's positions (Kafka offsets)."""
        return self.capture(extra).encode()

    def capture(self, extra: dict[str, int] | None = None) -> FleetCapture:
        """The state at this instant, to encode later (see `KeyDirectory.capture`): a
        shell's lock covers the copies, not the encoding. The blend index, when enabled,
        is copied whole here."""
        blend_items: list[tuple[Namespace, bytes, bytes, int]] = []
        if self.blend is not None:
            for ns, h, toks, start in self.blend.snapshot_items():
                blend_items.append((ns, bytes(h), bytes(toks), start))
        return FleetCapture(
            _Snapshot(
                version=SNAPSHOT_VERSION,
                instance_timeout=self.instance_timeout,
                chunk_size=self.chunk_size,
                blend_enabled=self.blend is not None,
                instances=self.membership.instances(),
                high_water=self.membership.high_water(),
                event_high_water=dict(self._high_water),
                cursors=dict(self.cursors),
                provisional=dict(self._provisional),
                directory=b"",
                blend=blend_items,
                extra=dict(extra or {}),
                capacity=self.capacity.declarations(),
                keep_tokens=self.directory.keep_tokens,
                departed=dict(self._departed),
                chunk_size_bound=self.chunk_size_bound,
            ),
            self.directory.capture(),
        )

    @classmethod
    def restore(
        cls,
        data: bytes,
        now: float | None = None,
        instance_timeout: float | None = None,
        keep_tokens: bool | None = None,
        l2_retention: float = DEFAULT_L2_RETENTION,
    ) -> tuple[FleetState, dict[str, int]]:
        """Rebuild a state from `snapshot` bytes; returns it and the shell's ``extra``.

        With ``now``, every restored instance gets a full timeout from ``now`` to prove
        itself alive (the snapshot's clock may not be this process's). ``instance_timeout``
        overrides the snapshot's (the operator's flag wins); so does ``keep_tokens`` (token
        ids are dropped on restore when it is False). ``l2_retention`` is the operator's
        (it is not in the snapshot); the departed instances keep their departure times
        (wall clock), so the downtime counts against the retention, and a departure
        that lies after ``now`` (a clock set back) counts from ``now``.
        """
        try:
            snap = msgspec.msgpack.decode(data, type=_Snapshot)
        except msgspec.DecodeError as exc:
            raise SnapshotError(f"fleet snapshot cannot be decoded: {exc}") from exc
        if snap.version not in _READABLE_VERSIONS:
            raise SnapshotError(f"fleet snapshot version {snap.version} is not supported")
        timeout = snap.instance_timeout if instance_timeout is None else instance_timeout
        kept = snap.blend_enabled if snap.keep_tokens is None else snap.keep_tokens
        keep = kept if keep_tokens is None else keep_tokens
        state = cls(timeout, snap.chunk_size, snap.blend_enabled, keep, l2_retention)
        state.chunk_size_bound = snap.chunk_size_bound
        state.membership = Membership.restore(
            snap.instances, snap.high_water, instance_timeout=timeout, now=now
        )
        state._high_water = dict(snap.event_high_water)
        state.cursors = dict(snap.cursors)
        state._provisional = dict(snap.provisional)
        state._departed = {
            iid: gone if now is None or gone.at <= now else _Departed(gone.incarnation, now)
            for iid, gone in snap.departed.items()
        }
        state.capacity = CapacityRegistry.restore(snap.capacity)
        state.directory = KeyDirectory.restore(
            snap.directory, keep_tokens=state.directory.keep_tokens
        )
        if state.blend is not None:
            for ns, h, toks, start in snap.blend:
                state.blend.add(ns, h, np.frombuffer(toks, dtype=np.uint32), start)
        return state, dict(snap.extra)
