"""Cache control on one server: delete by key across tiers, warm prefetch, list, clear,
per-salt usage. What a coordinator (kvatlas' or LMCache's) asks of a server through its
``/cache/*`` HTTP routes (``server.http_cache``), with LMCache 0.5.6's semantics
(lmcache/v1/multiprocess/cache_control/): transport-free, raising this module's errors,
which the HTTP shell maps to 400 / 404 / 503.

    ServerError (server.errors)
     +-- CacheControlError
          +-- InvalidRequest     malformed or unsupported: 400
          +-- NotFound           no such adapter or prefetch job: 404
          +-- Unavailable        nothing to serve it with (no L2, too busy): 503

Delete: every key on the tiers asked (``l1``, ``l2``, ``all``), under the store lock; an
L1 chunk a reader or writer holds is skipped unless ``force`` (its leases end then); L2
is deleted all the same. DELETE events reach the coordinator through the publisher like
any other (``GuardedStore.drain_locked``). Pins are the coordinator's: it leaves pinned
keys out of what it asks to delete. ``deleted`` counts keys actually removed per tier
(LMCache counts the whole L2 batch, whether present or not).

Warm prefetch: the complete chunks of a token sequence, every rank's key (LMCache's
fan-out, ``core.keys.rank_keys``), are brought into L1 from L2 and, on a server with
P2P, the rest from peers (``PeerSource.fetch_prefix``, the lookup path's fetch, run per
rank in chunk order); nothing stays pinned. Jobs run on ``workers`` threads; the table
holds at most ``max_jobs`` (a submit beyond is 503), and the first poll that sees a job
done drops it (a later one is 404), as LMCache's ``WarmPrefetchJobs``; jobs never polled
are dropped ``job_ttl_s`` after they finished.

Must not: run a peer fetch or anything slow under the store lock, or know HTTP.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Final

from kvatlas.core.errors import InvalidInput
from kvatlas.core.keys import HashContract, ObjectKey, chunk_hashes, rank_keys
from kvatlas.core.types import Tier
from kvatlas.server.engine_service import PeerSource
from kvatlas.server.errors import ServerError
from kvatlas.server.storage.guarded import GuardedStore
from kvatlas.server.storage.l2 import L2Error
from kvatlas.wire.cache_api import (
    MAX_DELETE_BATCH,
    MAX_TOKEN_IDS,
    CacheTier,
    DeleteObjectsResponse,
    NodePrefetchRequest,
    NodePrefetchResponse,
    NodePrefetchStatus,
    ObjectEntryWire,
    ObjectsPage,
)
from kvatlas.wire.http_api import KeyWire

log = logging.getLogger(__name__)

SALT_FORBIDDEN: Final = frozenset("@/\\\x00")
"""Characters LMCache refuses in a cache salt (its L2 adapters' separators)."""
SALT_MAX_LEN: Final = 128
PENDING: Final = "pending"
COMPLETED: Final = "completed"


class CacheControlError(ServerError):
    """A cache-control request could not be served."""


class InvalidRequest(CacheControlError):
    """Malformed or unsupported (400)."""


class NotFound(CacheControlError):
    """No such L2 adapter or prefetch job (404)."""


class Unavailable(CacheControlError):
    """Nothing to serve it with: no L2 configured, the job table is full (503)."""


def check_key_fields(model_name: str, cache_salt: str, object_group_id: int = 0) -> None:
    """LMCache's ``ObjectKey`` invariants, so a key it refuses is refused here too."""
    if "@" in model_name:
        raise InvalidRequest(f"model_name must not contain '@' (got {model_name!r})")
    if object_group_id < 0:
        raise InvalidRequest(f"object_group_id must be >= 0 (got {object_group_id})")
    bad = SALT_FORBIDDEN & set(cache_salt)
    if bad:
        raise InvalidRequest(f"cache_salt must not contain {sorted(bad)!r} (got {cache_salt!r})")
    if len(cache_salt) > SALT_MAX_LEN:
        raise InvalidRequest(
            f"cache_salt exceeds max length {SALT_MAX_LEN} (got {len(cache_salt)})"
        )


@dataclass(slots=True)
class CacheControlStats:
    """Counters since the start, for ``/metrics``."""

    delete_requests: int = 0
    deleted_l1: int = 0
    deleted_l2: int = 0
    skipped_locked: int = 0
    l2_delete_errors: int = 0
    prefetches: dict[str, int] = field(default_factory=dict)
    """By outcome: submitted, noop, refused_busy, completed, failed, expired."""
    prefetch_keys: dict[str, int] = field(default_factory=dict)
    """Keys of completed prefetches by where they were found: l1, l2, peer, missing."""
    clears: int = 0
    jobs: int = 0
    """Prefetch jobs in the table now."""


@dataclass(slots=True)
class _Job:
    future: Future[tuple[int, int]]
    total_keys: int
    finished_at: float | None = None


class CacheControl:
    """Thread-safe; one per server. ``contracts``: the models engines registered (a
    prefetch for one must use its world size)."""

    def __init__(
        self,
        guarded: GuardedStore,
        chunk_size: int,
        *,
        contracts: Callable[[], dict[str, HashContract]] = dict,
        workers: int = 2,
        max_jobs: int = 256,
        job_ttl_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._guarded = guarded
        self._store = guarded.store
        self._chunk_size = chunk_size
        self._contracts = contracts
        self._peer_source: PeerSource | None = None
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="kvatlas-prefetch")
        self._max_jobs = max_jobs
        self._job_ttl_s = job_ttl_s
        self._clock = clock
        self._lock = threading.Lock()  # the job table and counters; never the store's
        self._jobs: dict[str, _Job] = {}
        self._stats = CacheControlStats()

    def set_peer_source(self, peer_source: PeerSource | None) -> None:
        self._peer_source = peer_source

    def close(self) -> None:
        """Stop taking jobs; running ones finish, queued ones are dropped."""
        self._pool.shutdown(wait=True, cancel_futures=True)

    def stats(self) -> CacheControlStats:
        with self._lock:
            s = self._stats
            return CacheControlStats(
                s.delete_requests,
                s.deleted_l1,
                s.deleted_l2,
                s.skipped_locked,
                s.l2_delete_errors,
                dict(s.prefetches),
                dict(s.prefetch_keys),
                s.clears,
                len(self._jobs),
            )

    # ---- delete ----------------------------------------------------------------------

    def delete_objects(
        self, keys: Sequence[KeyWire], tier: CacheTier, force: bool, adapter: str | None
    ) -> DeleteObjectsResponse:
        if len(keys) > MAX_DELETE_BATCH:
            raise InvalidRequest(
                f"too many keys in a single request (limit={MAX_DELETE_BATCH}, got={len(keys)})"
            )
        parsed: list[ObjectKey] = []
        for i, wire in enumerate(keys):
            try:
                check_key_fields(wire.model_name, wire.cache_salt, wire.object_group_id)
                parsed.append(wire.to_core())
            except (InvalidInput, InvalidRequest) as exc:
                raise InvalidRequest(f"keys[{i}]: {exc}") from None
        on_l1 = tier in ("l1", "all")
        on_l2 = tier in ("l2", "all")
        if on_l2:
            self._l2_named(adapter)
        l1 = l2 = skipped = 0
        error: str | None = None
        with self._guarded.lock:
            try:
                for key in parsed:
                    done = self._store.delete(key, l1=on_l1, l2=on_l2, force=force)
                    l1 += done.l1
                    l2 += done.l2
                    skipped += done.l1_locked
            except L2Error as exc:  # a structured failure, as LMCache answers it
                error = str(exc)
            finally:
                self._guarded.drain_locked()
        with self._lock:
            s = self._stats
            s.delete_requests += 1
            s.deleted_l1 += l1
            s.deleted_l2 += l2
            s.skipped_locked += skipped
            s.l2_delete_errors += error is not None
        log.info(
            "Delete of %d keys (tier %s%s): %d from L1, %d from L2, %d locked in L1 kept%s",
            len(parsed),
            tier,
            ", forced" if force else "",
            l1,
            l2,
            skipped,
            f"; L2 failed: {error}" if error else "",
        )
        if error is not None:
            return DeleteObjectsResponse(l1 + l2, skipped, False, error)
        return DeleteObjectsResponse(l1 + l2, skipped, True)

    def _l2_named(self, adapter: str | None) -> None:
        l2 = self._store.l2
        if l2 is None:
            raise Unavailable("no L2 adapters configured")
        if adapter is not None and adapter != l2.name:
            raise NotFound(f"no L2 adapter with type_name={adapter!r}")

    # ---- list, clear, usage ----------------------------------------------------------

    def list_objects(
        self,
        tier: str,
        adapter: str | None,
        model_name: str | None,
        page_size: int,
        page_token: str | None,
    ) -> ObjectsPage:
        """One page of L2's keys, least recently used first; ``page_token`` is opaque
        (the position of the page's first key)."""
        if tier != Tier.L2:
            raise InvalidRequest(f"tier {tier!r} not supported; only 'l2'")
        self._l2_named(adapter)
        start = 0
        if page_token is not None:
            if not page_token.isdigit() or len(page_token) > 18:
                raise InvalidRequest(f"malformed page_token {page_token[:32]!r}")
            start = int(page_token)
        with self._guarded.lock:
            l2 = self._store.l2
            assert l2 is not None  # _l2_named
            items = [i for i in l2.list() if model_name is None or i.key.model_name == model_name]
            name = l2.name
        page = items[start : start + page_size]
        more = start + page_size < len(items)
        return ObjectsPage(
            adapter=name,
            shared=False,
            entries=[ObjectEntryWire(KeyWire.from_core(i.key), i.size) for i in page],
            next_page_token=str(start + page_size) if more else None,
        )

    def clear(self, tier: str, force: bool) -> int:
        """Delete every L1 chunk (only L1, as LMCache); returns how many."""
        if tier != Tier.L1:
            raise InvalidRequest(f"tier {tier!r} not supported; only 'l1'")
        with self._guarded.lock:
            n = self._store.clear_l1(force)
            self._guarded.drain_locked()
        with self._lock:
            self._stats.clears += 1
            self._stats.deleted_l1 += n
        log.info("L1 cleared%s: %d chunks deleted", " (forced)" if force else "", n)
        return n

    def usage_by_salt(self) -> dict[str, dict[str, int]]:
        """Bytes held per cache salt, per tier (``l1``, ``l2``)."""
        l1: dict[str, int] = {}
        l2: dict[str, int] = {}
        with self._guarded.lock:
            for slot in self._store.pool.slots():
                if slot.committed:
                    l1[slot.key.cache_salt] = l1.get(slot.key.cache_salt, 0) + slot.size
            if self._store.l2 is not None:
                for item in self._store.l2.list():
                    l2[item.key.cache_salt] = l2.get(item.key.cache_salt, 0) + item.size
        return {"l1": l1, "l2": l2}

    # ---- prefetch --------------------------------------------------------------------

    def submit_prefetch(self, req: NodePrefetchRequest) -> NodePrefetchResponse:
        model_name, world_size, cache_salt = req.model_name, req.world_size, req.cache_salt
        source_tier, target_tier, token_ids = req.source_tier, req.target_tier, req.token_ids
        if source_tier != "l2" or target_tier != "l1":
            raise InvalidRequest(
                f"unsupported prefetch direction {source_tier!r}->{target_tier!r}; only 'l2'->'l1'"
            )
        if len(token_ids) > MAX_TOKEN_IDS:
            raise InvalidRequest(
                f"too many token_ids in a single request"
                f" (limit={MAX_TOKEN_IDS}, got={len(token_ids)})"
            )
        if not model_name:
            raise InvalidRequest("model_name must not be empty")
        check_key_fields(model_name, cache_salt)
        contract = self._contracts().get(model_name)
        if contract is not None and contract.world_size != world_size:
            raise InvalidRequest(
                f"model {model_name!r} is registered here with world_size"
                f" {contract.world_size}, not {world_size}"
            )
        hashes = chunk_hashes(token_ids, self._chunk_size)
        if not hashes:
            self._count_prefetch("noop")
            return NodePrefetchResponse(chunks=0, status="noop")
        keys = rank_keys(hashes, model_name, world_size, cache_salt)
        request_id = uuid.uuid4().hex
        with self._lock:
            self._drop_stale_locked()
            if len(self._jobs) >= self._max_jobs:
                self._stats.prefetches["refused_busy"] = (
                    self._stats.prefetches.get("refused_busy", 0) + 1
                )
                raise Unavailable(
                    f"{len(self._jobs)} prefetch jobs are in flight or unpolled"
                    f" (limit {self._max_jobs}); poll them or retry later"
                )
            try:
                future = self._pool.submit(self._warm, keys)
            except RuntimeError as exc:  # shut down
                raise Unavailable("the server is stopping") from exc
            job = _Job(future, len(keys))
            self._jobs[request_id] = job
            self._stats.prefetches["submitted"] = self._stats.prefetches.get("submitted", 0) + 1
        future.add_done_callback(lambda _: self._finished(job))
        return NodePrefetchResponse(request_id=request_id, chunks=len(hashes), status="submitted")

    def prefetch_status(self, request_id: str) -> NodePrefetchStatus:
        with self._lock:
            job = self._jobs.get(request_id)
            if job is None:
                raise NotFound(
                    f"unknown prefetch request_id={request_id!r}"
                    " (already completed or never submitted)"
                )
            if not job.future.done():
                return NodePrefetchStatus(request_id, PENDING)
            del self._jobs[request_id]
        try:
            found, _ = job.future.result()
        except Exception as exc:  # the job failed: reported as found nothing
            log.warning("Warm prefetch %s failed: %s", request_id, exc)
            found = 0
        log.info("Warm prefetch %s completed: %d/%d keys in L1", request_id, found, job.total_keys)
        return NodePrefetchStatus(request_id, COMPLETED, found, job.total_keys)

    def _warm(self, keys: list[ObjectKey]) -> tuple[int, int]:
        """The job: L1 and L2 under the lock, then peers per rank without it. Returns
        (keys in L1 at the end, keys fetched from peers)."""
        with self._guarded.lock:
            in_l1 = sum(1 for k in keys if self._store.pool.contains(k))
            resident = set(self._store.warm(keys, self._guarded.clock()))
            self._guarded.drain_locked()
        peer = 0
        source = self._peer_source
        missing = [k for k in keys if k not in resident]
        if missing and source is not None:
            by_rank: dict[int, list[ObjectKey]] = {}
            for key in missing:  # chunk order within each rank: a fetch is of a prefix
                by_rank.setdefault(key.kv_rank, []).append(key)
            for run in by_rank.values():
                try:
                    peer += len(source.fetch_prefix(run, 0.0).fetched)
                except Exception:  # a miss for these keys, as on the lookup path
                    log.exception("Warm prefetch: peer fetch of %d keys failed", len(run))
        with self._guarded.lock:
            found = sum(1 for k in keys if self._store.pool.contains(k))
        self._count_keys(l1=in_l1, l2=len(resident) - in_l1, peer=peer, missing=len(keys) - found)
        return found, peer

    def _finished(self, job: _Job) -> None:
        with self._lock:
            job.finished_at = self._clock()
            failed = job.future.exception() is not None if not job.future.cancelled() else True
            outcome = "failed" if failed else "completed"
            self._stats.prefetches[outcome] = self._stats.prefetches.get(outcome, 0) + 1

    def _drop_stale_locked(self) -> None:
        now = self._clock()
        stale = [
            rid
            for rid, job in self._jobs.items()
            if job.finished_at is not None and now - job.finished_at > self._job_ttl_s
        ]
        for rid in stale:
            del self._jobs[rid]
        if stale:
            self._stats.prefetches["expired"] = self._stats.prefetches.get("expired", 0) + len(
                stale
            )

    def _count_prefetch(self, outcome: str) -> None:
        with self._lock:
            self._stats.prefetches[outcome] = self._stats.prefetches.get(outcome, 0) + 1

    def _count_keys(self, **by_source: int) -> None:
        with self._lock:
            for source, n in by_source.items():
                self._stats.prefetch_keys[source] = self._stats.prefetch_keys.get(source, 0) + n
