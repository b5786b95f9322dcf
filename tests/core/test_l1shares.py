"""Per-tenant L1 shares (``core.l1shares`` inside ``L1Pool``): examples of the victim
order, the per-salt books, and a hypothesis state machine checking that no salt is ever
evicted below its share by another salt's allocation and that the books match the slots."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvatlas.core.errors import InvalidInput
from kvatlas.core.keys import ObjectKey
from kvatlas.core.server.eviction import LRUPolicy
from kvatlas.core.server.l1pool import L1Pool, LeaseId, Refusal, Refused, Reserved
from kvatlas.core.server.l1shares import RETIRED_SALTS_KEPT, SaltShares, SaltUsage

A = 4096


def key(salt: str, i: int) -> ObjectKey:
    return ObjectKey(i.to_bytes(32, "big"), "m", 1, 0, salt)


def put(pool: L1Pool, k: ObjectKey, pages: int = 1) -> Reserved | Refused:
    r = pool.reserve(k, pages * A, 0.0, 10.0)
    if isinstance(r, Reserved):
        assert pool.commit(k, 1, 0.0) is not None
    return r


def fill(pool: L1Pool, salt: str, n: int, start: int = 0) -> list[ObjectKey]:
    keys = [key(salt, start + i) for i in range(n)]
    for k in keys:
        assert isinstance(put(pool, k), Reserved)
    return keys


def usage(pool: L1Pool) -> dict[str, SaltUsage]:
    return {u.cache_salt: u for u in pool.salt_usage()}


def evicted_salts(r: Reserved | Refused) -> list[str]:
    assert isinstance(r, Reserved)
    return [v.key.cache_salt for v in r.evicted]


# ------------------------------------------------------------------------------ examples


def test_the_share_is_the_fraction_or_the_equal_split_whichever_is_smaller() -> None:
    shares = SaltShares(100 * A, 0.25)
    assert shares.share_bytes("a") == 25 * A  # alone: the fraction
    for salt in "abcde":
        shares.reserved(salt, A)
    assert shares.share_bytes("a") == 20 * A  # 5 active: the equal split
    assert shares.share_bytes("new") == 100 * A // 6  # the one asking counts as active
    assert shares.current_share() == 20 * A
    assert SaltShares(100 * A, 1.0).share_bytes("a") == 100 * A
    assert not SaltShares(100 * A).enabled and SaltShares(100 * A).share_bytes("a") == 0
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(InvalidInput, match="tenant min share"):
            SaltShares(A, bad)


def test_off_one_flooding_salt_evicts_everyone_by_global_lru() -> None:
    pool = L1Pool(A * 16)
    a_keys = fill(pool, "a", 4)
    fill(pool, "b", 40)
    assert not any(pool.contains(k) for k in a_keys)
    u = usage(pool)
    assert (u["a"].bytes, u["a"].chunks, u["a"].evicted_by_others) == (0, 0, 4)
    assert (u["b"].bytes, u["b"].chunks) == (16 * A, 16)
    assert u["b"].evicted_by_own == 40 - 12 - 4 and u["b"].evicted_by_others == 0
    assert pool.stats().cross_salt_evictions == 4 and pool.stats().tenant_share_bytes == 0


def test_on_a_salt_within_its_share_keeps_its_chunks_against_a_flood() -> None:
    pool = L1Pool(A * 16, tenant_min_share=0.25)  # 4 pages each
    a_keys = fill(pool, "a", 4)
    fill(pool, "b", 200)
    assert all(pool.contains(k) for k in a_keys)
    u = usage(pool)
    assert (u["a"].bytes, u["a"].evicted_by_own, u["a"].evicted_by_others) == (4 * A, 0, 0)
    assert u["b"].bytes == 12 * A and u["b"].evicted_by_own == 200 - 12
    assert pool.stats().cross_salt_evictions == 0 and pool.stats().tenant_share_bytes == 4 * A


def test_a_salt_under_its_share_takes_back_what_another_holds_above_its_own() -> None:
    pool = L1Pool(A * 16, tenant_min_share=0.25)  # 4 pages each
    a_keys = fill(pool, "a", 14)  # free space is anyone's: a is 10 pages above its share
    fill(pool, "b", 40)  # 2 into free space, 2 taken from a, then b is at its share
    assert [pool.contains(k) for k in a_keys] == [False] * 2 + [True] * 12  # a's LRU went
    u = usage(pool)
    assert u["a"].bytes == 12 * A and u["a"].evicted_by_others == 2
    assert u["b"].bytes == 4 * A and u["b"].evicted_by_own == 40 - 4


def test_a_salt_over_its_share_evicts_its_own_lru_first() -> None:
    pool = L1Pool(A * 16, tenant_min_share=0.25)
    b_keys = fill(pool, "b", 10)  # b's are the globally least recently used
    a_keys = fill(pool, "a", 6)
    r = put(pool, key("a", 100))
    assert evicted_salts(r) == ["a"] and not pool.contains(a_keys[0])
    assert all(pool.contains(k) for k in b_keys)


def test_a_salt_under_its_share_takes_from_the_salt_most_above_it() -> None:
    pool = L1Pool(A * 15, tenant_min_share=0.5)  # 3 salts: min(7.5, 15 / 3) = 5 pages
    fill(pool, "c", 6)  # c: 1 above, least recently used
    fill(pool, "b", 7)  # b: 2 above
    fill(pool, "a", 2)
    assert evicted_salts(put(pool, key("a", 100))) == ["b"]
    # b and c now 1 page above each: a tie goes to the smaller salt string
    assert evicted_salts(put(pool, key("a", 101))) == ["b"]
    assert evicted_salts(put(pool, key("a", 102))) == ["c"]
    # everyone at its share: a (at 5 + 1 > 5) makes room with its own
    assert evicted_salts(put(pool, key("a", 103))) == ["a"]
    assert {s: u.bytes for s, u in usage(pool).items()} == {"a": 5 * A, "b": 5 * A, "c": 5 * A}


def test_a_salt_is_never_pushed_below_its_share_by_another() -> None:
    pool = L1Pool(A * 16, tenant_min_share=0.5)  # two salts: 8 pages each
    fill(pool, "a", 8)
    b_keys = fill(pool, "b", 8)
    leases = [pool.acquire_read(k, "reader", 0.0, 60.0) for k in b_keys]
    assert all(lease is not None for lease in leases)
    before = usage(pool)
    assert put(pool, key("b", 100)) == Refused(Refusal.NO_SPACE)  # its own are all leased
    assert usage(pool) == before and pool.stats().evictions == 0


def test_leased_chunks_of_the_salt_over_its_share_are_skipped() -> None:
    pool = L1Pool(A * 16, tenant_min_share=0.25)
    fill(pool, "a", 4)
    b_keys = fill(pool, "b", 12)
    assert pool.acquire_read(b_keys[0], "reader", 0.0, 60.0) is not None
    for k in b_keys[1:]:
        pool.touch(k)  # b_keys[0] is b's least recently used again, and leased
    r = put(pool, key("b", 100))
    assert isinstance(r, Reserved) and [v.key for v in r.evicted] == [b_keys[1]]
    assert pool.contains(b_keys[0])


def test_a_salt_under_its_share_falls_back_on_its_own_chunks() -> None:
    pool = L1Pool(A * 12, tenant_min_share=0.5)  # 3 salts: min(6, 12 / 3) = 4 pages
    b_keys = fill(pool, "b", 8)
    a_keys = fill(pool, "a", 2)
    fill(pool, "c", 2)
    assert all(pool.acquire_read(k, "r", 0.0, 60.0) is not None for k in b_keys)
    # a is under its share, b (4 above it) has all its chunks leased, c is under: a's own
    assert evicted_salts(put(pool, key("a", 100))) == ["a"]
    assert not pool.contains(a_keys[0]) and usage(pool)["b"].bytes == 8 * A


def test_books_count_writes_in_progress_and_retire_empty_salts() -> None:
    pool = L1Pool(A * 16, tenant_min_share=0.25)
    r = pool.reserve(key("a", 1), A + 1, 0.0, 10.0)
    assert isinstance(r, Reserved)
    assert usage(pool)["a"] == SaltUsage("a", 2 * A, 0, 0, 0)  # reserved, not committed
    pool.commit(key("a", 1), 1, 0.0)
    assert usage(pool)["a"] == SaltUsage("a", 2 * A, 1, 0, 0)
    pool.delete(key("a", 1))
    assert usage(pool)["a"] == SaltUsage("a", 0, 0, 0, 0)  # retired, kept with its counters
    assert pool.stats().tenant_share_bytes == 4 * A
    assert isinstance(pool.reserve(key("b", 1), A, 0.0, 1.0), Reserved)
    assert pool.expire(5.0)[0].write and usage(pool)["b"].bytes == 0


def test_retired_salts_are_bounded() -> None:
    shares = SaltShares(A * 4)
    for i in range(RETIRED_SALTS_KEPT + 10):
        shares.reserved(f"s{i}", A)
        shares.freed(f"s{i}", A, committed=False)
    rows = shares.usage()
    assert len(rows) == RETIRED_SALTS_KEPT and "s0" not in {u.cache_salt for u in rows}


class CountingLRU(LRUPolicy):
    """The real LRU, counting the keys eviction walks look at."""

    def __init__(self) -> None:
        super().__init__()
        self.walked = 0

    def _count(self, keys: Iterator[ObjectKey]) -> Iterator[ObjectKey]:
        for k in keys:
            self.walked += 1
            yield k

    def candidates(self) -> Iterator[ObjectKey]:
        return self._count(super().candidates())

    def salt_candidates(self, cache_salt: str) -> Iterator[ObjectKey]:
        return self._count(super().salt_candidates(cache_salt))


def test_a_flood_walks_its_own_lru_head_not_every_chunk() -> None:
    policy = CountingLRU()
    pool = L1Pool(A * 2048, tenant_min_share=0.01, policy=policy)  # 20 pages each
    for salt in "abcdefghij":
        fill(pool, salt, 20)
    fill(pool, "z", 3000, start=100)  # fills the rest, then evicts its own for ~1200 stores
    evictions = pool.stats().evictions
    assert evictions > 1000 and pool.stats().cross_salt_evictions == 0
    assert policy.walked <= 2 * evictions  # O(1) keys looked at per eviction


# ---------------------------------------------------------------------------- state model

SALTS = ["", "a", "b"]
KEYS = [key(s, i) for s in SALTS for i in range(5)]


class SharesMachine(RuleBasedStateMachine):
    """Stores, reads and deletes under shares; books against the slots, and the guarantee."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = L1Pool(A * 10, tenant_min_share=0.3)
        self.now = 0.0
        self.leases: list[LeaseId] = []

    @rule(k=st.sampled_from(KEYS), pages=st.integers(1, 3))
    def store(self, k: ObjectKey, pages: int) -> None:
        pool = self.pool
        held = {s: usage(pool)[s].bytes if s in usage(pool) else 0 for s in SALTS}
        share = pool._shares.share_bytes(k.cache_salt)  # white-box: the share it planned with
        r = put(pool, k, pages)
        if not isinstance(r, Reserved):
            return
        lost: dict[str, int] = {}
        for v in r.evicted:
            lost[v.key.cache_salt] = lost.get(v.key.cache_salt, 0) + v.reserved
        for salt, n in lost.items():
            if salt != k.cache_salt:
                assert held[salt] - n >= share, "another salt went below its share"

    @rule(k=st.sampled_from(KEYS))
    def read(self, k: ObjectKey) -> None:
        lease = self.pool.acquire_read(k, "r", self.now, 2.0)
        if lease is not None:
            self.leases.append(lease.lease_id)

    @rule()
    def release_all(self) -> None:
        for lease_id in self.leases:
            self.pool.release(lease_id)
        self.leases.clear()

    @rule(k=st.sampled_from(KEYS))
    def delete(self, k: ObjectKey) -> None:
        self.pool.delete(k)

    @rule()
    def advance(self) -> None:
        self.now += 1.0
        self.pool.expire(self.now)

    @invariant()
    def books_match_slots(self) -> None:
        pool = self.pool
        want: dict[str, tuple[int, int]] = {}
        for info in pool.slots():
            b, c = want.get(info.key.cache_salt, (0, 0))
            want[info.key.cache_salt] = (b + info.reserved, c + info.committed)
        got = {u.cache_salt: (u.bytes, u.chunks) for u in pool.salt_usage() if u.bytes}
        assert got == want
        s = pool.stats()
        assert sum(b for b, _ in want.values()) == s.used_bytes
        evicted = sum(u.evicted_by_own + u.evicted_by_others for u in pool.salt_usage())
        assert evicted == s.evictions
        assert s.cross_salt_evictions == sum(u.evicted_by_others for u in pool.salt_usage())


SharesMachine.TestCase.settings = settings(
    max_examples=120,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestSharesMachine = SharesMachine.TestCase
