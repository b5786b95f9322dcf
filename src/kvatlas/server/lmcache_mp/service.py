"""What each LMCache MP request (0.5.6 or 0.5.7rc2, ``wire``) does to kvatlas' store:
dispatch, management and lookups (the transfers are ``transfers``, the shared state
``core``).

Lookup: ``lookup`` answers at once; chunks missing locally are fetched from peers (the
P2P fetcher the kvatlas engine API uses) on a background thread while the client polls
``query_prefetch_status``; the hit prefix is then read-locked, ``num_kv_readers`` leases
per key, until the workers' retrieves, ``free_lookup_locks`` or ``end_session``.

Must not: parse frames (``wire``), import torch, or keep store state of its own: every
chunk lives in the ``GuardedStore`` the kvatlas engine API shares.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from kvatlas.core.keys import HashContract, ObjectKey
from kvatlas.core.server.l1pool import DeleteOutcome, LeaseId
from kvatlas.server.lmcache_mp.core import (
    HOLDER,
    WAIT_CAP_S,
    KVGroup,
    MpError,
    MpIdentity,
    PrefixFetcher,
)
from kvatlas.server.lmcache_mp.kv_checksums import Digests
from kvatlas.server.lmcache_mp.transfers import Transfers
from kvatlas.server.lmcache_mp.wire import BlockAllocation, IPCKey, ServerModuleCall

__all__ = ["LMCacheMPService", "MpError", "MpIdentity"]

log = logging.getLogger(__name__)


class LMCacheMPService(Transfers):
    """Answers decoded LMCache MP requests; ``handle`` dispatches by operation name."""

    def worker_modes(self) -> dict[str, int]:
        """Registered workers by transfer mode."""
        with self._lock:
            kv = sum(1 for w in self._workers.values() if w.kv is not None)
            return {"lmcache_driven": kv, "engine_driven": len(self._workers) - kv}

    def kv_checksums(
        self, instance_id: int, block_ids: Sequence[int], chunk_blocks: int, layerwise: bool
    ) -> Digests:
        """LMCache's ``POST /cache/checksums``: digests of a registered lmcache-driven
        worker's KV blocks. MpError ``not_registered`` for an unknown worker or one that
        registered engine-driven (the server holds no view of its KV), ``invalid`` for
        block ids outside its KV."""
        w = self._worker(instance_id)
        if w.kv is None:
            raise MpError(
                "not_registered",
                f"worker instance {instance_id} registered engine-driven: this server holds"
                " no view of its KV (the worker's own KV is where to hash it)",
            )
        return w.kv.checksums(block_ids, chunk_blocks, layerwise)

    @property
    def unhashed_chunks(self) -> int:
        """Chunks committed whose checksum is still to be computed (``_commit_unhashed``)."""
        return self._store.unhashed

    def set_peer_source(self, peers: PrefixFetcher | None) -> None:
        self._peers = peers

    def set_contract_declarer(self, declare: Callable[[HashContract], str | None]) -> None:
        self._declare = declare

    def close(self) -> None:
        self._prefetch.shutdown(wait=False, cancel_futures=True)
        self._hasher.close()
        with self._lock:
            workers, self._workers = list(self._workers.values()), {}
        for w in workers:
            if w.kv is not None:
                w.kv.close()

    def handle(self, operation: str, args: tuple[Any, ...]) -> Any:
        """The result of one request; MpError (refusals) and other exceptions propagate
        to the transport, which answers them with an error reply."""
        self.counts[operation] += 1
        handler: Callable[..., Any] = getattr(self, f"op_{operation}")
        with self._hasher.busy():  # no checksums computed meanwhile (``hashing``)
            return handler(*args)

    # ------------------------------------------------------------------ management

    def op_get_chunk_size(self) -> int:
        return self.identity.chunk_size

    def op_negotiate_chunk_size(self, required_chunk_alignment: int) -> int:
        """0.5.7: the chunk size, if it is a multiple of the model's block alignment.
        Answered as 0.5.7's server answers once its chunk size is selected: this one's is
        fixed (--chunk-size), so it is never rounded up."""
        cs = self.identity.chunk_size
        if required_chunk_alignment < 1:
            raise MpError(
                "invalid",
                f"required_chunk_alignment must be positive, got {required_chunk_alignment}",
            )
        if cs % required_chunk_alignment:
            raise MpError(
                "invalid",
                f"LMCache chunk size {cs} must be a multiple of required chunk alignment"
                f" {required_chunk_alignment}. This kvatlas server's chunk size is fixed"
                " (--chunk-size); models that require incompatible alignments must use"
                " separate servers.",
            )
        return cs

    def op_get_experimental(self) -> list[str]:
        return []  # no kv_event_stream: workers report their own stores to vLLM

    def op_ping(self, instance_id: int | None) -> bool:
        """True, except once for a worker this process does not know (the server
        restarted under it): LMCache's heartbeat then sees unhealthy, and on the next
        True re-registers its KV cache (its recovery callback)."""
        if instance_id is None:
            return True
        with self._lock:
            if instance_id in self._workers or instance_id in self._told_unknown:
                return True
            self._told_unknown.add(instance_id)
        log.info("ping from unregistered LMCache worker %d: asking it to re-register", instance_id)
        return False

    def op_noop(self) -> str:
        return "OK"

    def op_server_module_call(self, call: ServerModuleCall) -> dict[str, Any]:
        """LMCache's answer to a plug-in method its server does not serve, word for word
        (``ExtServerModuleRouter``): this server loads no LMCache server modules, so
        every method is unknown. The client's call fails with this reason at once."""
        self.refused["server_module"] += 1
        return {
            "success": False,
            "payload": b"",
            "error": f"unknown server module method: {call.method}",
        }

    def op_server_module_affinity_call(self, call: ServerModuleCall) -> dict[str, Any]:
        """0.5.7: a plug-in method run on the calling client's affinity thread, in order
        with its stores and retrieves. Its only meaning is a plug-in's, and this server
        has none: answered as ``server_module_call`` (LMCache's own error reply)."""
        return self.op_server_module_call(call)

    def op_report_block_allocation(
        self, instance_id: int, model_name: str, records: list[BlockAllocation]
    ) -> None:
        self.block_allocations += len(records)

    def op_clear(self, force: bool) -> None:
        """vLLM's prefix-cache reset: end the sessions' read leases, then delete every
        unlocked L1 chunk of the models LMCache clients registered here (DELETE events
        follow). Chunks a reader holds stay even with ``force``: bytes are never pulled
        from under a copy. Other models' chunks (kvatlas engines') and L2 stay."""
        self._release(self.sessions.clear())
        with self._lock:
            models = set(self._contracts)
        deleted = kept = 0
        with self._guarded.lock:
            pool = self._store.pool
            for info in pool.slots():
                if info.key.model_name not in models or not info.committed:
                    continue
                if pool.delete(info.key) is DeleteOutcome.DELETED:
                    deleted += 1
                else:
                    kept += 1
            self._guarded.drain_locked()
        log.info(
            "LMCache clear(force=%s) of models %s: %d L1 chunks deleted, %d kept (locked)",
            force,
            sorted(models),
            deleted,
            kept,
        )

    # ------------------------------------------------------------------ lookup

    def op_lookup(self, key: IPCKey, tp_size: int) -> None:
        if key.num_kv_readers < 1:
            raise MpError(
                "version",
                "num_kv_readers=0: the client predates LMCache 0.5.6's IPCCacheServerKey",
            )
        with self._lock:
            hybrid = self._hybrid.get((key.model_name, key.world_size))
        if hybrid:
            _, stale = self.sessions.begin(key.request_id)
            self._release(stale)
            self._lock_hybrid(key, hybrid)
            return
        keys = [
            self._keys(key, 0, key.end, rank, learn=rank == 0)
            for rank in range(max(key.world_size, 1))
        ]  # per rank, per chunk
        _, stale = self.sessions.begin(key.request_id)
        self._release(stale)
        n = len(keys[0])
        with self._guarded.lock:
            now = self._guarded.clock()
            hit = min(self._store.lookup_prefix(k, now) for k in keys) if n else 0
        if hit < n and self._peers is not None:
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
        readers = key.num_kv_readers
        held: dict[ObjectKey, list[LeaseId]] = {}
        accessed: list[tuple[ObjectKey, int]] = []
        hit = 0
        with self._guarded.lock:
            now = self._guarded.clock()
            self._store.lookup_prefix(keys[0], now)  # promote L2 hits of rank 0 too
            for i in range(len(keys[0])):
                got: dict[ObjectKey, list[LeaseId]] = {}
                ok = True
                for rank_keys in keys:
                    k = rank_keys[i]
                    for _ in range(readers):
                        lease = self._store.acquire_read(
                            k, HOLDER, now, self.identity.lease_s, checksum=False
                        )
                        if lease is None:
                            ok = False
                            break
                        got.setdefault(k, []).append(lease.lease_id)
                        if len(got[k]) == 1:
                            accessed.append((k, lease.size))
                    if not ok:
                        break
                if not ok:
                    for lids in got.values():
                        for lid in lids:
                            self._store.release(lid, HOLDER)
                    accessed = [a for a in accessed if a[0] not in got]
                    break
                held.update(got)
                hit += 1
            self._guarded.drain_locked(accessed)
        if session is None or self.sessions.get(key.request_id) is not session:
            self._release([lid for lids in held.values() for lid in lids])  # ended meanwhile
            return
        session.leases = held
        session.hit_chunks = hit
        session.done.set()

    def _lock_hybrid(self, key: IPCKey, groups: Sequence[KVGroup]) -> None:
        """A hybrid model's hit: the longest prefix of which every KV group holds the
        chunks it needs (a full-attention group all of them, a windowed one its trailing
        window: its earlier chunks were never stored), on every rank; those chunks are
        read-locked as ``_lock_prefix`` locks. Local only (no peer fetch)."""
        session = self.sessions.get(key.request_id)
        ranks = range(max(key.world_size, 1))
        keys = [
            self._group_keys(key, 0, key.end, r, groups=len(groups), learn=r == 0) for r in ranks
        ]  # [rank][group][chunk]
        n = len(keys[0][0])
        held: dict[ObjectKey, list[LeaseId]] = {}
        accessed: list[tuple[ObjectKey, int]] = []
        hit = 0
        with self._guarded.lock:
            now = self._guarded.clock()
            have = [
                [[self._store.lookup_prefix([k], now) == 1 for k in gk] for gk in rk] for rk in keys
            ]
            need: list[tuple[int, int, int]] = []  # (rank, group, chunk)
            for p in range(n, 0, -1):
                need = [
                    (r, g, c)
                    for r in ranks
                    for g, grp in enumerate(groups)
                    for c in range(grp.first_needed(p), p)
                ]
                if all(have[r][g][c] for r, g, c in need):
                    hit = p
                    break
            for r, g, c in need if hit else []:
                k = keys[r][g][c]
                for _ in range(key.num_kv_readers):
                    lease = self._store.acquire_read(
                        k, HOLDER, now, self.identity.lease_s, checksum=False
                    )
                    if lease is None:  # present a moment ago, under the same lock
                        hit = 0
                        break
                    held.setdefault(k, []).append(lease.lease_id)
                    if len(held[k]) == 1:
                        accessed.append((k, lease.size))
                if not hit:
                    break
            if not hit:
                for lids in held.values():
                    for lid in lids:
                        self._store.release(lid, HOLDER)
                held, accessed = {}, []
            self._guarded.drain_locked(accessed)
        if session is None or self.sessions.get(key.request_id) is not session:
            self._release([lid for lids in held.values() for lid in lids])
            return
        session.leases = held
        session.hit_chunks = hit
        session.done.set()

    def op_query_prefetch_status(self, request_id: str) -> int | None:
        s = self.sessions.get(request_id)
        if s is None:
            return 0  # LMCache answers 0 for a request id it does not know
        return s.hit_chunks if s.done.is_set() else None

    def op_wait_prefetch_status(self, request_id: str, timeout: float) -> int | None:
        s = self.sessions.get(request_id)
        if s is None:
            return 0
        # Capped: the wait holds one of the engine API's workers.
        s.done.wait(max(0.0, min(timeout, WAIT_CAP_S)))
        return s.hit_chunks if s.done.is_set() else None

    def op_free_lookup_locks(
        self, key: IPCKey, tp_size: int, extra_ranges: Sequence[tuple[int, int]] = ()
    ) -> None:
        """Release the session's read locks on ``[start, end)``; 0.5.7's
        ``extra_ranges``: also on each ``(start, end)`` of the request's earlier,
        abandoned lookups (each ends at that lookup's hit boundary)."""
        ranges = [(key.start, key.end), *extra_ranges]
        with self._lock:
            groups = len(self._hybrid.get((key.model_name, key.world_size), ())) or 1
        keys = [
            k
            for start, end in ranges
            if start < end
            for rank in range(max(key.world_size, 1))
            for g_keys in self._group_keys(key, start, end, rank, groups=groups)
            for k in g_keys
        ]
        if keys:
            self._release(self.sessions.take_all(key.request_id, keys))

    def op_end_session(self, request_id: str) -> None:
        _, leases = self.sessions.end(request_id)
        self._release(leases)
