"""ChunkStore's commits before the checksum (``commit_unhashed``, an LMCache worker's
stores): readable at once, and no reader that hands a checksum on ever gets anything but
the checksum of the bytes committed, whether the digest was settled, computed on the
spot, or its slot evicted meanwhile. Real shared-memory region, disk L2 in tmp_path."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvatlas.core.checksum import checksum
from kvatlas.core.keys import ObjectKey
from kvatlas.core.l1pool import L1Pool, LeaseId, Reserved
from kvatlas.runtime.region import L1Region
from kvatlas.server.p2p.store_access import PeerStoreAccess
from kvatlas.server.storage.chunkstore import ChunkStore
from kvatlas.server.storage.guarded import GuardedStore
from kvatlas.server.storage.l2_disk import DiskL2Adapter

A = 4096
CHUNK = 2 * A
L1_CHUNKS = 3


def key(i: int) -> ObjectKey:
    return ObjectKey(i.to_bytes(32, "big"), "m", 16777472)


def chunk(i: int) -> bytes:
    return np.random.default_rng(100 + i).integers(0, 256, CHUNK, dtype=np.uint8).tobytes()


@pytest.fixture
def region() -> Iterator[L1Region]:
    with L1Region.create(CHUNK * L1_CHUNKS, "unhashed") as r:
        yield r


@pytest.fixture
def l2(tmp_path: Path) -> Iterator[DiskL2Adapter]:
    adapter = DiskL2Adapter(tmp_path / "l2", 1 << 20)
    yield adapter
    adapter.close()


@pytest.fixture
def store(region: L1Region, l2: DiskL2Adapter) -> ChunkStore:
    return ChunkStore(L1Pool(region.size, A), region, l2)


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
    assert store.unhashed == 1
    local = store.acquire_read(key(1), "local", 0.0, 5.0, checksum=False)
    assert local is not None  # a local reader needs no checksum: nothing computed
    assert store.unhashed == 1
    peer = store.acquire_read(key(1), "peer:b", 0.0, 5.0)
    assert peer is not None and peer.checksum == checksum(chunk(1))
    assert store.unhashed == 0
    info = store.committed_info(key(1))
    assert info is not None and info.checksum == checksum(chunk(1))
    # the background digest that comes after is dropped, whatever it says
    assert not store.settle_checksum(key(1), lid, offset, 12345)
    assert store.committed_info(key(1)) == info


def test_a_settled_checksum_is_the_one_readers_get(store: ChunkStore) -> None:
    lid, offset = write_unhashed(store, 2)
    assert store.settle_checksum(key(2), lid, offset, checksum(chunk(2)))
    assert store.unhashed == 0
    # settled, so not hashed again: bytes changed in place since are not what it reports
    store.region.array[offset] ^= 0xFF
    lease = store.acquire_read(key(2), "peer:b", 0.0, 5.0)
    assert lease is not None and lease.checksum == checksum(chunk(2))


def test_a_digest_of_an_evicted_and_rewritten_slot_is_dropped(region: L1Region) -> None:
    store = ChunkStore(L1Pool(region.size, A), region)  # no L2: evictions just delete
    old_lid, offset = write_unhashed(store, 0)
    for i in (1, 2, 3):  # the fourth chunk evicts chunk 0 (LRU)
        write_unhashed(store, i)
    assert store.committed_info(key(0)) is None
    new_lid, _ = write_unhashed(store, 0)  # stored again, unhashed again
    assert not store.settle_checksum(key(0), old_lid, offset, 999)
    info = store.committed_info(key(0))
    assert info is not None and info.checksum == checksum(chunk(0))
    assert not store.settle_checksum(key(0), new_lid, info.offset, 999)


def test_a_commit_with_its_checksum_replaces_an_evicted_unhashed_one(region: L1Region) -> None:
    store = ChunkStore(L1Pool(region.size, A), region)
    lid, offset = write_unhashed(store, 0)
    for i in (1, 2, 3):
        write_unhashed(store, i)
    r = store.reserve(key(0), CHUNK, 1.0, 5.0, holder="engine")
    assert isinstance(r, Reserved)
    with store.slot_view(r.slot) as view:
        view[:] = chunk(0)
    assert store.commit(key(0), 1.0, checksum(chunk(0)), r.slot.lease_id) is not None
    assert not store.settle_checksum(key(0), lid, offset, 999)
    info = store.committed_info(key(0))
    assert info is not None and info.checksum == checksum(chunk(0))


def test_an_unhashed_chunk_demoted_to_l2_carries_its_real_checksum(
    store: ChunkStore, l2: DiskL2Adapter
) -> None:
    write_unhashed(store, 0)
    for i in (1, 2, 3):
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


def test_a_peers_lock_leaves_out_chunks_whose_checksum_is_pending(store: ChunkStore) -> None:
    """A lock RPC's deadline is a round trip's: it does not hash KV, it stops the run."""
    owner = PeerStoreAccess(GuardedStore(store, clock=lambda: 0.0))
    lid1, off1 = write_unhashed(store, 1)
    lid2, off2 = write_unhashed(store, 2)
    assert store.settle_checksum(key(1), lid1, off1, checksum(chunk(1)))
    leases = owner.lock_for_peer("b", [key(1), key(2)], 5.0)
    assert [lease.checksum for lease in leases] == [checksum(chunk(1))]
    assert store.unhashed == 1  # not computed inside the lock RPC
    assert store.settle_checksum(key(2), lid2, off2, checksum(chunk(2)))
    leases = owner.lock_for_peer("b", [key(1), key(2)], 5.0)
    assert [lease.checksum for lease in leases] == [checksum(chunk(1)), checksum(chunk(2))]
