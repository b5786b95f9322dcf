"""The chunk store: the L1 pool, its shared-memory region and the optional L2, together.

Owns moving chunk bytes between tiers: an L1 eviction is demoted to L2 (copied out before
the evicted slot is handed to a new writer), an L2 hit found by ``lookup_prefix`` is
promoted into a fresh L1 slot (checksum verified by the L2 adapter, so a corrupt chunk is
a miss, never wrong bytes). It also merges the pool's and the L2 adapter's events into one
ordered list of per-tier records for the event publisher.

It must not take locks, read clocks or deliver events: ``storage.guarded.GuardedStore``
holds one lock around every call, passes ``now`` and drains ``take_events()`` to the
publisher.
Engines only read and write L1 (through the shared region), so ``acquire_read`` does not
look at L2: ``lookup_prefix`` is the one place that promotes.

Event order: a demotion reports the L2 STORE before the L1 DELETE, so the fleet never
sees a window where the chunk is nowhere.

Unhashed commits: a writer that cannot give the checksum (an LMCache worker) may commit
first (``commit_unhashed``); what is then owed, and how it is settled off the lock or
computed on the spot by a reader that hands the checksum on (``acquire_read``,
``committed_info``, a demotion to L2), is ``checksums``' (``storage.pending_checksums``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Final

from kvatlas.core.checksum import checksum as compute_checksum
from kvatlas.core.errors import InvalidInput
from kvatlas.core.events import Entry
from kvatlas.core.keys import ObjectKey
from kvatlas.core.server.l1pool import (
    DeleteOutcome,
    ExpiredLease,
    L1Pool,
    LeaseId,
    PoolEvent,
    PoolStats,
    ReadLease,
    Refusal,
    Refused,
    Reserved,
    Slot,
    SlotInfo,
)
from kvatlas.core.server.l1shares import SaltUsage
from kvatlas.core.types import EventType, Tier
from kvatlas.runtime.region import L1Region
from kvatlas.server.storage.l1_journal import L1Journal
from kvatlas.server.storage.l2 import L2Adapter, L2Error, as_bytes_view
from kvatlas.server.storage.pending_checksums import PendingChecksums

log = logging.getLogger(__name__)

PIN_LEASE_S: Final = 60.0
"""Lease of the read pins ``lookup_prefix`` holds during one call (released before return)."""
PROMOTE_LEASE_S: Final = 60.0
"""Write lease of a promotion; it commits or aborts within the same call."""


@dataclass(frozen=True, slots=True)
class TierEvent:
    """A STORE or DELETE on one tier, ready to go into an EventBatch."""

    tier: Tier
    kind: EventType
    key: ObjectKey
    size: int
    reason: str

    def entry(self) -> Entry:
        return Entry(self.key, self.size)


def batches(events: Sequence[TierEvent]) -> Iterator[tuple[EventType, Tier, tuple[Entry, ...]]]:
    """Consecutive events of the same (kind, tier) grouped, in order: one EventBatch each."""
    run: list[Entry] = []
    current: tuple[EventType, Tier] | None = None
    for event in events:
        head = (event.kind, event.tier)
        if head != current and run:
            assert current is not None
            yield current[0], current[1], tuple(run)
            run = []
        current = head
        run.append(event.entry())
    if run and current is not None:
        yield current[0], current[1], tuple(run)


@dataclass(frozen=True, slots=True)
class KeyDeleted:
    """What ``ChunkStore.delete`` did to one key."""

    l1: bool
    """Removed from L1."""
    l1_locked: bool
    """Kept in L1: locked, and the delete was not forced."""
    l2: bool
    """Removed from L2."""


@dataclass(frozen=True, slots=True)
class ChunkStoreStats:
    """A snapshot for metrics and ``/status``."""

    l1: PoolStats
    l2_used_bytes: int
    l2_capacity_bytes: int
    promotions: int
    promotion_failures: int
    demotions: int
    demotion_failures: int
    l1_by_salt: tuple[SaltUsage, ...] = ()
    """Per cache_salt: L1 bytes and chunks held, evictions by its own and others'
    allocations (``L1Pool.salt_usage``)."""


class ChunkStore:
    """L1 (pool + region) and an optional L2; single-threaded, the caller holds a lock."""

    def __init__(
        self,
        pool: L1Pool,
        region: L1Region,
        l2: L2Adapter | None = None,
        journal: L1Journal | None = None,
    ) -> None:
        """``journal``: where every L1 change is recorded for a warm restart (None: no
        record, the region is not kept)."""
        if region.size < pool.capacity_bytes:
            raise InvalidInput(
                f"L1 region of {region.size} bytes is smaller than the pool's capacity"
                f" ({pool.capacity_bytes})"
            )
        if region.readonly:
            raise InvalidInput("the chunk store needs a writable L1 region")
        self.pool = pool
        self.region = region
        self.l2 = l2
        self.journal = journal
        self._events: list[TierEvent] = []
        self._promotions = 0
        self._promotion_failures = 0
        self._demotions = 0
        self._demotion_failures = 0
        self.checksums = PendingChecksums(pool, region, journal)
        """The checksums owed by commits that came before them (``commit_unhashed``)."""

    # --------------------------------------------------------------------------- stores

    def reserve(
        self, key: ObjectKey, size: int, now: float, lease_s: float, holder: str = ""
    ) -> Reserved | Refused:
        """Write-lock an L1 slot (see ``L1Pool.reserve``); evicted chunks are already
        demoted to L2 when this returns, so the caller may write the slot at once."""
        result = self.pool.reserve(key, size, now, lease_s, holder)
        if isinstance(result, Reserved):
            self._demote(result.evicted)
        self._collect()
        if isinstance(result, Reserved) and self.journal is not None:
            self.journal.reserved(key, result.slot.offset, self.pool.reserved_size(size))
        return result

    def slot_view(self, slot: Slot) -> memoryview:
        """The writable bytes of a reserved slot."""
        return self.region.view(slot.offset, slot.size)

    def commit(
        self,
        key: ObjectKey,
        now: float,
        checksum: int | None = None,
        lease_id: LeaseId | None = None,
    ) -> SlotInfo | None:
        """Make a written slot readable; the checksum is computed from the region when not
        given. None when the write is unknown or its lease expired (see ``L1Pool.commit``)."""
        if checksum is None:
            info = self.pool.get(key)
            if info is None or info.committed:
                return None
            checksum = compute_checksum(self.region.view(info.offset, info.size))
        result = self.pool.commit(key, checksum, now, lease_id)
        if result is not None:
            self.checksums.forget(key)  # an older commit of the key's, since evicted
        else:
            self._forget_write(key)
        self._collect()
        return result

    def commit_unhashed(self, key: ObjectKey, now: float, lease_id: LeaseId) -> SlotInfo | None:
        """``commit`` whose checksum comes later (``checksums.settle``): readable at once,
        its checksum computed on the spot by any reader that needs it before then."""
        result = self.pool.commit(key, 0, now, lease_id)
        if result is not None:
            self.checksums.owe(key, lease_id)
        else:
            self._forget_write(key)
        self._collect()
        return result

    def committed_info(self, key: ObjectKey) -> SlotInfo | None:
        """The committed chunk's slot with its real checksum; None when not committed."""
        self.checksums.hash_now(key)
        info = self.pool.get(key)
        return info if info is not None and info.committed else None

    def abort(self, key: ObjectKey) -> bool:
        aborted = self.pool.abort(key)
        if aborted and self.journal is not None:
            self.journal.dropped(key)
        return aborted

    def store(
        self, key: ObjectKey, data: bytes | bytearray | memoryview, now: float
    ) -> SlotInfo | Refused:
        """Reserve, copy ``data`` in and commit in one call (for in-process writers)."""
        view = as_bytes_view(data)
        result = self.reserve(key, view.nbytes, now, PROMOTE_LEASE_S, holder="store")
        if isinstance(result, Refused):
            return result
        self.slot_view(result.slot)[:] = view
        info = self.commit(key, now, compute_checksum(view), result.slot.lease_id)
        assert info is not None, "a write committed in the same call cannot have expired"
        return info

    # ---------------------------------------------------------------------------- reads

    def lookup_prefix(self, keys: Sequence[ObjectKey], now: float) -> int:
        """How many leading ``keys`` are in L1 now, promoting L2 hits into L1.

        Found chunks are pinned (read-locked) while later ones are promoted, so a promotion
        never evicts an earlier hit of the same lookup; the pins are released on return.
        """
        pins: list[LeaseId] = []
        try:
            for key in keys:
                lease = self.pool.acquire_read(key, "lookup", now, PIN_LEASE_S)
                if lease is None and self._promote(key, now):
                    lease = self.pool.acquire_read(key, "lookup", now, PIN_LEASE_S)
                if lease is None:
                    break
                pins.append(lease.lease_id)
            return len(pins)
        finally:
            for lease_id in pins:
                self.pool.release(lease_id)
            self._collect()

    def warm(self, keys: Sequence[ObjectKey], now: float) -> list[ObjectKey]:
        """Bring every one of ``keys`` that L2 holds into L1 (not only a leading run, as
        ``lookup_prefix`` does); returns those in L1 now. Resident ones are pinned while
        later ones are promoted, and released on return, as in ``lookup_prefix``."""
        pins: list[LeaseId] = []
        resident: list[ObjectKey] = []
        try:
            for key in keys:
                lease = self.pool.acquire_read(key, "warm", now, PIN_LEASE_S)
                if lease is None and self._promote(key, now):
                    lease = self.pool.acquire_read(key, "warm", now, PIN_LEASE_S)
                if lease is not None:
                    pins.append(lease.lease_id)
                    resident.append(key)
            return resident
        finally:
            for lease_id in pins:
                self.pool.release(lease_id)
            self._collect()

    def delete(self, key: ObjectKey, *, l1: bool, l2: bool, force: bool) -> KeyDeleted:
        """Delete ``key`` from L1 and/or L2. L1 keeps it when it is locked (a reader's
        lease, a write in progress) and ``force`` is off; L2 is acted on all the same, as
        LMCache does. DELETE events are recorded for what went."""
        l1_out = self.pool.delete(key, force=force) if l1 else DeleteOutcome.ABSENT
        l2_gone = l2 and self.l2 is not None and self.l2.delete(key)
        self._collect()
        if l1_out is DeleteOutcome.DELETED and self.journal is not None:
            self.journal.dropped(key)  # a write in progress records no DELETE event
        return KeyDeleted(
            l1_out is DeleteOutcome.DELETED, l1_out is DeleteOutcome.LOCKED, bool(l2_gone)
        )

    def clear_l1(self, force: bool) -> int:
        """Delete every L1 chunk (locked ones only with ``force``); returns how many."""
        gone = [
            info.key
            for info in self.pool.slots()
            if self.pool.delete(info.key, force=force) is DeleteOutcome.DELETED
        ]
        self._collect()
        if self.journal is not None:
            for key in gone:
                self.journal.dropped(key)
        return len(gone)

    def acquire_read(
        self, key: ObjectKey, holder: str, now: float, lease_s: float, *, checksum: bool = True
    ) -> ReadLease | None:
        """Read-lock an L1 chunk (L1 only: promotion happens in ``lookup_prefix``). With
        ``checksum`` off the lease's checksum may be a placeholder: for a caller that
        reads the bytes in this process and hands no checksum on."""
        if checksum:
            self.checksums.hash_now(key)
        return self.pool.acquire_read(key, holder, now, lease_s)

    def read_view(self, lease: ReadLease) -> memoryview:
        """The bytes a read lease covers (valid until the lease ends)."""
        return self.region.view(lease.offset, lease.size)

    def release(self, lease_id: LeaseId, holder: str | None = None) -> bool:
        """End a read lease (only ``holder``'s, when given)."""
        return self.pool.release(lease_id, holder)

    def expire(self, now: float) -> list[ExpiredLease]:
        expired = self.pool.expire(now)
        if self.journal is not None:
            for lease in expired:
                if lease.write:
                    self.journal.dropped(lease.key)
        return expired

    # --------------------------------------------------------------------------- events

    def take_events(self) -> list[TierEvent]:
        """Every STORE/DELETE on L1 and L2 since the last call, in order."""
        self._collect()
        events, self._events = self._events, []
        return events

    def startup_l2_events(self) -> list[TierEvent]:
        """A STORE on L2 for every chunk L2 holds (report once, after start)."""
        if self.l2 is None:
            return []
        return [
            TierEvent(Tier.L2, EventType.STORE, item.key, item.size, "found")
            for item in self.l2.list()
        ]

    def stats(self) -> ChunkStoreStats:
        used, capacity = self.l2.usage() if self.l2 is not None else (0, 0)
        return ChunkStoreStats(
            l1=self.pool.stats(),
            l2_used_bytes=used,
            l2_capacity_bytes=capacity,
            promotions=self._promotions,
            promotion_failures=self._promotion_failures,
            demotions=self._demotions,
            demotion_failures=self._demotion_failures,
            l1_by_salt=tuple(self.pool.salt_usage()),
        )

    # ------------------------------------------------------------------------ internals

    def _promote(self, key: ObjectKey, now: float) -> bool:
        if self.l2 is None:
            return False
        item = self.l2.item(key)
        if item is None:
            return False
        reserved = self.pool.reserve(key, item.size, now, PROMOTE_LEASE_S, holder="promote")
        if isinstance(reserved, Refused):
            # BUSY: an engine is storing it right now; NO_SPACE: L1 is pinned full.
            if reserved.reason is not Refusal.EXISTS:
                self._promotion_failures += 1
            return reserved.reason is Refusal.EXISTS
        self._demote(reserved.evicted)
        slot = reserved.slot
        if self.journal is not None:
            self._collect()  # the evictions' DROPs go first
            self.journal.reserved(key, slot.offset, self.pool.reserved_size(slot.size))
        try:
            got = self.l2.get_into(key, self.region.view(slot.offset, slot.size))
        except L2Error as exc:
            log.warning("promotion of %s from L2 failed: %s", key.chunk_hash_hex, exc)
            got = None
        if got != item.size:  # absent, corrupt (the adapter verified the checksum) or short
            self.abort(key)
            self._promotion_failures += 1
            return False
        self.pool.commit(key, item.checksum, now, slot.lease_id)
        self.checksums.forget(key)
        self._promotions += 1
        return True

    def _demote(self, victims: Sequence[SlotInfo]) -> None:
        """Copy evicted chunks to L2 while their bytes are still intact in the region."""
        unhashed = {v.key for v in victims if self.checksums.forget(v.key)}
        if self.l2 is None:
            return
        for victim in victims:
            if self.l2.contains(victim.key):
                continue  # promoted earlier: L2 still holds the same bytes
            view = self.region.view(victim.offset, victim.size)
            digest = compute_checksum(view) if victim.key in unhashed else victim.checksum
            try:
                self.l2.put(victim.key, view, digest)
            except (InvalidInput, L2Error) as exc:
                self._demotion_failures += 1
                log.warning("demotion of %s to L2 failed: %s", victim.key.chunk_hash_hex, exc)
                continue
            self._demotions += 1
        self._collect_l2()

    def _forget_write(self, key: ObjectKey) -> None:
        """A commit refused because its lease had expired freed the slot unrecorded."""
        if self.journal is not None and self.pool.get(key) is None:
            self.journal.dropped(key)

    def _collect_l2(self) -> None:
        if self.l2 is not None:
            self._events.extend(_tiered(Tier.L2, self.l2.take_events()))

    def _collect(self) -> None:
        self._collect_l2()
        events = self.pool.take_events()
        if self.journal is not None and events:
            self._journal(events)
        self._events.extend(_tiered(Tier.L1, events))

    def _journal(self, events: list[PoolEvent]) -> None:
        """Record the pool's commits and removals (a restore is already on record)."""
        journal = self.journal
        assert journal is not None
        for event in events:
            if event.kind is EventType.DELETE:
                journal.dropped(event.key)
            elif event.reason != "restored":
                info = self.pool.get(event.key)
                if info is not None and info.committed:
                    journal.committed(info, self.checksums.known(event.key))
        if journal.wants_compaction(len(self.pool)):
            journal.rewrite(self.pool.slots(), self.checksums.keys())


def _tiered(tier: Tier, events: list[PoolEvent]) -> Iterator[TierEvent]:
    return (TierEvent(tier, e.kind, e.key, e.size, e.reason) for e in events)
