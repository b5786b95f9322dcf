"""ChunkStore with a real shared-memory L1 region and a disk L2 in tmp_path."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvatlas.core.checksum import checksum
from kvatlas.core.errors import InvalidInput
from kvatlas.core.keys import Namespace, ObjectKey
from kvatlas.core.server.l1pool import L1Pool, LeaseId, Refusal, Refused, Reserved
from kvatlas.core.types import ChunkHash, EventType, Tier
from kvatlas.runtime.region import L1Region
from kvatlas.server.engine_service import EngineService, ServiceIdentity
from kvatlas.server.p2p.store_access import PeerStoreAccess
from kvatlas.server.storage.chunkstore import ChunkStore, TierEvent, batches
from kvatlas.server.storage.guarded import GuardedStore
from kvatlas.server.storage.l2_disk import DiskL2Adapter, file_name
from kvatlas.wire.engine_proto import (
    AcquireRead,
    AcquireResult,
    EngineRegistered,
    Lookup,
    LookupResult,
    RegisterEngine,
)

A = 4096
CHUNK = 3 * A  # three pages per chunk
L1_CHUNKS = 4


def key(i: int) -> ObjectKey:
    return ObjectKey(i.to_bytes(32, "big"), "m", 16777472)


def chunk(i: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, CHUNK, dtype=np.uint8).tobytes()


@pytest.fixture
def region() -> Iterator[L1Region]:
    with L1Region.create(CHUNK * L1_CHUNKS, "test") as r:
        yield r


@pytest.fixture
def l2(tmp_path: Path) -> Iterator[DiskL2Adapter]:
    adapter = DiskL2Adapter(tmp_path / "l2", 1 << 20)
    yield adapter
    adapter.close()


@pytest.fixture
def store(region: L1Region, l2: DiskL2Adapter) -> ChunkStore:
    return ChunkStore(L1Pool(region.size, A), region, l2)


def read_l1(store: ChunkStore, k: ObjectKey) -> bytes:
    lease = store.acquire_read(k, "test", 0.0, 5.0)
    assert lease is not None
    try:
        view = store.read_view(lease)
        data = bytes(view)
        view.release()
        return data
    finally:
        store.release(lease.lease_id)


def test_engine_style_store_reserve_write_commit(store: ChunkStore) -> None:
    r = store.reserve(key(1), CHUNK, 0.0, 5.0, holder="engine")
    assert isinstance(r, Reserved)
    view = store.slot_view(r.slot)
    view[:] = chunk(1)
    view.release()
    info = store.commit(key(1), 0.1)  # checksum computed from the region
    assert info is not None and info.checksum == checksum(chunk(1))
    assert read_l1(store, key(1)) == chunk(1)
    assert store.take_events() == [TierEvent(Tier.L1, EventType.STORE, key(1), CHUNK, "stored")]
    assert store.reserve(key(1), CHUNK, 0.2, 5.0) == Refused(Refusal.EXISTS)


def test_eviction_demotes_and_lookup_promotes_identical_bytes(
    store: ChunkStore, l2: DiskL2Adapter
) -> None:
    for i in range(L1_CHUNKS):
        store.store(key(i), chunk(i), float(i))
    store.take_events()
    store.store(key(10), chunk(10), 10.0)  # evicts key(0), the least recently used
    assert not store.pool.contains(key(0))
    assert l2.contains(key(0))
    assert store.take_events() == [
        TierEvent(Tier.L2, EventType.STORE, key(0), CHUNK, "stored"),
        TierEvent(Tier.L1, EventType.DELETE, key(0), CHUNK, "evicted"),
        TierEvent(Tier.L1, EventType.STORE, key(10), CHUNK, "stored"),
    ]
    # key(0) from L2 (promotion evicts key(1) -> L2), then key(10) from L1, then a miss
    assert store.lookup_prefix([key(0), key(10), key(99), key(2)], 11.0) == 2
    assert store.pool.contains(key(0))
    assert read_l1(store, key(0)) == chunk(0)
    assert store.take_events() == [
        TierEvent(Tier.L2, EventType.STORE, key(1), CHUNK, "stored"),
        TierEvent(Tier.L1, EventType.DELETE, key(1), CHUNK, "evicted"),
        TierEvent(Tier.L1, EventType.STORE, key(0), CHUNK, "stored"),
    ]
    stats = store.stats()
    assert stats.promotions == 1 and stats.demotions == 2 and stats.l1.read_leases == 0
    assert stats.l2_used_bytes > 2 * CHUNK


def test_lookup_never_evicts_an_earlier_hit_of_the_same_lookup(store: ChunkStore) -> None:
    for i in range(L1_CHUNKS + 3):
        store.store(key(i), chunk(i), float(i))  # 0..2 went to L2
    # L1's 4 slots hold 3..6. Promoting 0..3 fills L1 with pinned hits; the 5th key then
    # finds no slot to evict, so it is a miss rather than evicting an earlier hit.
    assert store.lookup_prefix([key(i) for i in range(6)], 20.0) == 4
    for i in range(4):
        assert read_l1(store, key(i)) == chunk(i)
    assert store.stats().promotion_failures == 1


def test_promotion_of_corrupt_chunk_is_a_miss(store: ChunkStore, l2: DiskL2Adapter) -> None:
    for i in range(L1_CHUNKS + 1):
        store.store(key(i), chunk(i), float(i))
    assert l2.contains(key(0))
    path = l2.path / file_name(key(0))
    with open(path, "r+b") as f:
        f.seek(-100, os.SEEK_END)
        f.write(b"\x00" * 10 if chunk(0)[-100] != 0 else b"\x01" * 10)
    store.take_events()
    assert store.lookup_prefix([key(0), key(1)], 10.0) == 0
    assert not store.pool.contains(key(0))
    assert not l2.contains(key(0))
    events = store.take_events()
    assert TierEvent(Tier.L2, EventType.DELETE, key(0), CHUNK, "corrupt") in events
    assert all(not (e.tier is Tier.L1 and e.kind is EventType.STORE) for e in events)
    assert store.stats().promotion_failures == 1
    assert store.pool.stats().writing == 0  # the promotion slot was given back


def test_without_l2_evictions_are_just_deleted(region: L1Region) -> None:
    store = ChunkStore(L1Pool(region.size, A), region, None)
    for i in range(L1_CHUNKS + 1):
        store.store(key(i), chunk(i), float(i))
    assert store.lookup_prefix([key(0)], 9.0) == 0
    assert store.startup_l2_events() == []
    kinds = [(e.tier, e.kind) for e in store.take_events()]
    assert (Tier.L1, EventType.DELETE) in kinds and all(t is Tier.L1 for t, _ in kinds)


def test_with_tenant_shares_a_flood_demotes_and_promotes_over_its_own_chunks(
    region: L1Region, l2: DiskL2Adapter
) -> None:
    store = ChunkStore(L1Pool(region.size, A, tenant_min_share=0.5), region, l2)  # 2 each
    a = [ObjectKey(key(i).chunk_hash, "m", 16777472, 0, "a") for i in range(2)]
    b = [ObjectKey(key(i).chunk_hash, "m", 16777472, 0, "b") for i in range(6)]
    for t, k in enumerate([*a, *b]):
        store.store(k, chunk(t), float(t))
    assert all(store.pool.contains(k) for k in a)
    assert [l2.contains(k) for k in b] == [True] * 4 + [False] * 2
    # b's promotion of its oldest chunk makes room with b's own (b[4] goes to L2), not a's
    assert store.lookup_prefix(b[:1], 10.0) == 1
    assert read_l1(store, b[0]) == chunk(2)
    assert all(store.pool.contains(k) for k in a) and not store.pool.contains(b[4])
    rows = {u.cache_salt: u for u in store.stats().l1_by_salt}
    assert (rows["a"].bytes, rows["a"].chunks, rows["a"].evicted_by_others) == (2 * CHUNK, 2, 0)
    assert (rows["b"].chunks, rows["b"].evicted_by_own, rows["b"].evicted_by_others) == (2, 5, 0)


def test_startup_reports_l2_contents(tmp_path: Path, region: L1Region) -> None:
    first = DiskL2Adapter(tmp_path / "l2", 1 << 20)
    for i in range(3):
        first.put(key(i), chunk(i), checksum(chunk(i)))
    first.close()
    l2 = DiskL2Adapter(tmp_path / "l2", 1 << 20)
    store = ChunkStore(L1Pool(region.size, A), region, l2)
    events = store.startup_l2_events()
    assert {e.key for e in events} == {key(0), key(1), key(2)}
    assert all(e.tier is Tier.L2 and e.kind is EventType.STORE for e in events)
    assert store.lookup_prefix([key(2), key(0)], 0.0) == 2
    assert read_l1(store, key(2)) == chunk(2)


def test_expired_write_is_not_committed(store: ChunkStore) -> None:
    r = store.reserve(key(1), CHUNK, 0.0, 1.0)
    assert isinstance(r, Reserved)
    assert [e.key for e in store.expire(1.0)] == [key(1)]
    assert store.commit(key(1), 1.5) is None
    assert store.take_events() == []


def test_batches_group_consecutive_runs() -> None:
    events = [
        TierEvent(Tier.L2, EventType.STORE, key(1), 1, "stored"),
        TierEvent(Tier.L1, EventType.DELETE, key(1), 1, "evicted"),
        TierEvent(Tier.L1, EventType.DELETE, key(2), 2, "evicted"),
        TierEvent(Tier.L1, EventType.STORE, key(3), 3, "stored"),
    ]
    grouped = [(kind, tier, [e.key for e in entries]) for kind, tier, entries in batches(events)]
    assert grouped == [
        (EventType.STORE, Tier.L2, [key(1)]),
        (EventType.DELETE, Tier.L1, [key(1), key(2)]),
        (EventType.STORE, Tier.L1, [key(3)]),
    ]


def test_region_smaller_than_pool_is_refused(region: L1Region) -> None:
    with pytest.raises(InvalidInput, match="smaller"):
        ChunkStore(L1Pool(region.size * 2, A), region, None)


# ------------------------------------------------------------------ unhashed commits
# An LMCache worker's stores: readable at once, and no reader that hands a checksum on
# ever gets anything but the checksum of the bytes committed, whether the digest was
# settled, computed on the spot, or its slot evicted meanwhile.


def write_unhashed(store: ChunkStore, i: int, now: float = 0.0) -> tuple[LeaseId, int]:
    """Reserve, write and commit chunk ``i`` without its checksum: (write lease, offset)."""
    r = store.reserve(key(i), CHUNK, now, 5.0, holder="lmcache")
    assert isinstance(r, Reserved)
    with store.slot_view(r.slot) as view:
        view[:] = chunk(i)
    info = store.commit_unhashed(key(i), now, r.slot.lease_id)
    assert info is not None and info.committed
    return r.slot.lease_id, info.offset


def test_readable_at_once_and_a_checksum_reader_computes_it(store: ChunkStore) -> None:
    lid, offset = write_unhashed(store, 1)
    assert len(store.checksums) == 1
    local = store.acquire_read(key(1), "local", 0.0, 5.0, checksum=False)
    assert local is not None  # a local reader needs no checksum: nothing computed
    assert len(store.checksums) == 1
    peer = store.acquire_read(key(1), "peer:b", 0.0, 5.0)
    assert peer is not None and peer.checksum == checksum(chunk(1))
    assert len(store.checksums) == 0
    info = store.committed_info(key(1))
    assert info is not None and info.checksum == checksum(chunk(1))
    # the background digest that comes after is dropped, whatever it says
    assert not store.checksums.settle(key(1), lid, offset, 12345)
    assert store.committed_info(key(1)) == info


def test_a_settled_checksum_is_the_one_readers_get(store: ChunkStore) -> None:
    lid, offset = write_unhashed(store, 2)
    assert store.checksums.settle(key(2), lid, offset, checksum(chunk(2)))
    assert len(store.checksums) == 0
    # settled, so not hashed again: bytes changed in place since are not what it reports
    store.region.array[offset] ^= 0xFF
    lease = store.acquire_read(key(2), "peer:b", 0.0, 5.0)
    assert lease is not None and lease.checksum == checksum(chunk(2))


def test_a_digest_of_an_evicted_and_rewritten_slot_is_dropped(region: L1Region) -> None:
    store = ChunkStore(L1Pool(region.size, A), region)  # no L2: evictions just delete
    old_lid, offset = write_unhashed(store, 0)
    for i in range(1, L1_CHUNKS + 1):  # the last one evicts chunk 0 (LRU)
        write_unhashed(store, i)
    assert store.committed_info(key(0)) is None
    new_lid, _ = write_unhashed(store, 0)  # stored again, unhashed again
    assert not store.checksums.settle(key(0), old_lid, offset, 999)
    info = store.committed_info(key(0))
    assert info is not None and info.checksum == checksum(chunk(0))
    assert not store.checksums.settle(key(0), new_lid, info.offset, 999)


def test_a_commit_with_its_checksum_replaces_an_evicted_unhashed_one(region: L1Region) -> None:
    store = ChunkStore(L1Pool(region.size, A), region)
    lid, offset = write_unhashed(store, 0)
    for i in range(1, L1_CHUNKS + 1):
        write_unhashed(store, i)
    r = store.reserve(key(0), CHUNK, 1.0, 5.0, holder="engine")
    assert isinstance(r, Reserved)
    with store.slot_view(r.slot) as view:
        view[:] = chunk(0)
    assert store.commit(key(0), 1.0, checksum(chunk(0)), r.slot.lease_id) is not None
    assert not store.checksums.settle(key(0), lid, offset, 999)
    info = store.committed_info(key(0))
    assert info is not None and info.checksum == checksum(chunk(0))


def test_an_unhashed_chunk_demoted_to_l2_carries_its_real_checksum(
    store: ChunkStore, l2: DiskL2Adapter
) -> None:
    write_unhashed(store, 0)
    for i in range(1, L1_CHUNKS + 1):
        write_unhashed(store, i)
    assert store.committed_info(key(0)) is None  # evicted from L1 ...
    item = l2.item(key(0))
    assert item is not None and item.checksum == checksum(chunk(0))
    # ... and promoted back from L2, whose read verifies the checksum it was written with
    assert store.lookup_prefix([key(0)], 2.0) == 1
    lease = store.acquire_read(key(0), "peer:b", 2.0, 5.0)
    assert lease is not None and lease.checksum == checksum(chunk(0))
    with store.read_view(lease) as view:
        assert bytes(view) == chunk(0)


def test_a_peers_lock_hashes_pending_chunks_off_the_lock_within_its_budget(
    store: ChunkStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lock RPC's deadline is a round trip's: it hashes chunks whose checksum is still
    to come up to its budget, without the store lock, and a chunk past the budget ends
    the run (it stays pending, for the hash threads)."""
    guarded = GuardedStore(store, clock=lambda: 0.0)
    owner = PeerStoreAccess(guarded, lock_hash_bytes=CHUNK)  # one chunk's worth
    hashed: list[int] = []

    def off_the_lock(view: memoryview) -> int:
        assert not guarded.lock.locked(), "KV hashed under the store lock"
        hashed.append(view.nbytes)
        return checksum(view)

    monkeypatch.setattr("kvatlas.server.storage.guarded.checksum", off_the_lock)
    lid1, off1 = write_unhashed(store, 1)
    write_unhashed(store, 2)
    write_unhashed(store, 3)
    leases = owner.lock_for_peer("b", [key(1), key(2), key(3)], 5.0)
    assert [lease.checksum for lease in leases] == [checksum(chunk(1))]
    assert hashed == [CHUNK] and len(store.checksums) == 2  # chunk 2 was past the budget
    leases = owner.lock_for_peer("b", [key(1), key(2), key(3)], 5.0)
    assert [lease.checksum for lease in leases] == [checksum(chunk(1)), checksum(chunk(2))]
    assert len(store.checksums) == 1
    # with the default budget (64 MiB) the whole run is hashed
    leases = PeerStoreAccess(guarded).lock_for_peer("b", [key(1), key(2), key(3)], 5.0)
    assert [lease.checksum for lease in leases] == [checksum(chunk(i)) for i in (1, 2, 3)]
    assert len(store.checksums) == 0 and hashed == [CHUNK] * 3
    # a settled digest is the one kept: chunk 1's came from the lock RPC, not a reader
    assert not store.checksums.settle(key(1), lid1, off1, 999)


def test_an_engine_lookup_hashes_an_lmcache_commit_off_the_lock(
    store: ChunkStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kvatlas engine asking for chunks an LMCache worker committed moments ago gets
    their real checksums, hashed before its lookup takes the store lock."""
    guarded = GuardedStore(store, clock=lambda: 0.0)
    service = EngineService(guarded, ServiceIdentity("node", 1, 16, 30.0))
    reply = service.handle(RegisterEngine("e", "m", "float16", (1, 1, 8), 16))
    assert isinstance(reply, EngineRegistered), reply

    def off_the_lock(view: memoryview) -> int:
        assert not guarded.lock.locked(), "KV hashed under the store lock"
        return checksum(view)

    def never(view: memoryview) -> int:
        raise AssertionError("a checksum computed on the spot, under the store lock")

    monkeypatch.setattr("kvatlas.server.storage.guarded.checksum", off_the_lock)
    monkeypatch.setattr("kvatlas.server.storage.chunkstore.compute_checksum", never)
    for i in (1, 2):
        write_unhashed(store, i)
    ns = Namespace(key(1).model_name, key(1).kv_rank)
    hashes = [ChunkHash(key(i).chunk_hash) for i in (1, 2, 3)]
    for acquire in (False, True):
        answer = service.handle(Lookup(ns, hashes=hashes, acquire=acquire))
        assert isinstance(answer, LookupResult), answer
        assert [c.checksum for c in answer.chunks] == [checksum(chunk(1)), checksum(chunk(2))]
    write_unhashed(store, 3)
    got = service.handle(AcquireRead(ns, hashes))
    assert isinstance(got, AcquireResult), got
    assert [c.checksum if c else None for c in got.chunks] == [
        checksum(chunk(i)) for i in (1, 2, 3)
    ]


def test_unhashed_run_is_the_leading_committed_run_within_the_bound(store: ChunkStore) -> None:
    write_unhashed(store, 1)
    r = store.store(key(2), chunk(2), 0.0)  # committed with its checksum: skipped
    assert not isinstance(r, Refused)
    write_unhashed(store, 3)
    write_unhashed(store, 5)  # after a key that is not stored: not in the run
    keys = [key(1), key(2), key(3), key(4), key(5)]
    assert [u.key for u in store.checksums.run(keys)] == [key(1), key(3)]
    assert [u.key for u in store.checksums.run(keys, 2 * CHUNK)] == [key(1), key(3)]
    assert [u.key for u in store.checksums.run(keys, 2 * CHUNK - 1)] == [key(1)]
    assert store.checksums.run(keys, 0) == []
    run = store.checksums.run(keys)
    assert GuardedStore(store).settle(run) == 2
    assert len(store.checksums) == 1  # chunk 5's
    info = store.committed_info(key(3))
    assert info is not None and info.checksum == checksum(chunk(3))


def test_a_settled_chunk_is_not_hashed_again(
    store: ChunkStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hash job queued behind a reader that settled the chunk first (or a commit since
    evicted) skips the hashing: the store no longer wants that digest."""
    guarded = GuardedStore(store)
    write_unhashed(store, 1)
    write_unhashed(store, 2)
    jobs = store.checksums.run([key(1), key(2)])
    assert guarded.settle_unhashed([key(1)]) == 1  # a reader got there first
    hashed: list[int] = []

    def counted(view: memoryview) -> int:
        hashed.append(view.nbytes)
        return checksum(view)

    monkeypatch.setattr("kvatlas.server.storage.guarded.checksum", counted)
    assert guarded.settle(jobs) == 1
    assert hashed == [CHUNK]  # chunk 2's only
    assert guarded.settle(jobs) == 0 and hashed == [CHUNK]  # nothing left to want
