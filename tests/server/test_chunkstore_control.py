"""The chunk store's cache-control operations (``warm``, ``delete``, ``clear_l1``) and
the pool's forced delete, on a real shared-memory L1 region and a disk L2, with the
events they record."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvatlas.core.keys import ObjectKey, rank_keys
from kvatlas.core.server.l1pool import DeleteOutcome, L1Pool, Reserved
from kvatlas.core.types import ChunkHash
from kvatlas.runtime.region import L1Region
from kvatlas.server.storage.chunkstore import ChunkStore
from kvatlas.server.storage.l2_disk import DiskL2Adapter

A = 4096
CHUNK = 2 * A
L1_CHUNKS = 4


def key(i: int) -> ObjectKey:
    return ObjectKey(i.to_bytes(32, "big"), "m", 16777472)


def chunk(i: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, CHUNK, dtype=np.uint8).tobytes()


@pytest.fixture
def store(tmp_path: Path) -> Iterator[ChunkStore]:
    with L1Region.create(CHUNK * L1_CHUNKS, "ctl") as region:
        l2 = DiskL2Adapter(tmp_path / "l2", 1 << 20)
        yield ChunkStore(L1Pool(region.size, A), region, l2)
        l2.close()


def events(store: ChunkStore) -> list[tuple[str, str, int]]:
    return [(e.kind.value, e.tier.value, int.from_bytes(e.key.chunk_hash)) for e in
            store.take_events()]  # fmt: skip


def test_warm_promotes_every_l2_chunk_not_only_a_prefix(store: ChunkStore) -> None:
    for i in range(6):  # 6 chunks through an L1 of 4: 0 and 1 are demoted to L2
        store.store(key(i), chunk(i), 0.0)
    events(store)
    assert not store.pool.contains(key(0)) and store.l2 is not None and store.l2.contains(key(0))
    # 0 in L2, 9 nowhere, 1 in L2: lookup_prefix stops at 9, warm does not.
    resident = store.warm([key(0), key(9), key(1)], 1.0)
    assert resident == [key(0), key(1)]
    assert store.pool.contains(key(0)) and store.pool.contains(key(1))
    stored = [e for e in events(store) if e[0] == "store"]
    assert ("store", "l1", 0) in stored and ("store", "l1", 1) in stored
    assert store.pool.stats().read_leases == 0  # the pins are released


def test_delete_per_tier_records_deletes(store: ChunkStore) -> None:
    for i in range(6):
        store.store(key(i), chunk(i), 0.0)
    store.warm([key(0)], 1.0)  # in both tiers now
    events(store)
    done = store.delete(key(0), l1=True, l2=False, force=False)
    assert (done.l1, done.l1_locked, done.l2) == (True, False, False)
    assert events(store) == [("delete", "l1", 0)]
    done = store.delete(key(0), l1=True, l2=True, force=False)
    assert (done.l1, done.l2) == (False, True)
    assert events(store) == [("delete", "l2", 0)]
    done = store.delete(key(0), l1=True, l2=True, force=True)
    assert (done.l1, done.l1_locked, done.l2) == (False, False, False)  # idempotent
    assert events(store) == []


def test_a_leased_chunk_is_kept_unless_forced(store: ChunkStore) -> None:
    store.store(key(1), chunk(1), 0.0)
    lease = store.acquire_read(key(1), "engine", 0.0, 60.0)
    assert lease is not None
    events(store)
    done = store.delete(key(1), l1=True, l2=True, force=False)
    assert (done.l1, done.l1_locked) == (False, True)
    assert store.pool.contains(key(1)) and events(store) == []
    done = store.delete(key(1), l1=True, l2=False, force=True)
    assert done.l1 and not store.pool.contains(key(1))
    assert events(store) == [("delete", "l1", 1)]
    assert store.release(lease.lease_id) is False  # the lease ended with the chunk
    assert store.expire(100.0) == []  # and its deadline left nothing behind
    assert store.pool.stats().used_bytes == 0


def test_forced_delete_of_a_write_in_progress_fails_its_commit() -> None:
    pool = L1Pool(4 * A, A)
    reserved = pool.reserve(key(2), A, 0.0, 30.0, holder="engine")
    assert isinstance(reserved, Reserved)
    assert pool.delete(key(2)) is DeleteOutcome.LOCKED
    assert pool.delete(key(2), force=True) is DeleteOutcome.DELETED
    assert pool.take_events() == []  # never stored: nothing to report
    assert pool.commit(key(2), 0, 1.0, reserved.slot.lease_id) is None
    assert pool.stats().write_leases == 0 and pool.stats().free_bytes == 4 * A


def test_clear_l1_keeps_leased_chunks_unless_forced(store: ChunkStore) -> None:
    for i in range(3):
        store.store(key(i), chunk(i), 0.0)
    assert store.acquire_read(key(0), "peer", 0.0, 60.0) is not None
    events(store)
    assert store.clear_l1(force=False) == 2
    assert [e for e in events(store) if e[1] == "l1"] == [("delete", "l1", 1), ("delete", "l1", 2)]
    assert store.clear_l1(force=True) == 1
    assert store.pool.stats().chunks == 0 and store.pool.stats().read_leases == 0


def test_rank_keys_fan_out_like_lmcache() -> None:
    h = [ChunkHash(bytes([i]) * 32) for i in range(2)]
    ks = rank_keys(h, "m", 2, "s")
    # chunk-major, one key per rank: kv_rank = ws<<24 | r<<16 | ws<<8 | r
    assert [(k.chunk_hash[0], k.kv_rank) for k in ks] == [
        (0, 0x02000200),
        (0, 0x02010201),
        (1, 0x02000200),
        (1, 0x02010201),
    ]
    assert all(k.cache_salt == "s" and k.object_group_id == 0 for k in ks)
    assert rank_keys(h, "m", 1)[0].kv_rank == 16777472
