"""The L1 pool: offsets, leases and eviction inside one contiguous region (pure).

Owns the bookkeeping of the server's shared-memory L1 tier: which byte ranges of the
region hold which chunk, which chunks are being written (write lease) or read (read
leases), and which chunks to evict when a new one needs room. It never touches the bytes
(the shell in ``kvatlas.server`` owns the region) and it must not do I/O, read a clock,
start threads or log: time is the parameter ``now`` (seconds, any monotonic origin).

Allocation. Every slot starts at a multiple of ``align_bytes`` and reserves its size
rounded up to ``align_bytes``. Free space is a set of coalesced extents, allocated
best-fit (a sorted list searched with bisect, dicts keyed by start and end for O(1)
coalescing).

Chunk lifecycle, keyed by ObjectKey::

    reserve ──> WRITING ──commit──> READY ──delete / evict──> gone
                   └──abort / write lease expired──> gone

``reserve`` returns an outcome, never None: ``Reserved(slot, evicted)`` or
``Refused(reason)`` with reason ``exists`` (already READY: nothing to store), ``busy``
(another writer holds the write lease) or ``no_space`` (even evicting every unlocked READY
chunk the allocation may take, all of them unless per-tenant shares protect some, would
not free a contiguous run; nothing is evicted then).

Eviction. When no free extent fits, the pool walks the eviction policy's candidates
(LRU first), skipping locked chunks (a live read or write lease), until the candidates
seen so far plus the free space around them form a contiguous run that fits; only the
candidates inside the chosen run are evicted. With per-tenant shares on
(``tenant_min_share`` > 0) the candidates come instead from ``core.l1shares``: the
allocating salt's own LRU chunks when it is over its share, then the chunks of salts
over their share (never taking one below it), walked through the policy's per-salt
orders; a salt at or below its share loses chunks only to its own allocations. The pool
keeps per-salt bytes, chunk counts and eviction counters either way (``salt_usage()``).
Evicted chunks come back in ``Reserved.evicted`` with their offset, size and checksum:
their bytes are still intact in the region until the caller writes the new slot, so the
caller (single-threaded under the shell's lock) copies them out to L2 first.

Events (HOUSE_STYLE habit 3). The pool records STORE (commit) and DELETE (evicted,
deleted) events in a list drained by ``take_events()``; it delivers nothing itself. An
expired or aborted write was never stored, so it records no event; ``expire()`` returns
what it expired.

Leases expire when ``now >= deadline``. Nothing expires implicitly: the shell calls
``expire(now)`` on a timer (and may call it before ``reserve``).
"""

from __future__ import annotations

import enum
import heapq
from bisect import bisect_left, insort
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import NewType

from kvatlas.core.errors import InvalidInput
from kvatlas.core.keys import ObjectKey
from kvatlas.core.server.eviction import EvictionPolicy, make_policy
from kvatlas.core.server.l1shares import SaltShares, SaltUsage
from kvatlas.core.types import EventType

LeaseId = NewType("LeaseId", int)
"""Identity of one read or write lease, unique within a pool."""

MIN_ALIGN_BYTES = 4096
HELD = "previous process"
"""Holder of the writes ``restore`` holds: nobody may commit them."""


# ----------------------------------------------------------------------------- outcomes


@dataclass(frozen=True, slots=True)
class SlotInfo:
    """Where a chunk lives in the region. ``reserved`` is ``size`` rounded up to the alignment."""

    key: ObjectKey
    offset: int
    size: int
    reserved: int
    checksum: int
    committed: bool


@dataclass(frozen=True, slots=True)
class Slot:
    """A write-locked slot handed to the writer of ``key``: fill ``[offset, offset+size)``."""

    key: ObjectKey
    offset: int
    size: int
    lease_id: LeaseId
    deadline: float


class Refusal(enum.StrEnum):
    """Why ``reserve`` did not hand out a slot."""

    EXISTS = "exists"
    """The key is already stored and readable; there is nothing to write."""
    BUSY = "busy"
    """Another writer holds the key's write lease."""
    NO_SPACE = "no_space"
    """No contiguous run fits, even after evicting every unlocked chunk the allocation
    may take (per-tenant shares protect other salts' chunks within their share)."""


@dataclass(frozen=True, slots=True)
class Reserved:
    """A slot was reserved; ``evicted`` lists the chunks evicted to make room (copy them out
    before writing the slot)."""

    slot: Slot
    evicted: tuple[SlotInfo, ...] = ()


@dataclass(frozen=True, slots=True)
class Refused:
    """No slot; nothing changed in the pool."""

    reason: Refusal


@dataclass(frozen=True, slots=True)
class ReadLease:
    """A read lock on a READY chunk until ``deadline`` (or ``release``)."""

    lease_id: LeaseId
    key: ObjectKey
    holder: str
    offset: int
    size: int
    checksum: int
    deadline: float


@dataclass(frozen=True, slots=True)
class ExpiredLease:
    """A lease ``expire`` ended. For a write lease the slot was freed (the store failed)."""

    lease_id: LeaseId
    key: ObjectKey
    holder: str
    write: bool


class DeleteOutcome(enum.StrEnum):
    """Result of ``delete``."""

    DELETED = "deleted"
    ABSENT = "absent"
    LOCKED = "locked"
    """The chunk has live leases (or is being written); nothing changed."""


@dataclass(frozen=True, slots=True)
class PoolEvent:
    """A STORE or DELETE the pool recorded; ``reason`` is stored / evicted / deleted."""

    kind: EventType
    key: ObjectKey
    size: int
    reason: str


@dataclass(frozen=True, slots=True)
class PoolStats:
    """A snapshot for metrics and ``/status``."""

    capacity_bytes: int
    used_bytes: int
    free_bytes: int
    chunks: int
    writing: int
    read_leases: int
    write_leases: int
    evictions: int
    free_extents: int
    largest_free_bytes: int
    cross_salt_evictions: int = 0
    """Of ``evictions``, those whose victim's cache_salt was not the allocation's."""
    tenant_share_bytes: int = 0
    """What each active salt is guaranteed now (``core.l1shares``); 0: shares are off."""


# ---------------------------------------------------------------------------------- pool


@dataclass(slots=True)
class _Chunk:
    key: ObjectKey
    offset: int
    size: int
    reserved: int
    checksum: int = 0
    committed: bool = False
    write_lease: LeaseId | None = None
    write_holder: str = ""
    readers: set[LeaseId] = field(default_factory=set)

    @property
    def locked(self) -> bool:
        return self.write_lease is not None or bool(self.readers)

    def info(self) -> SlotInfo:
        return SlotInfo(
            self.key, self.offset, self.size, self.reserved, self.checksum, self.committed
        )


class L1Pool:
    """Allocator, leases and eviction for one region of ``capacity_bytes``.

    ``capacity_bytes`` is rounded down to a multiple of ``align_bytes``; ``stats()``
    reports the usable capacity. Single-threaded: the shell holds a lock around calls.
    """

    def __init__(
        self,
        capacity_bytes: int,
        align_bytes: int = MIN_ALIGN_BYTES,
        policy: str | EvictionPolicy = "LRU",
        lease_ids: Callable[[], int] | None = None,
        tenant_min_share: float = 0.0,
    ) -> None:
        """``lease_ids``: where new lease ids come from (values in [1, 2**63-1]; one in
        use is drawn again). None: 1, 2, 3, ... (deterministic, for tests). A server
        passes a random source, so that a lease id cannot be guessed by a client that
        did not get it (`release` trusts whoever names the id).

        ``tenant_min_share``: the fraction of the capacity each active ``cache_salt`` is
        guaranteed against other salts' allocations, cut down to the equal split
        (``core.l1shares``); 0 (the default): one global eviction order."""
        if align_bytes < MIN_ALIGN_BYTES or align_bytes & (align_bytes - 1):
            raise InvalidInput(
                f"L1 alignment must be a power of two >= {MIN_ALIGN_BYTES} bytes, got {align_bytes}"
            )
        usable = capacity_bytes - capacity_bytes % align_bytes
        if usable <= 0:
            raise InvalidInput(
                f"L1 capacity must hold at least one aligned slot of {align_bytes} bytes,"
                f" got {capacity_bytes}"
            )
        self.align_bytes = align_bytes
        self.capacity_bytes = usable
        self._policy = make_policy(policy) if isinstance(policy, str) else policy
        self._shares = SaltShares(usable, tenant_min_share)
        self._chunks: dict[ObjectKey, _Chunk] = {}
        self._free_by_start: dict[int, int] = {}
        self._free_by_end: dict[int, int] = {}
        self._free_sorted: list[tuple[int, int]] = []  # (length, start), best-fit order
        self._free_bytes = 0
        self._insert_free(0, usable)
        self._read_leases: dict[LeaseId, ReadLease] = {}
        self._write_leases: dict[LeaseId, tuple[ObjectKey, float]] = {}
        self._deadlines: list[tuple[float, LeaseId]] = []  # heap, lazily cleaned
        self._next_lease = 1
        self._lease_source = lease_ids
        self._events: list[PoolEvent] = []
        self._evictions = 0

    # --------------------------------------------------------------------- queries

    @property
    def policy_name(self) -> str:
        return self._policy.name

    def reserved_size(self, size: int) -> int:
        """``size`` rounded up to the alignment: what a slot of ``size`` bytes occupies."""
        return -(-size // self.align_bytes) * self.align_bytes

    def __len__(self) -> int:
        """Slots held, committed or being written."""
        return len(self._chunks)

    def contains(self, key: ObjectKey) -> bool:
        """True when ``key`` is committed (readable). A chunk being written is not."""
        chunk = self._chunks.get(key)
        return chunk is not None and chunk.committed

    def get(self, key: ObjectKey) -> SlotInfo | None:
        """Where ``key`` lives, committed or being written (see ``SlotInfo.committed``)."""
        chunk = self._chunks.get(key)
        return None if chunk is None else chunk.info()

    def slots(self) -> list[SlotInfo]:
        """Every slot, committed or being written, by offset."""
        return sorted((c.info() for c in self._chunks.values()), key=lambda s: s.offset)

    def free_extents(self) -> list[tuple[int, int]]:
        """Free ``(start, length)`` extents by start (coalesced: never adjacent)."""
        return sorted(self._free_by_start.items())

    def read_leases(self) -> list[ReadLease]:
        return list(self._read_leases.values())

    def read_lease(self, lease_id: LeaseId) -> ReadLease | None:
        """The live (not yet released or swept) read lease ``lease_id``, if any; the
        caller compares its deadline with its own clock."""
        return self._read_leases.get(lease_id)

    def stats(self) -> PoolStats:
        writing = sum(1 for c in self._chunks.values() if not c.committed)
        return PoolStats(
            capacity_bytes=self.capacity_bytes,
            used_bytes=self.capacity_bytes - self._free_bytes,
            free_bytes=self._free_bytes,
            chunks=len(self._chunks) - writing,
            writing=writing,
            read_leases=len(self._read_leases),
            write_leases=len(self._write_leases),
            evictions=self._evictions,
            free_extents=len(self._free_sorted),
            largest_free_bytes=self._free_sorted[-1][0] if self._free_sorted else 0,
            cross_salt_evictions=self._shares.cross_salt_evictions,
            tenant_share_bytes=self._shares.current_share(),
        )

    def salt_usage(self) -> list[SaltUsage]:
        """Per ``cache_salt``: bytes and chunks held, evictions by its own allocations and
        by others' (salts emptied lately included, with zero bytes), by salt."""
        return self._shares.usage()

    def take_events(self) -> list[PoolEvent]:
        """The events recorded since the last call, oldest first."""
        events, self._events = self._events, []
        return events

    # ------------------------------------------------------------------- lifecycle

    def reserve(
        self, key: ObjectKey, size: int, now: float, lease_s: float, holder: str = ""
    ) -> Reserved | Refused:
        """Write-lock a slot of ``size`` bytes for ``key`` until ``now + lease_s``."""
        if size <= 0:
            raise InvalidInput(f"chunk size must be positive, got {size}")
        _check_lease(lease_s)
        existing = self._chunks.get(key)
        if existing is not None:
            return Refused(Refusal.EXISTS if existing.committed else Refusal.BUSY)
        need = self.reserved_size(size)
        if need > self.capacity_bytes:
            return Refused(Refusal.NO_SPACE)
        evicted: tuple[SlotInfo, ...] = ()
        offset = self._alloc(need)
        if offset is None:
            victims = self._plan_eviction(need, key.cache_salt)
            if victims is None:
                return Refused(Refusal.NO_SPACE)
            for victim in victims:
                self._shares.evicted(victim.key.cache_salt, key.cache_salt)
                self._drop(victim)
                self._evictions += 1
                self._events.append(PoolEvent(EventType.DELETE, victim.key, victim.size, "evicted"))
            evicted = tuple(v.info() for v in victims)
            offset = self._alloc(need)
            if offset is None:  # pragma: no cover - the plan guarantees a fitting run
                raise AssertionError("eviction plan did not free a fitting run")
        lease_id = self._new_lease_id()
        deadline = now + lease_s
        chunk = _Chunk(key, offset, size, need, write_lease=lease_id, write_holder=holder)
        self._chunks[key] = chunk
        self._shares.reserved(key.cache_salt, need)
        self._write_leases[lease_id] = (key, deadline)
        heapq.heappush(self._deadlines, (deadline, lease_id))
        return Reserved(Slot(key, offset, size, lease_id, deadline), evicted)

    def commit(
        self, key: ObjectKey, checksum: int, now: float, lease_id: LeaseId | None = None
    ) -> SlotInfo | None:
        """Make a written chunk readable (records STORE).

        None when there is no write in progress for ``key`` (never reserved, aborted,
        already committed, or ``lease_id`` names an older write), or when its write lease
        has passed its deadline (the slot is then freed: the store failed).
        """
        chunk = self._chunks.get(key)
        if chunk is None or chunk.write_lease is None:
            return None
        if lease_id != chunk.write_lease and (lease_id is not None or chunk.write_holder == HELD):
            return None
        _, deadline = self._write_leases.pop(chunk.write_lease)
        chunk.write_lease = None
        self._maybe_compact_deadlines()
        if now >= deadline:
            self._drop(chunk)
            return None
        chunk.checksum = checksum
        chunk.committed = True
        self._shares.committed(key.cache_salt)
        self._policy.add(key)
        self._events.append(PoolEvent(EventType.STORE, key, chunk.size, "stored"))
        return chunk.info()

    def set_checksum(self, key: ObjectKey, checksum: int) -> bool:
        """Record the checksum of a committed chunk committed before it was known (see
        ``ChunkStore.commit_unhashed``); False when ``key`` is not committed."""
        chunk = self._chunks.get(key)
        if chunk is None or not chunk.committed:
            return False
        chunk.checksum = checksum
        return True

    def abort(self, key: ObjectKey) -> bool:
        """Give up a write in progress and free its slot; False when none was in progress."""
        chunk = self._chunks.get(key)
        if chunk is None or chunk.write_lease is None:
            return False
        del self._write_leases[chunk.write_lease]
        chunk.write_lease = None
        self._drop(chunk)
        return True

    def acquire_read(
        self, key: ObjectKey, holder: str, now: float, lease_s: float
    ) -> ReadLease | None:
        """Read-lock a committed chunk until ``now + lease_s`` (counts as an access)."""
        _check_lease(lease_s)
        chunk = self._chunks.get(key)
        if chunk is None or not chunk.committed:
            return None
        lease_id = self._new_lease_id()
        lease = ReadLease(
            lease_id, key, holder, chunk.offset, chunk.size, chunk.checksum, now + lease_s
        )
        chunk.readers.add(lease_id)
        self._read_leases[lease_id] = lease
        heapq.heappush(self._deadlines, (lease.deadline, lease_id))
        self._policy.touch(key)
        return lease

    def release(self, lease_id: LeaseId, holder: str | None = None) -> bool:
        """End a read lease; False when it is unknown (released or expired already) or,
        given ``holder``, held by another holder (then it stays)."""
        lease = self._read_leases.get(lease_id)
        if lease is None or (holder is not None and lease.holder != holder):
            return False
        del self._read_leases[lease_id]
        self._chunks[lease.key].readers.discard(lease_id)
        self._maybe_compact_deadlines()
        return True

    def expire(self, now: float) -> list[ExpiredLease]:
        """End every lease whose deadline is ``<= now``; expired writes free their slot."""
        expired: list[ExpiredLease] = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, lease_id = heapq.heappop(self._deadlines)
            lease = self._read_leases.pop(lease_id, None)
            if lease is not None:
                self._chunks[lease.key].readers.discard(lease_id)
                expired.append(ExpiredLease(lease_id, lease.key, lease.holder, write=False))
                continue
            write = self._write_leases.pop(lease_id, None)
            if write is not None:
                chunk = self._chunks[write[0]]
                chunk.write_lease = None
                self._drop(chunk)
                expired.append(ExpiredLease(lease_id, chunk.key, chunk.write_holder, write=True))
        return expired

    def touch(self, key: ObjectKey) -> bool:
        """Mark a committed chunk as just used; False when absent."""
        if not self.contains(key):
            return False
        self._policy.touch(key)
        return True

    def delete(self, key: ObjectKey, force: bool = False) -> DeleteOutcome:
        """Remove a committed, unlocked chunk (records DELETE). ``force`` removes a locked
        one too, ending its leases: a reader's bytes may then be overwritten under it
        (peers verify checksums; an engine mid-copy may read garbage, which is what an
        operator's forced delete accepts); a write in progress is dropped unrecorded (it
        was never stored) and its commit then fails."""
        chunk = self._chunks.get(key)
        if chunk is None:
            return DeleteOutcome.ABSENT
        if chunk.locked or not chunk.committed:
            if not force:
                return DeleteOutcome.LOCKED
            for lease_id in chunk.readers:
                self._read_leases.pop(lease_id, None)
            chunk.readers.clear()
            if chunk.write_lease is not None:
                self._write_leases.pop(chunk.write_lease, None)
                chunk.write_lease = None
            if not chunk.committed:
                self._drop(chunk)
                return DeleteOutcome.DELETED
        self._drop(chunk)
        self._events.append(PoolEvent(EventType.DELETE, key, chunk.size, "deleted"))
        return DeleteOutcome.DELETED

    def restore(self, slots: Sequence[SlotInfo], now: float, hold_s: float) -> None:
        """Fill an empty pool with what a warm restart found in the region, by offset:
        committed slots come back READY (records STORE, reason ``restored``, oldest first
        in the eviction order); uncommitted ones are held under a write lease of
        ``hold_s`` nobody can commit, so that a writer of the previous process cannot
        overwrite a new chunk there. InvalidInput (pool unchanged) when the pool is not
        empty or a slot is misaligned, outside the pool or overlaps another."""
        _check_lease(hold_s)
        end = 0
        for s in slots:
            if s.offset < end or s.offset % self.align_bytes or s.size <= 0:
                raise InvalidInput(f"restored L1 slot at {s.offset} is misplaced")
            end = s.offset + self.reserved_size(s.size)
        if self._chunks or end > self.capacity_bytes or len({s.key for s in slots}) < len(slots):
            raise InvalidInput("restore needs an empty pool that holds every slot, once")
        self._free_by_start.clear()
        self._free_by_end.clear()
        self._free_sorted.clear()
        self._free_bytes, start = 0, 0
        for s in slots:
            if s.offset > start:
                self._insert_free(start, s.offset - start)
            need = self.reserved_size(s.size)
            start = s.offset + need
            chunk = _Chunk(s.key, s.offset, s.size, need, s.checksum, committed=s.committed)
            self._chunks[s.key] = chunk
            self._shares.reserved(s.key.cache_salt, need)
            if s.committed:
                self._shares.committed(s.key.cache_salt)
                self._policy.add(s.key)
                self._events.append(PoolEvent(EventType.STORE, s.key, s.size, "restored"))
                continue
            chunk.write_lease, chunk.write_holder = self._new_lease_id(), HELD
            self._write_leases[chunk.write_lease] = (s.key, now + hold_s)
            heapq.heappush(self._deadlines, (now + hold_s, chunk.write_lease))
        if start < self.capacity_bytes:
            self._insert_free(start, self.capacity_bytes - start)

    # -------------------------------------------------------------------- internals

    def _new_lease_id(self) -> LeaseId:
        source = self._lease_source
        if source is None:
            lease_id = LeaseId(self._next_lease)
            self._next_lease += 1
            return lease_id
        while True:
            lease_id = LeaseId(source())
            taken = lease_id in self._read_leases or lease_id in self._write_leases
            if lease_id > 0 and not taken:
                return lease_id

    def _maybe_compact_deadlines(self) -> None:
        # Released leases leave their deadline in the heap until it passes; short-lived
        # pins (lookups) would pile up, so rebuild once stale entries dominate.
        live = len(self._read_leases) + len(self._write_leases)
        if len(self._deadlines) > 2 * live + 1024:
            self._deadlines = [(d, i) for d, i in self._deadlines if self._is_live(i)]
            heapq.heapify(self._deadlines)

    def _is_live(self, lease_id: LeaseId) -> bool:
        return lease_id in self._read_leases or lease_id in self._write_leases

    def _drop(self, chunk: _Chunk) -> None:
        del self._chunks[chunk.key]
        self._policy.remove(chunk.key)
        self._shares.freed(chunk.key.cache_salt, chunk.reserved, chunk.committed)
        self._release_extent(chunk.offset, chunk.reserved)

    def _unlocked(self, cache_salt: str) -> Iterator[tuple[ObjectKey, int]]:
        """``cache_salt``'s unlocked chunks in policy order, with their reserved bytes."""
        for key in self._policy.salt_candidates(cache_salt):
            chunk = self._chunks[key]
            if not chunk.locked:
                yield key, chunk.reserved

    def _candidates(self, need: int, cache_salt: str) -> Iterator[_Chunk]:
        """Unlocked chunks in the order an allocation of ``cache_salt``'s may evict them."""
        if self._shares.enabled:
            for key in self._shares.victims(cache_salt, need, self._unlocked):
                yield self._chunks[key]
            return
        for key in self._policy.candidates():
            chunk = self._chunks[key]
            if not chunk.locked:
                yield chunk

    def _plan_eviction(self, need: int, cache_salt: str) -> list[_Chunk] | None:
        """The unlocked chunks to evict, in candidate order, so that a run of ``need`` fits."""
        by_start: dict[int, _Chunk] = {}
        by_end: dict[int, _Chunk] = {}
        for chunk in self._candidates(need, cache_salt):
            by_start[chunk.offset] = chunk
            by_end[chunk.offset + chunk.reserved] = chunk
            start = chunk.offset
            while True:  # walk left over free extents and tentatively freed chunks
                if start in self._free_by_end:
                    start = self._free_by_end[start]
                elif start in by_end:
                    start = by_end[start].offset
                else:
                    break
            end = chunk.offset + chunk.reserved
            while end - start < need:  # walk right only as far as needed
                if end in self._free_by_start:
                    end += self._free_by_start[end]
                elif end in by_start:
                    end += by_start[end].reserved
                else:
                    break
            if end - start >= need:
                stop = start + need
                return [
                    c
                    for c in by_start.values()
                    if c.offset < stop and c.offset + c.reserved > start
                ]
        return None

    def _alloc(self, need: int) -> int | None:
        i = bisect_left(self._free_sorted, (need, -1))
        if i == len(self._free_sorted):
            return None
        length, start = self._free_sorted[i]
        self._remove_free(start, length)
        if length > need:
            self._insert_free(start + need, length - need)
        return start

    def _release_extent(self, start: int, length: int) -> None:
        left = self._free_by_end.get(start)
        if left is not None:
            left_len = start - left
            self._remove_free(left, left_len)
            start, length = left, length + left_len
        right_len = self._free_by_start.get(start + length)
        if right_len is not None:
            self._remove_free(start + length, right_len)
            length += right_len
        self._insert_free(start, length)

    def _insert_free(self, start: int, length: int) -> None:
        self._free_by_start[start] = length
        self._free_by_end[start + length] = start
        insort(self._free_sorted, (length, start))
        self._free_bytes += length

    def _remove_free(self, start: int, length: int) -> None:
        del self._free_by_start[start]
        del self._free_by_end[start + length]
        i = bisect_left(self._free_sorted, (length, start))
        del self._free_sorted[i]
        self._free_bytes -= length


def _check_lease(lease_s: float) -> None:
    if not lease_s > 0:
        raise InvalidInput(f"lease duration must be positive seconds, got {lease_s}")
