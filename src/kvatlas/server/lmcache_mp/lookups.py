"""LMCache lookups: what each request's lookup found, held for the retrieves that follow.

``lookup`` answers at once; chunks missing locally are fetched from peers (the P2P
fetcher the kvatlas engine API uses) on a background thread while the client polls
``query_prefetch_status`` (or ``wait_prefetch_status``); the hit prefix is then
read-locked, ``num_kv_readers`` leases per key on every rank, and kept in the
request's ``Session`` until the workers' retrieves take the leases over
(``transfers``), ``free_lookup_locks`` or ``end_session`` release them, or their time
runs out. A hybrid model's lookup (``Workers.hybrid_groups``) asks for each KV group's
window and is local only.

Must not: take the store's lock (``StoreSide`` does), or know transfers.
"""

from __future__ import annotations

import logging
from collections.abc import Container, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from kvatlas.core.keys import ObjectKey
from kvatlas.core.server.l1pool import LeaseId
from kvatlas.server.lmcache_mp.core import ChunkKeys, KVGroup, MpError
from kvatlas.server.lmcache_mp.sessions import Session, Sessions
from kvatlas.server.lmcache_mp.store_side import StoreSide
from kvatlas.server.lmcache_mp.wire import IPCKey
from kvatlas.server.lmcache_mp.workers import Workers

log = logging.getLogger(__name__)

WAIT_CAP_S = 1.0
"""The longest ``wait_prefetch_status`` holds a worker; a later poll sees the rest."""


class _Fetched(Protocol):
    @property
    def fetched(self) -> Container[ObjectKey]: ...


class PrefixFetcher(Protocol):
    """The P2P fetcher (``kvatlas.server.p2p.fetch.PeerFetcher``), called without locks."""

    def fetch_prefix(self, keys: Sequence[ObjectKey], recompute_s: float) -> _Fetched: ...


class Lookups:
    """The lookup operations, over the sessions they share with the retrieves."""

    def __init__(
        self,
        keys: ChunkKeys,
        workers: Workers,
        store: StoreSide,
        sessions: Sessions,
        *,
        prefetch_workers: int = 4,
    ) -> None:
        """``prefetch_workers``: threads running peer fetches."""
        self._keys = keys
        self._workers = workers
        self._store = store
        self.sessions = sessions
        self._peers: PrefixFetcher | None = None
        self._prefetch = ThreadPoolExecutor(prefetch_workers, "kvatlas-lmcache-prefetch")

    def set_peers(self, peers: PrefixFetcher | None) -> None:
        self._peers = peers

    def close(self) -> None:
        self._prefetch.shutdown(wait=False, cancel_futures=True)

    def lookup(self, key: IPCKey, tp_size: int) -> None:
        if key.num_kv_readers < 1:
            raise MpError(
                "version",
                "num_kv_readers=0: the client predates LMCache 0.5.6's IPCCacheServerKey",
            )
        hybrid = self._workers.hybrid_groups(key.model_name, key.world_size)
        if hybrid:
            _, stale = self.sessions.begin(key.request_id)
            self._store.release(stale)
            self._lock_hybrid(key, hybrid)
            return
        keys = [
            self._keys.keys(key, 0, key.end, rank, learn=rank == 0)
            for rank in range(max(key.world_size, 1))
        ]  # per rank, per chunk
        _, stale = self.sessions.begin(key.request_id)
        self._store.release(stale)
        hit = self._store.hit(keys)
        if hit < len(keys[0]) and self._peers is not None:
            self._prefetch.submit(self._fetch_then_lock, key, keys, hit)
            return
        self._lock_prefix(key, keys)

    def _fetch_then_lock(self, key: IPCKey, keys: list[list[ObjectKey]], hit: int) -> None:
        try:
            if self._peers is not None:
                for rank_keys in keys:
                    self._peers.fetch_prefix(rank_keys[hit:], 0.0)
        except Exception:
            log.exception("peer fetch for LMCache request %s failed", key.request_id)
        finally:
            self._lock_prefix(key, keys)

    def _lock_prefix(self, key: IPCKey, keys: list[list[ObjectKey]]) -> None:
        """Read-lock the leading chunks every rank holds; record the hit count."""
        session = self.sessions.get(key.request_id)
        held, hit = self._store.lock_prefix(keys, key.num_kv_readers)
        self._record(key, session, held, hit)

    def _lock_hybrid(self, key: IPCKey, groups: Sequence[KVGroup]) -> None:
        """A hybrid model's hit, every KV group's needed chunks read-locked as
        ``_lock_prefix`` locks. Local only (no peer fetch)."""
        session = self.sessions.get(key.request_id)
        keys = [
            self._keys.group_keys(key, 0, key.end, r, groups=len(groups), learn=r == 0)
            for r in range(max(key.world_size, 1))
        ]  # [rank][group][chunk]
        held, hit = self._store.lock_hybrid(keys, groups, key.num_kv_readers)
        self._record(key, session, held, hit)

    def _record(
        self,
        key: IPCKey,
        session: Session | None,
        held: dict[ObjectKey, list[LeaseId]],
        hit: int,
    ) -> None:
        if session is None or self.sessions.get(key.request_id) is not session:
            self._store.release([lid for lids in held.values() for lid in lids])  # ended meanwhile
            return
        session.leases = held
        session.hit_chunks = hit
        session.done.set()

    def query_prefetch_status(self, request_id: str) -> int | None:
        s = self.sessions.get(request_id)
        if s is None:
            return 0  # LMCache answers 0 for a request id it does not know
        return s.hit_chunks if s.done.is_set() else None

    def wait_prefetch_status(self, request_id: str, timeout: float) -> int | None:
        s = self.sessions.get(request_id)
        if s is None:
            return 0
        # Capped: the wait holds one of the engine API's workers.
        s.done.wait(max(0.0, min(timeout, WAIT_CAP_S)))
        return s.hit_chunks if s.done.is_set() else None

    def free_lookup_locks(
        self, key: IPCKey, tp_size: int, extra_ranges: Sequence[tuple[int, int]] = ()
    ) -> None:
        """Release the session's read locks on ``[start, end)``; 0.5.7's
        ``extra_ranges``: also on each ``(start, end)`` of the request's earlier,
        abandoned lookups (each ends at that lookup's hit boundary)."""
        ranges = [(key.start, key.end), *extra_ranges]
        groups = len(self._workers.hybrid_groups(key.model_name, key.world_size)) or 1
        keys = [
            k
            for start, end in ranges
            if start < end
            for rank in range(max(key.world_size, 1))
            for g_keys in self._keys.group_keys(key, start, end, rank, groups=groups)
            for k in g_keys
        ]
        if keys:
            self._store.release(self.sessions.take_all(key.request_id, keys))

    def end_session(self, request_id: str) -> None:
        _, leases = self.sessions.end(request_id)
        self._store.release(leases)

    def clear(self) -> None:
        """End every session, releasing its read leases (a clear)."""
        self._store.release(self.sessions.clear())
