"""L1Pool: example tests plus a hypothesis state machine against a simple model."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
)

from kvatlas.core.errors import InvalidInput
from kvatlas.core.keys import ObjectKey
from kvatlas.core.server.eviction import LRUPolicy, make_policy
from kvatlas.core.server.l1pool import (
    DeleteOutcome,
    L1Pool,
    LeaseId,
    PoolEvent,
    Refusal,
    Refused,
    Reserved,
)
from kvatlas.core.types import EventType

A = 4096


def key(i: int) -> ObjectKey:
    return ObjectKey(i.to_bytes(32, "big"), "m", 1)


def store(pool: L1Pool, k: ObjectKey, size: int, now: float = 0.0) -> Reserved:
    r = pool.reserve(k, size, now, 10.0)
    assert isinstance(r, Reserved)
    assert pool.commit(k, 123, now) is not None
    return r


# ------------------------------------------------------------------------------ examples


def test_alignment_must_be_power_of_two_at_least_4096() -> None:
    for bad in (0, 1024, 4095, 6144, 12288):
        with pytest.raises(InvalidInput, match="power of two"):
            L1Pool(1 << 20, bad)
    with pytest.raises(InvalidInput, match="at least one aligned slot"):
        L1Pool(4000)
    assert L1Pool(65536 * 3 + 5, 65536).capacity_bytes == 65536 * 3


def test_unknown_policy_names_the_accepted_ones() -> None:
    with pytest.raises(InvalidInput, match="accepted: LRU"):
        make_policy("ARC")
    assert isinstance(make_policy("lru"), LRUPolicy)
    assert L1Pool(A * 4, policy="LRU").policy_name == "LRU"


def test_slots_are_aligned_and_rounded_up() -> None:
    pool = L1Pool(A * 8)
    r1 = store(pool, key(1), 1)
    r2 = store(pool, key(2), A + 1)
    assert r1.slot.offset % A == 0 and r2.slot.offset % A == 0
    info = pool.get(key(2))
    assert info is not None and info.size == A + 1 and info.reserved == 2 * A
    assert pool.stats().used_bytes == 3 * A


def test_reserve_outcomes_for_existing_and_busy_keys() -> None:
    pool = L1Pool(A * 4)
    assert isinstance(pool.reserve(key(1), A, 0, 5), Reserved)
    assert pool.reserve(key(1), A, 0, 5) == Refused(Refusal.BUSY)
    assert not pool.contains(key(1))
    pool.commit(key(1), 7, 1)
    assert pool.reserve(key(1), A, 0, 5) == Refused(Refusal.EXISTS)
    assert pool.reserve(key(2), A * 5, 0, 5) == Refused(Refusal.NO_SPACE)
    with pytest.raises(InvalidInput):
        pool.reserve(key(3), 0, 0, 5)
    with pytest.raises(InvalidInput):
        pool.reserve(key(3), 1, 0, 0)


def test_lru_eviction_reports_victims_and_events() -> None:
    pool = L1Pool(A * 3)
    for i in range(3):
        store(pool, key(i), A)
    pool.touch(key(0))  # 1 is now the least recently used
    assert [e.kind for e in pool.take_events()] == [EventType.STORE] * 3
    r = pool.reserve(key(9), A, 0, 5)
    assert isinstance(r, Reserved)
    assert [v.key for v in r.evicted] == [key(1)]
    assert r.evicted[0].checksum == 123 and r.slot.offset == r.evicted[0].offset
    assert pool.take_events() == [PoolEvent(EventType.DELETE, key(1), A, "evicted")]
    assert pool.stats().evictions == 1


def test_read_and_write_locked_chunks_are_never_evicted() -> None:
    pool = L1Pool(A * 2)
    store(pool, key(0), A)
    assert isinstance(pool.reserve(key(1), A, 0, 5), Reserved)  # write-locked
    lease = pool.acquire_read(key(0), "peer", 0, 5)
    assert lease is not None
    assert pool.reserve(key(2), A, 0, 5) == Refused(Refusal.NO_SPACE)
    assert pool.contains(key(0))
    assert pool.release(lease.lease_id)
    assert not pool.release(lease.lease_id)
    r = pool.reserve(key(2), A, 0, 5)
    assert isinstance(r, Reserved) and [v.key for v in r.evicted] == [key(0)]


def test_failed_reservation_evicts_nothing() -> None:
    pool = L1Pool(A * 3)
    for i in range(3):
        store(pool, key(i), A)
    lease = pool.acquire_read(key(1), "engine", 0, 5)  # pins the middle page
    assert lease is not None
    assert pool.reserve(key(9), 2 * A, 0, 5) == Refused(Refusal.NO_SPACE)
    assert all(pool.contains(key(i)) for i in range(3))
    assert pool.stats().evictions == 0


def test_eviction_only_takes_victims_inside_the_chosen_run() -> None:
    pool = L1Pool(A * 4)
    for i in range(4):
        store(pool, key(i), A)
    # LRU order 0,1,2,3; pin 1 so that 0 alone cannot make a 2-page run
    lease = pool.acquire_read(key(1), "e", 0, 5)
    assert lease is not None
    for i in (0, 2, 3):
        pool.touch(key(i))  # order now 0, 2, 3 (1 pinned)
    r = pool.reserve(key(9), 2 * A, 0, 5)
    assert isinstance(r, Reserved)
    assert {v.key for v in r.evicted} == {key(2), key(3)}
    assert pool.contains(key(0))  # tried, but outside the run: kept


def test_expire_frees_writes_and_drops_reads() -> None:
    pool = L1Pool(A * 4)
    store(pool, key(0), A)
    w = pool.reserve(key(1), A, 0, 2, holder="engine")
    assert isinstance(w, Reserved)
    rl = pool.acquire_read(key(0), "peer", 0, 3)
    assert rl is not None
    assert pool.expire(1.9) == []
    expired = pool.expire(2.0)
    assert [(e.key, e.write, e.holder) for e in expired] == [(key(1), True, "engine")]
    assert pool.get(key(1)) is None
    assert pool.commit(key(1), 1, 2.5) is None  # too late
    assert [e.key for e in pool.expire(10)] == [key(0)]
    assert pool.stats().read_leases == 0 and pool.stats().used_bytes == A


def test_commit_after_deadline_fails_and_frees() -> None:
    pool = L1Pool(A * 4)
    r = pool.reserve(key(1), A, 0, 1)
    assert isinstance(r, Reserved)
    assert pool.commit(key(1), 5, 1.0) is None
    assert pool.stats().used_bytes == 0
    r2 = pool.reserve(key(1), A, 2, 1)
    assert isinstance(r2, Reserved)
    assert pool.commit(key(1), 5, 2.5, lease_id=r.slot.lease_id) is None  # stale writer
    assert pool.commit(key(1), 5, 2.5, lease_id=r2.slot.lease_id) is not None


def test_delete_and_abort() -> None:
    pool = L1Pool(A * 4)
    store(pool, key(0), A)
    pool.take_events()
    lease = pool.acquire_read(key(0), "e", 0, 5)
    assert lease is not None
    assert pool.delete(key(0)) is DeleteOutcome.LOCKED
    pool.release(lease.lease_id)
    assert pool.delete(key(0)) is DeleteOutcome.DELETED
    assert pool.delete(key(0)) is DeleteOutcome.ABSENT
    assert pool.take_events() == [PoolEvent(EventType.DELETE, key(0), A, "deleted")]
    pool.reserve(key(1), A, 0, 5)
    assert pool.delete(key(1)) is DeleteOutcome.LOCKED
    assert pool.abort(key(1)) and not pool.abort(key(1))
    assert pool.take_events() == []
    assert pool.stats().used_bytes == 0 and pool.free_extents() == [(0, 4 * A)]


def test_thousands_of_slots_stay_fast() -> None:
    pool = L1Pool(A * 2048)
    for i in range(6000):
        r = pool.reserve(key(i), A * (1 + i % 3), float(i), 10.0)
        assert isinstance(r, Reserved)
        pool.commit(key(i), i, float(i))
    s = pool.stats()
    assert s.used_bytes + s.free_bytes == s.capacity_bytes
    assert s.evictions > 0


def test_released_pins_do_not_pile_up_in_the_deadline_heap() -> None:
    pool = L1Pool(A * 4)
    store(pool, key(0), A)
    for _ in range(10_000):
        lease = pool.acquire_read(key(0), "lookup", 0.0, 60.0)
        assert lease is not None
        pool.release(lease.lease_id)
    assert len(pool._deadlines) <= 2048  # white-box: bounded, not 10_000
    assert pool.expire(100.0) == []


# ---------------------------------------------------------------------------- state model

CAPACITY_PAGES = 6
KEYS = [key(i) for i in range(8)]


class PoolMachine(RuleBasedStateMachine):
    """The pool against a dict model of keys, leases and time."""

    leases = Bundle("leases")

    def __init__(self) -> None:
        super().__init__()
        self.pool = L1Pool(A * CAPACITY_PAGES + 100)
        self.now = 0.0
        self.committed: dict[ObjectKey, int] = {}  # key -> size
        self.writing: dict[ObjectKey, tuple[int, float]] = {}  # key -> (size, deadline)
        self.reads: dict[LeaseId, tuple[ObjectKey, float]] = {}

    def locked(self, k: ObjectKey) -> bool:
        return k in self.writing or any(rk == k for rk, _ in self.reads.values())

    @rule(k=st.sampled_from(KEYS), size=st.integers(1, 2 * A + 1), checksum=st.integers(0, 9))
    def store(self, k: ObjectKey, size: int, checksum: int) -> None:
        """The common path: reserve then commit at once."""
        self.reserve(k, size, 5)
        self.commit(k, checksum)

    @rule(k=st.sampled_from(KEYS), size=st.integers(1, 3 * A + 1), lease=st.integers(1, 5))
    def reserve(self, k: ObjectKey, size: int, lease: int) -> None:
        before = set(self.committed)
        result = self.pool.reserve(k, size, self.now, lease)
        if k in self.committed:
            assert result == Refused(Refusal.EXISTS)
            return
        if k in self.writing:
            assert result == Refused(Refusal.BUSY)
            return
        need = self.pool.reserved_size(size)
        if isinstance(result, Refused):
            assert result.reason is Refusal.NO_SPACE
            assert set(self.committed) == before
            assert self.largest_run_if_all_evictable_freed() < need
            return
        for victim in result.evicted:
            assert victim.key in self.committed, "only committed chunks are evicted"
            assert not self.locked(victim.key), "locked chunks are never evicted"
            del self.committed[victim.key]
        self.writing[k] = (size, self.now + lease)
        assert result.slot.size == size

    def largest_run_if_all_evictable_freed(self) -> int:
        spans = [(s, s + n) for s, n in self.pool.free_extents()]
        spans += [
            (info.offset, info.offset + info.reserved)
            for info in self.pool.slots()
            if info.committed and not self.locked(info.key)
        ]
        best, cur_start, cur_end = 0, -1, -1
        for s, e in sorted(spans):
            if s == cur_end:
                cur_end = e
            else:
                cur_start, cur_end = s, e
            best = max(best, cur_end - cur_start)
        return best

    @precondition(lambda self: bool(self.writing))
    @rule(data=st.data(), checksum=st.integers(0, 2**64 - 1))
    def commit_a_write(self, data: st.DataObject, checksum: int) -> None:
        self.commit(data.draw(st.sampled_from(sorted(self.writing, key=KEYS.index))), checksum)

    @rule(k=st.sampled_from(KEYS), checksum=st.integers(0, 2**64 - 1))
    def commit(self, k: ObjectKey, checksum: int) -> None:
        info = self.pool.commit(k, checksum, self.now)
        if k not in self.writing:
            assert info is None
            return
        size, deadline = self.writing.pop(k)
        if self.now >= deadline:
            assert info is None
        else:
            assert info is not None and info.checksum == checksum and info.size == size
            self.committed[k] = size

    @rule(k=st.sampled_from(KEYS))
    def abort(self, k: ObjectKey) -> None:
        assert self.pool.abort(k) == (k in self.writing)
        self.writing.pop(k, None)

    @precondition(lambda self: bool(self.committed))
    @rule(target=leases, data=st.data(), lease=st.integers(1, 5))
    def acquire_stored(self, data: st.DataObject, lease: int) -> LeaseId:
        k = data.draw(st.sampled_from(sorted(self.committed, key=KEYS.index)))
        return self._acquire(k, lease)

    @rule(target=leases, k=st.sampled_from(KEYS), lease=st.integers(1, 5))
    def acquire(self, k: ObjectKey, lease: int) -> LeaseId:
        return self._acquire(k, lease)

    def _acquire(self, k: ObjectKey, lease: int) -> LeaseId:
        got = self.pool.acquire_read(k, "h", self.now, lease)
        if k not in self.committed:
            assert got is None
            return LeaseId(-1)
        assert got is not None and got.size == self.committed[k]
        self.reads[got.lease_id] = (k, self.now + lease)
        return got.lease_id

    @rule(lease_id=consumes(leases))
    def release(self, lease_id: LeaseId) -> None:
        assert self.pool.release(lease_id) == (lease_id in self.reads)
        self.reads.pop(lease_id, None)

    @rule(k=st.sampled_from(KEYS))
    def delete(self, k: ObjectKey) -> None:
        outcome = self.pool.delete(k)
        if k in self.committed and not self.locked(k):
            assert outcome is DeleteOutcome.DELETED
            del self.committed[k]
        elif k in self.committed or k in self.writing:
            assert outcome is DeleteOutcome.LOCKED
        else:
            assert outcome is DeleteOutcome.ABSENT

    @rule(k=st.sampled_from(KEYS))
    def touch(self, k: ObjectKey) -> None:
        assert self.pool.touch(k) == (k in self.committed)

    @rule(dt=st.sampled_from([0.0, 0.0, 0.5, 1.0, 3.5]))
    def advance_and_expire(self, dt: float) -> None:
        self.now += dt
        expired = self.pool.expire(self.now)
        want_reads = {lid for lid, (_, d) in self.reads.items() if d <= self.now}
        want_writes = {k for k, (_, d) in self.writing.items() if d <= self.now}
        assert {e.lease_id for e in expired if not e.write} == want_reads
        assert {e.key for e in expired if e.write} == want_writes
        for lid in want_reads:
            del self.reads[lid]
        for k in want_writes:
            del self.writing[k]
            assert self.pool.get(k) is None, "an expired write frees its slot"

    @invariant()
    def layout_is_consistent(self) -> None:
        pool = self.pool
        cap = pool.capacity_bytes
        pieces = [(s.offset, s.reserved, "slot") for s in pool.slots()]
        pieces += [(s, n, "free") for s, n in pool.free_extents()]
        pieces.sort()
        pos, prev_kind = 0, ""
        for start, length, kind in pieces:
            assert start == pos, "slots and free extents tile the region without overlap"
            assert start % A == 0 and length % A == 0 and length > 0
            assert not (kind == prev_kind == "free"), "free extents are coalesced"
            pos, prev_kind = start + length, kind
        assert pos == cap
        s = pool.stats()
        assert s.used_bytes + s.free_bytes == cap
        assert s.chunks == len(self.committed) and s.writing == len(self.writing)
        assert s.read_leases == len(self.reads) and s.write_leases == len(self.writing)
        for k in KEYS:
            assert pool.contains(k) == (k in self.committed)

    @invariant()
    def events_match_model(self) -> None:
        for event in self.pool.take_events():
            if event.kind is EventType.STORE:
                assert event.reason == "stored"
            else:
                assert event.reason in {"evicted", "deleted"}
                assert event.key not in self.committed


PoolMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestPoolMachine = PoolMachine.TestCase


def test_release_with_a_holder_ends_only_that_holders_lease() -> None:
    pool = L1Pool(A * 2)
    store(pool, key(0), A)
    lease = pool.acquire_read(key(0), "peer:b", 0, 5)
    assert lease is not None
    assert not pool.release(lease.lease_id, "engine")
    assert pool.read_lease(lease.lease_id) is not None
    assert pool.release(lease.lease_id, "peer:b")


def test_lease_ids_come_from_the_source_and_are_never_reused_while_live() -> None:
    draws = iter([0, 7, 7, 7, 9])  # 0 is no id; 7 is live when drawn again
    pool = L1Pool(A * 4, lease_ids=lambda: next(draws))
    store(pool, key(0), A)  # its write lease took 7 and ended at commit
    first = pool.acquire_read(key(0), "engine", 0, 5)
    second = pool.acquire_read(key(0), "engine", 0, 5)
    assert first is not None and second is not None
    assert (first.lease_id, second.lease_id) == (7, 9)
