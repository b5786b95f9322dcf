"""The parts the LMCache MP service composes, on a real chunk store: the dispatch table
against the wire's operations, leases measured with the injected clock, ``StoreSide``'s
prefix locks and their ACCESS events, ``Lookups`` dropping the locks of a request that
ended during its peer fetch, and ``Transfers`` undoing an unregistered worker's open
store."""

from __future__ import annotations

import threading
from collections.abc import Container, Iterator, Sequence
from dataclasses import dataclass, field

import pytest

from kvatlas.core.events import Entry
from kvatlas.core.keys import ObjectKey
from kvatlas.core.server.l1pool import L1Pool, Reserved
from kvatlas.core.types import EventType, Tier
from kvatlas.runtime.region import L1Region
from kvatlas.server.lmcache_mp.core import ChunkKeys
from kvatlas.server.lmcache_mp.hashing import QuietHasher
from kvatlas.server.lmcache_mp.service import LMCacheMPService, MpIdentity
from kvatlas.server.lmcache_mp.store_side import StoreSide
from kvatlas.server.lmcache_mp.wire import OPERATIONS, EngineDrivenRegistration, IPCKey
from kvatlas.server.storage.chunkstore import ChunkStore
from kvatlas.server.storage.guarded import GuardedStore
from lmcache_mp.test_service import CHUNK, key, register, svc
from support.wait import wait_until

__all__ = ["svc"]  # the in-process service fixture, shared with test_service

SIZE = 1024


@dataclass
class Published:
    """The events the store's drain hands on, in order (the publisher interface)."""

    events: list[tuple[EventType, Tier, list[ObjectKey]]] = field(default_factory=list)

    def publish(self, event_type: EventType, tier: Tier, entries: Sequence[Entry]) -> None:
        self.events.append((event_type, tier, [e.key for e in entries]))

    def accessed(self) -> list[ObjectKey]:
        return [k for kind, _, keys in self.events if kind is EventType.ACCESS for k in keys]


@pytest.fixture
def guarded() -> Iterator[tuple[GuardedStore, Published]]:
    region = L1Region.create(1 << 20, "mp-parts")
    published = Published()
    try:
        yield (
            GuardedStore(ChunkStore(L1Pool(1 << 20, 4096), region), publisher=published),
            published,
        )
    finally:
        region.close()
        region.unlink()


def stored(side: StoreSide, keys: Sequence[ObjectKey]) -> None:
    writes = []
    for k, r in zip(keys, side.reserve([(k, SIZE) for k in keys]), strict=True):
        assert isinstance(r, Reserved)
        writes.append((k, r.slot.lease_id))
    assert side.commit(writes)


def test_the_service_serves_every_operation_the_wire_decodes(svc: LMCacheMPService) -> None:
    assert svc.operations == frozenset(OPERATIONS)


def test_leases_are_measured_with_the_injected_clock(
    guarded: tuple[GuardedStore, Published],
) -> None:
    store, _ = guarded
    now = 1e9  # far from the store's own (monotonic) clock
    service = LMCacheMPService(store, MpIdentity("mp-parts", 1, CHUNK, 30.0), clock=lambda: now)
    try:
        register(service)
        tokens = list(range(CHUNK))
        service.handle("prepare_store", (key(tokens, 0, CHUNK, "s"), 1))
        assert service.handle("commit_store", (key(tokens, 0, CHUNK, "s"), 1, b"")) is True
        service.handle("lookup", (key(tokens, 0, CHUNK, "r", None), 1))
        assert service.handle("query_prefetch_status", ("r",)) == 1
        with store.lock:
            store.store.expire(now + 29.0)
            assert store.store.pool.stats().read_leases == 1
            store.store.expire(now + 30.0)
            assert store.store.pool.stats().read_leases == 0
    finally:
        service.close()


def test_a_prefix_lock_stops_at_the_first_chunk_a_rank_lacks(
    guarded: tuple[GuardedStore, Published],
) -> None:
    store, published = guarded
    hasher = QuietHasher(store, lambda: 0)
    side = StoreSide(store, hasher, 30.0, store.clock)
    try:
        tokens = list(range(3 * CHUNK))
        keys = ChunkKeys(CHUNK)
        ranks = [
            keys.keys(IPCKey("m", 2, r, tokens, 0, 3 * CHUNK, "x", "", None, 1), 0, 3 * CHUNK, r)
            for r in (0, 1)
        ]
        stored(side, ranks[0])
        stored(side, [ranks[1][0], ranks[1][2]])  # rank 1 lacks chunk 1
        assert side.hit(ranks) == 1
        held, hit = side.lock_prefix(ranks, readers=2)
        assert hit == 1
        assert {k: len(lids) for k, lids in held.items()} == {ranks[0][0]: 2, ranks[1][0]: 2}
        assert store.store.pool.stats().read_leases == 4
        assert published.accessed() == [ranks[0][0], ranks[1][0]]  # once per key
        side.release([lid for lids in held.values() for lid in lids])
        assert store.store.pool.stats().read_leases == 0
    finally:
        hasher.close()


class GatedFetcher:
    """A peer fetch that waits to be let go, then finds what the test put in place."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.go = threading.Event()

    def fetch_prefix(self, keys: Sequence[ObjectKey], recompute_s: float) -> GatedFetcher:
        self.started.set()
        assert self.go.wait(30)
        return self

    @property
    def fetched(self) -> Container[ObjectKey]:
        return ()


def test_a_lookup_that_ends_during_its_peer_fetch_holds_nothing(
    guarded: tuple[GuardedStore, Published],
) -> None:
    store, published = guarded
    service = LMCacheMPService(store, MpIdentity("mp-parts", 1, CHUNK, 30.0))
    fetcher = GatedFetcher()
    service.set_peer_source(fetcher)
    try:
        register(service)
        tokens = list(range(2 * CHUNK))
        service.handle("prepare_store", (key(tokens, 0, CHUNK, "s"), 1))
        assert service.handle("commit_store", (key(tokens, 0, CHUNK, "s"), 1, b"")) is True
        service.handle("lookup", (key(tokens, 0, 2 * CHUNK, "r", None), 1))  # chunk 1 missing
        assert fetcher.started.wait(30)
        assert service.handle("query_prefetch_status", ("r",)) is None  # fetching
        service.handle("end_session", ("r",))
        fetcher.go.set()
        # the lock after the fetch took chunk 0 (its ACCESS), then let it go: ended
        wait_until(published.accessed, what="the post-fetch prefix lock", timeout=30)
        assert store.store.pool.stats().read_leases == 0
        assert service.handle("query_prefetch_status", ("r",)) == 0
    finally:
        service.close()


def test_unregistering_a_worker_undoes_its_open_store(svc: LMCacheMPService) -> None:
    register(svc, iid=1)
    register(svc, iid=2)
    tokens = list(range(2 * CHUNK))
    assert (
        len(svc.handle("prepare_store", (key(tokens, 0, CHUNK, "a"), 1))["context"]["slots"]) == 1
    )
    other = key(list(range(100, 100 + CHUNK)), 0, CHUNK, "b")
    assert len(svc.handle("prepare_store", (other, 2))["context"]["slots"]) == 1
    assert svc.guarded.store.pool.stats().write_leases == 2
    svc.handle("unregister_kv_cache_engine_driven_context", (1,))
    assert svc.guarded.store.pool.stats().write_leases == 1  # worker 2's stays open
    assert svc.worker_modes() == {"lmcache_driven": 0, "engine_driven": 1}
    assert svc.handle("commit_store", (other, 2, b"")) is True
    reg = EngineDrivenRegistration(1, "m", 1, 4, 2, 8, "float16", False, CHUNK)
    svc.handle("register_kv_cache_engine_driven_context", (reg,))
    assert svc.handle("commit_store", (key(tokens, 0, CHUNK, "a"), 1, b"")) is False  # undone
