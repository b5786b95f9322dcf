"""The LMCache MP service on a real chunk store (L1 pool and shared-memory region), in
process: the engine-driven transfer a worker drives, sessions' read leases, clear, and
the replies of requests that cannot be served (transport)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import msgspec
import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvatlas.core.checksum import checksum
from kvatlas.core.server.l1pool import L1Pool
from kvatlas.runtime.region import L1Region
from kvatlas.server.lmcache_mp import hashing
from kvatlas.server.lmcache_mp.metrics import LMCacheMPCollector
from kvatlas.server.lmcache_mp.service import LMCacheMPService, MpError, MpIdentity
from kvatlas.server.lmcache_mp.transport import LMCacheMPHandler
from kvatlas.server.lmcache_mp.wire import EngineDrivenRegistration, IPCKey
from kvatlas.server.storage.chunkstore import ChunkStore
from kvatlas.server.storage.guarded import GuardedStore
from support.wait import wait_until

CHUNK = 16
enc = msgspec.msgpack.encode


class Frame:
    """A received ZeroMQ frame as the engine API hands it over (``.bytes``)."""

    def __init__(self, data: bytes) -> None:
        self.bytes = data


@pytest.fixture
def svc() -> Iterator[LMCacheMPService]:
    region = L1Region.create(1 << 20, "mp-test")
    store = ChunkStore(L1Pool(1 << 20, 4096), region)
    service = LMCacheMPService(GuardedStore(store), MpIdentity("mp-test", 1, CHUNK, 30.0))
    try:
        yield service
    finally:
        service.close()
        region.close()
        region.unlink()


def key(tokens: list[int], start: int, end: int, rid: str, worker: int | None = 0) -> IPCKey:
    return IPCKey("m", 1, worker, tokens, start, end, rid, "", None, 1)


def register(svc: LMCacheMPService, iid: int = 1) -> dict[str, object]:
    reg = EngineDrivenRegistration(iid, "m", 1, 4, 2, 8, "float16", False, CHUNK)
    out: dict[str, object] = svc.handle("register_kv_cache_engine_driven_context", (reg,))
    return out


def test_engine_driven_store_lookup_retrieve(svc: LMCacheMPService) -> None:
    pool = register(svc)
    region_name = svc.guarded.store.region.name
    assert pool == {"shm_name": region_name, "pool_size": 1 << 20, "null_block_id": 0}
    tokens = list(range(40))  # 2 full chunks
    prep = svc.handle("prepare_store", (key(tokens, 0, 32, "s"), 1))
    slots = prep["context"]["slots"]
    assert prep["context"]["chunk_indices"] == [0, 1]
    assert slots[0]["shape"] == [2, 2, CHUNK, 8] and slots[0]["dtype"] == "float16"
    region = svc.guarded.store.region.array
    data = np.random.default_rng(0).integers(0, 256, (2, slots[0]["length"]), dtype=np.uint8)
    for s, d in zip(slots, data, strict=True):  # the worker writes the slots itself
        region[s["offset"] : s["offset"] + s["length"]] = d
    assert svc.handle("commit_store", (key(tokens, 0, 32, "s"), 1, b"")) is True
    # stored again: nothing to write
    again = svc.handle("prepare_store", (key(tokens, 0, 32, "s2"), 1))
    assert again["context"] == {"slots": [], "chunk_indices": []}
    svc.handle("lookup", (key(tokens, 0, 32, "r", None), 1))
    assert svc.handle("query_prefetch_status", ("r",)) == 2
    assert svc.guarded.store.pool.stats().read_leases == 2  # held for the retrieve
    got = svc.handle("prepare_retrieve", (key(tokens, 0, 32, "r"), 1))
    assert got["success"]
    for s, d in zip(got["context"]["slots"], data, strict=True):
        assert bytes(region[s["offset"] : s["offset"] + s["length"]]) == d.tobytes()
    assert svc.handle("commit_retrieve", (key(tokens, 0, 32, "r"), 1)) is True
    svc.handle("end_session", ("r",))
    assert svc.guarded.store.pool.stats().read_leases == 0
    assert svc.handle("query_prefetch_status", ("gone",)) == 0  # as LMCache answers
    # free_lookup_locks releases what a lookup held
    svc.handle("lookup", (key(tokens, 0, 32, "q", None), 1))
    svc.handle("free_lookup_locks", (key(tokens, 0, 32, "q", None), 1))
    assert svc.guarded.store.pool.stats().read_leases == 0
    # clear deletes the model's unlocked chunks
    svc.handle("clear", (False,))
    svc.handle("lookup", (key(tokens, 0, 32, "c", None), 1))
    assert svc.handle("query_prefetch_status", ("c",)) == 0


def test_a_stores_checksums_are_settled_after_its_commit(svc: LMCacheMPService) -> None:
    """commit_store answers before hashing; the hash threads then record each chunk's
    checksum, the one a peer or the disk tier verifies against."""
    register(svc)
    tokens = list(range(48))  # 3 full chunks
    prep = svc.handle("prepare_store", (key(tokens, 0, 48, "h"), 1))
    region = svc.guarded.store.region.array
    written = []
    for i, s in enumerate(prep["context"]["slots"]):
        d = np.random.default_rng(10 + i).integers(0, 256, s["length"], dtype=np.uint8)
        region[s["offset"] : s["offset"] + s["length"]] = d
        written.append((s["offset"], checksum(d.tobytes())))
    assert svc.handle("commit_store", (key(tokens, 0, 48, "h"), 1, b"")) is True
    wait_until(lambda: svc.unhashed_chunks, lambda n: n == 0, what="every chunk hashed", timeout=30)
    text = generate_latest(collector_registry(LMCacheMPHandler(svc))).decode()
    assert 'kvatlas_server_lmcache_unhashed_chunks{instance_id="mp-test"} 0.0' in text
    by_offset = {info.offset: info.checksum for info in svc.guarded.store.pool.slots()}
    assert [by_offset[off] for off, _ in written] == [digest for _, digest in written]


def test_checksums_wait_while_a_worker_copies(svc: LMCacheMPService) -> None:
    """No chunk is hashed while an engine-driven transfer is open (the worker copies
    into or out of L1 then): the hashing would take its core and memory bandwidth."""
    register(svc)
    first, second = list(range(16)), list(range(100, 116))
    svc.handle("prepare_store", (key(first, 0, 16, "a"), 1))
    assert svc.handle("commit_store", (key(first, 0, 16, "a"), 1, b"")) is True
    svc.handle("prepare_store", (key(second, 0, 16, "b"), 1))  # the next copy begins
    # not synchronisation: three quiet periods pass, in which a hash thread that did not
    # wait for the copy would have hashed the chunk
    time.sleep(3 * hashing.QUIET_S)
    assert svc.unhashed_chunks == 1  # well before MAX_DEFER_S: still waiting
    assert svc.handle("commit_store", (key(second, 0, 16, "b"), 1, b"")) is True
    wait_until(lambda: svc.unhashed_chunks, lambda n: n == 0, what="the chunk hashed", timeout=30)


def test_pickled_stores_are_refused_and_reservations_undone(svc: LMCacheMPService) -> None:
    register(svc)
    tokens = list(range(16))
    assert svc.handle("prepare_store", (key(tokens, 0, 16, "p"), 1))["context"]["slots"]
    assert svc.handle("commit_store", (key(tokens, 0, 16, "p"), 1, b"\x80pickle")) is False
    assert svc.refused["pickle_refused"] == 1
    assert svc.guarded.store.pool.stats().write_leases == 0


def test_unregistered_workers_and_pings(svc: LMCacheMPService) -> None:
    with pytest.raises(MpError, match="registered no KV cache"):
        svc.handle("prepare_store", (key(list(range(16)), 0, 16, "x"), 9))
    assert svc.handle("ping", (9,)) is False  # once: LMCache's heartbeat re-registers
    assert svc.handle("ping", (9,)) is True
    assert svc.handle("ping", (None,)) is True


def collector_registry(handler: LMCacheMPHandler) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(LMCacheMPCollector("mp-test", handler))
    return registry


def test_transport_answers_every_request_once(svc: LMCacheMPService) -> None:
    handler = LMCacheMPHandler(svc)
    frames = [b"id", enc(3), enc(16), enc(msgspec.to_builtins(key([1] * 16, 0, 16, "x"))), enc(9)]
    # prepare_store for an unregistered worker: the adapters' "nothing to write"
    out = handler.answer([Frame(f) for f in frames])
    assert out[:3] == frames[:3]
    assert msgspec.msgpack.decode(out[3]) == {"context": {"slots": [], "chunk_indices": []}}
    assert handler.errors["not_registered"] == 1
    # a descriptor whose fields no decoder anticipated: malformed, still one reply
    bad = {"type": "cpu_shm", "version": "x"}
    reg = [enc(1), [msgspec.msgpack.Ext(1, enc(bad))], "m", 1, "vllm", {}, []]
    frames = [b"id", enc(4), enc(1), *(x if isinstance(x, bytes) else enc(x) for x in reg)]
    out = handler.answer([Frame(f) for f in frames])
    assert msgspec.msgpack.decode(out[2]).startswith("error: malformed request")
    text = generate_latest(collector_registry(handler)).decode()
    assert (
        'kvatlas_server_lmcache_errors_total{instance_id="mp-test",reason="malformed"} 1.0' in text
    )
    assert 'operation="prepare_store"' in text
    # refused by the queue bounds: a transfer's failure result, else an error reply
    busy = handler.overloaded([Frame(f) for f in [b"i", enc(7), enc(18), b"k", b"1"]], "full")
    assert msgspec.msgpack.decode(busy[3]) == {"success": False, "data": b"", "context": {}}
    busy = handler.overloaded([Frame(b"i"), Frame(enc(8)), Frame(enc(21))], "full")
    assert msgspec.msgpack.decode(busy[2]).startswith("error: overloaded: full")
    off = LMCacheMPHandler(svc, refusal="off here")
    assert msgspec.msgpack.decode(off.answer([Frame(b"i"), Frame(enc(1)), Frame(enc(21))])[2]) == (
        "error: off here"
    )


def test_tensor_parallel_lookup_needs_every_rank(svc: LMCacheMPService) -> None:
    """world_size 2: a chunk hits only once both workers stored their shard, and each
    worker's retrieve takes its own rank's lease."""
    for iid in (1, 2):
        reg = EngineDrivenRegistration(iid, "m", 2, 4, 2, 8, "float16", False, CHUNK)
        svc.handle("register_kv_cache_engine_driven_context", (reg,))
    tokens = list(range(CHUNK + 3))

    def tp_key(rid: str, worker: int | None) -> IPCKey:
        return IPCKey("m", 2, worker, tokens, 0, CHUNK, rid, "", None, 1)

    def store(worker: int) -> None:
        svc.handle("prepare_store", (tp_key("s", worker), worker + 1))
        assert svc.handle("commit_store", (tp_key("s", worker), worker + 1, b"")) is True

    store(0)
    svc.handle("lookup", (tp_key("a", None), 2))
    assert svc.handle("query_prefetch_status", ("a",)) == 0  # rank 1's shard is missing
    store(1)
    svc.handle("lookup", (tp_key("b", None), 2))
    assert svc.handle("query_prefetch_status", ("b",)) == 1
    assert svc.guarded.store.pool.stats().read_leases == 2  # one per rank
    for worker in (0, 1):
        assert svc.handle("prepare_retrieve", (tp_key("b", worker), worker + 1))["success"]
        svc.handle("commit_retrieve", (tp_key("b", worker), worker + 1))
    assert svc.guarded.store.pool.stats().read_leases == 0
    svc.handle("end_session", ("b",))
