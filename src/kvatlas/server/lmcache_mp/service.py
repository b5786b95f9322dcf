"""What each LMCache 0.5.6 MP request does to kvatlas' store (both CPU transfer modes).

Keys: LMCache's server hashes the ``IPCCacheServerKey``'s tokens with the blake3 prefix
chain (the same scheme and none-hash as ``kvatlas.core.keys``) and keys each chunk by
``(chunk hash, model, kv rank, object group 0, cache salt)`` with kv rank
``pack_kv_rank(world_size, worker, world_size, worker)``: exactly kvatlas' ObjectKey,
so chunks an LMCache client stores are found by the coordinator's directory, by P2P
peers and by kvatlas engines of the same contract, and the other way round.

Engine-driven mode (the worker copies; no CUDA needed in the server, works for a GPU
worker too): the shared-memory pool LMCache advertises on registration is kvatlas' L1
region itself. ``prepare_store`` write-locks L1 slots and hands their offsets (with the
chunk's tensor shape) to the worker, which maps the region by name and gathers its KV
straight into them; ``commit_store`` checksums and commits the slots. ``prepare_retrieve``
read-locks the chunks (taking over the lookup's leases) and hands their offsets;
``commit_retrieve`` releases them. No copy in the server, no pickle: a worker that falls
back to LMCache's pickle transport is refused (``commit_store`` answers False, counted),
since unpickling a client's bytes would run its code in the server.

Lmcache-driven mode over CPU POSIX SHM: the worker's paged KV is mapped by the server
(``cpu_kv``), which gathers chunks into L1 slots on ``store`` and scatters them back on
``retrieve``. Both modes write the same chunk bytes (``[2, layers, tokens, hidden]``).

Lookup: ``lookup`` answers at once; chunks missing locally are fetched from peers (the
P2P fetcher the kvatlas engine API uses) on a background thread while the client polls
``query_prefetch_status``; the hit prefix is then read-locked, ``num_kv_readers`` leases
per key, until the workers' retrieves, ``free_lookup_locks`` or ``end_session``.

Must not: parse frames (``wire``), import torch, or keep store state of its own: every
chunk lives in the ``GuardedStore`` the kvatlas engine API shares.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Container, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from kvatlas.core.checksum import checksum
from kvatlas.core.errors import InvalidInput
from kvatlas.core.keys import (
    HASH_ALGORITHM,
    HashContract,
    ObjectKey,
    chunk_hashes,
    pack_kv_rank,
)
from kvatlas.core.l1pool import DeleteOutcome, LeaseId, Refusal, Reserved
from kvatlas.core.types import ChunkHash
from kvatlas.server.lmcache_mp.cpu_kv import ITEMSIZES, ChunkGeometry, CpuPagedKV, PagedKV
from kvatlas.server.lmcache_mp.sessions import Sessions
from kvatlas.server.lmcache_mp.wire import (
    BlockAllocation,
    EngineDrivenRegistration,
    IpcDescriptor,
    IPCKey,
)
from kvatlas.server.storage.guarded import GuardedStore

log = logging.getLogger(__name__)

WAIT_CAP_S = 1.0
"""The longest ``wait_prefetch_status`` holds a worker; a later poll sees the rest."""

HOLDER = "lmcache-mp"
"""The lease holder of every lease this protocol takes."""


class _Fetched(Protocol):
    @property
    def fetched(self) -> Container[ObjectKey]: ...


class PrefixFetcher(Protocol):
    """The P2P fetcher (``kvatlas.server.p2p.fetch.PeerFetcher``), called without locks."""

    def fetch_prefix(self, keys: Sequence[ObjectKey], recompute_s: float) -> _Fetched: ...


class MpError(InvalidInput):
    """A request kvatlas refuses; ``reason`` is the counter label."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class MpIdentity:
    instance_id: str
    incarnation: int
    chunk_size: int
    lease_s: float


@dataclass
class _Worker:
    model: str
    world_size: int
    geometry: ChunkGeometry
    kv: PagedKV | None = None
    """Mapped KV (lmcache-driven); None for an engine-driven registration."""


_Pending = tuple[int, str, int, int]
"""(instance id, request id, start, end) of a prepared engine-driven transfer."""


class LMCacheMPService:
    """Answers decoded LMCache MP requests; ``handle`` dispatches by operation name."""

    def __init__(
        self,
        guarded: GuardedStore,
        identity: MpIdentity,
        *,
        declare_contract: Callable[[HashContract], str | None] | None = None,
        prefetch_workers: int = 4,
        transfer_mode: str = "auto",
    ) -> None:
        """``transfer_mode``: the modes served (``--supported-transfer-mode``)."""
        self._modes = (
            {"engine_driven", "lmcache_driven"} if transfer_mode == "auto" else {transfer_mode}
        )
        self._guarded = guarded
        self._store = guarded.store
        self.identity = identity
        self._declare = declare_contract
        self._peers: PrefixFetcher | None = None
        self._lock = threading.Lock()
        self._workers: dict[int, _Worker] = {}
        self._contracts: dict[str, HashContract] = {}
        self._writes: dict[_Pending, list[tuple[ObjectKey, LeaseId]]] = {}
        self._reads: dict[_Pending, list[LeaseId]] = {}
        self._told_unknown: set[int] = set()
        self.sessions = Sessions()
        self._prefetch = ThreadPoolExecutor(prefetch_workers, "kvatlas-lmcache-prefetch")
        self.counts: Counter[str] = Counter()
        """Requests served, by operation."""
        self.refused: Counter[str] = Counter()
        """Requests refused or failed, by reason."""
        self.block_allocations = 0

    def worker_modes(self) -> dict[str, int]:
        """Registered workers by transfer mode."""
        with self._lock:
            kv = sum(1 for w in self._workers.values() if w.kv is not None)
            return {"lmcache_driven": kv, "engine_driven": len(self._workers) - kv}

    def set_peer_source(self, peers: PrefixFetcher | None) -> None:
        self._peers = peers

    def set_contract_declarer(self, declare: Callable[[HashContract], str | None]) -> None:
        self._declare = declare

    def close(self) -> None:
        self._prefetch.shutdown(wait=False, cancel_futures=True)
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
        return handler(*args)

    # ------------------------------------------------------------------ keys

    def _hashes(self, key: IPCKey, start: int, end: int) -> list[bytes]:
        cs = self.identity.chunk_size
        if start % cs or start < 0 or end < start:
            raise MpError("invalid", f"range [{start}, {end}) is not chunk-aligned ({cs})")
        try:
            hashes = chunk_hashes(key.token_ids[: min(end, len(key.token_ids))], cs)
        except InvalidInput as exc:
            raise MpError("invalid", str(exc)) from exc
        return [bytes(h) for h in hashes[start // cs :]]

    def _keys(self, key: IPCKey, start: int, end: int, rank: int) -> list[ObjectKey]:
        if key.world_size < 1 or not 0 <= rank < key.world_size:
            raise MpError("invalid", f"worker {rank} of world size {key.world_size}")
        kv_rank = pack_kv_rank(key.world_size, rank, key.world_size, rank)
        return [
            ObjectKey(ChunkHash(h), key.model_name, kv_rank, 0, key.cache_salt)
            for h in self._hashes(key, start, end)
        ]

    def _worker(self, instance_id: int) -> _Worker:
        with self._lock:
            w = self._workers.get(instance_id)
        if w is None:
            raise MpError(
                "not_registered",
                f"worker instance {instance_id} registered no KV cache with server"
                f" {self.identity.instance_id} (restarted? the worker re-registers)",
            )
        return w

    def _check_mode(self, mode: str) -> None:
        if mode not in self._modes:
            raise MpError(
                "unsupported",
                f"{mode} transfer is off on this server (--supported-transfer-mode"
                f" {' '.join(sorted(self._modes))})",
            )

    def _register(self, instance_id: int, worker: _Worker) -> None:
        g = worker.geometry
        contract = HashContract(
            model_name=worker.model,
            chunk_size=self.identity.chunk_size,
            hash_algorithm=HASH_ALGORITHM,
            kv_dtype=g.dtype,
            # LMCache's engine-driven registration carries heads x head dim as one
            # hidden size, so both LMCache modes declare (layers, 1, hidden): one model
            # served by either mode on any server has one contract.
            kv_layout=(g.layers, 1, g.hidden),
            world_size=worker.world_size,
        )
        with self._lock:
            known = self._contracts.get(worker.model)
        if known is not None:
            if known.mismatch(contract):
                raise MpError("contract", f"model {worker.model}: {known.mismatch(contract)}")
        elif self._declare is not None:
            refusal = self._declare(contract)
            if refusal is not None:
                raise MpError("contract", f"the coordinator refused the contract: {refusal}")
        with self._lock:
            self._contracts.setdefault(worker.model, contract)
            old = self._workers.pop(instance_id, None)
            self._workers[instance_id] = worker
        if old is not None and old.kv is not None:
            old.kv.close()
        log.info(
            "LMCache worker %d registered model %s (%s, world size %d, chunk %s %s, %s)"
            " on instance %s incarnation %d",
            instance_id,
            worker.model,
            "engine-driven" if worker.kv is None else f"lmcache-driven, {type(worker.kv).__name__}",
            worker.world_size,
            g.shape,
            g.dtype,
            f"{g.nbytes} bytes",
            self.identity.instance_id,
            self.identity.incarnation,
        )

    def _release(self, leases: Sequence[LeaseId]) -> None:
        if not leases:
            return
        with self._guarded.lock:
            for lid in leases:
                self._store.release(lid, HOLDER)

    # ------------------------------------------------------------------ management

    def op_get_chunk_size(self) -> int:
        return self.identity.chunk_size

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

    # ------------------------------------------------------------------ registration

    def op_register_kv_cache_engine_driven_context(
        self, p: EngineDrivenRegistration
    ) -> dict[str, Any]:
        self._check_mode("engine_driven")
        if p.dtype_str not in ITEMSIZES:
            raise MpError("invalid", f"KV dtype {p.dtype_str!r} not one of {sorted(ITEMSIZES)}")
        slots = p.num_physical_slots or self.identity.chunk_size
        if slots != self.identity.chunk_size:
            raise MpError(
                "invalid",
                f"{slots} physical slots per chunk; this server stores {self.identity.chunk_size}"
                "-token chunks (--chunk-size)",
            )
        geometry = ChunkGeometry(
            p.num_layers, slots, p.hidden_dim_size, p.dtype_str, 1 if p.use_mla else 2
        )
        self._register(p.instance_id, _Worker(p.model_name, p.world_size, geometry))
        region = self._store.region
        return {"shm_name": region.name, "pool_size": region.size}

    def op_unregister_kv_cache_engine_driven_context(self, instance_id: int) -> None:
        self.op_unregister_kv_cache(instance_id)

    def op_register_kv_cache(  # noqa: PLR0917 (LMCache's positional arguments)
        self,
        instance_id: int,
        kv_caches: list[Any],
        model_name: str,
        world_size: int,
        engine_type: str,
        layout_hints: dict[str, Any],
        engine_group_infos: list[Any],
    ) -> None:
        self._check_mode("lmcache_driven")
        descs = [d for d in kv_caches if isinstance(d, IpcDescriptor)]
        if len(descs) != len(kv_caches):
            raise MpError("invalid", "register_kv_cache: KV tensors must be IPC descriptors")
        kinds = {d.type for d in descs}
        if len(engine_group_infos) > 1:
            raise MpError("unsupported", "hybrid KV cache groups are not supported")
        hint = layout_hints.get("kv_layout")
        kv: PagedKV
        if kinds == {"cpu_shm"}:
            # LMCache reads CPU KV without a hint as HND (vLLM's CPU attention layout)
            kv = CpuPagedKV(descs, self.identity.chunk_size, str(hint or "HND"))
        elif kinds == {"cuda"}:
            # Only now: torch stays out of a server no CUDA worker registers with.
            from kvatlas.server.lmcache_mp import cuda_kv  # noqa: PLC0415 (loads torch)

            kv = cuda_kv.CudaPagedKV(descs, self.identity.chunk_size, str(hint or "NHD"))
        else:
            raise MpError(
                "unsupported",
                f"KV tensors of kind {sorted(kinds)}: this kvatlas server maps CPU POSIX SHM"
                " and 'cuda' (PyTorch shared storage) KV. Other workers select engine-driven"
                ' transfer ("lmcache.mp.mp_transfer_mode": "engine_driven" in'
                " kv_connector_extra_config, or LMCACHE_MP_TRANSFER_MODE=engine_driven)",
            )
        try:
            self._register(instance_id, _Worker(model_name, world_size, kv.geometry, kv))
        except BaseException:
            kv.close()
            raise

    def op_unregister_kv_cache(self, instance_id: int) -> None:
        with self._lock:
            w = self._workers.pop(instance_id, None)
            writes = [k for k in self._writes if k[0] == instance_id]
            reads = [k for k in self._reads if k[0] == instance_id]
            aborted = [key for k in writes for key, _ in self._writes.pop(k)]
            released = [lid for k in reads for lid in self._reads.pop(k)]
        if w is None:
            log.warning("unregister of unknown LMCache worker %d", instance_id)
            return
        with self._guarded.lock:
            for key in aborted:
                self._store.abort(key)
            for lid in released:
                self._store.release(lid, HOLDER)
            self._guarded.drain_locked()
        if w.kv is not None:
            w.kv.close()
        log.info("LMCache worker %d unregistered", instance_id)

    # ------------------------------------------------------------------ lookup

    def op_lookup(self, key: IPCKey, tp_size: int) -> None:
        if key.num_kv_readers < 1:
            raise MpError(
                "version",
                "num_kv_readers=0: the client predates LMCache 0.5.6's IPCCacheServerKey",
            )
        keys = [
            self._keys(key, 0, key.end, rank) for rank in range(max(key.world_size, 1))
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
                        lease = self._store.acquire_read(k, HOLDER, now, self.identity.lease_s)
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

    def op_free_lookup_locks(self, key: IPCKey, tp_size: int) -> None:
        if key.start >= key.end:
            return
        keys = [
            k
            for rank in range(max(key.world_size, 1))
            for k in self._keys(key, key.start, key.end, rank)
        ]
        self._release(self.sessions.take_all(key.request_id, keys))

    def op_end_session(self, request_id: str) -> None:
        _, leases = self.sessions.end(request_id)
        self._release(leases)

    # ------------------------------------------------------------------ engine-driven

    def op_prepare_store(self, key: IPCKey, instance_id: int) -> dict[str, Any]:
        w = self._worker(instance_id)
        keys = self._keys(key, key.start, key.end, key.worker_id or 0)
        g = w.geometry
        slots: list[dict[str, Any]] = []
        indices: list[int] = []
        reserved: list[tuple[ObjectKey, LeaseId]] = []
        with self._guarded.lock:
            now = self._guarded.clock()
            for i, k in enumerate(keys):
                res = self._store.reserve(k, g.nbytes, now, self.identity.lease_s, HOLDER)
                if isinstance(res, Reserved):
                    s = res.slot
                    slots.append(
                        {"offset": s.offset, "length": s.size, "shape": g.shape, "dtype": g.dtype}
                    )
                    indices.append(i)
                    reserved.append((k, s.lease_id))
                elif res.reason is Refusal.NO_SPACE:
                    self.refused["no_space"] += 1
            self._guarded.drain_locked()
        if reserved:
            pending = (instance_id, key.request_id, key.start, key.end)
            with self._lock:
                old = self._writes.pop(pending, [])
                self._writes[pending] = reserved
            self._abort([k for k, _ in old])
        return {"context": {"slots": slots, "chunk_indices": indices}}

    def _abort(self, keys: Sequence[ObjectKey]) -> None:
        if keys:
            with self._guarded.lock:
                for k in keys:
                    self._store.abort(k)
                self._guarded.drain_locked()

    def op_commit_store(self, key: IPCKey, instance_id: int, data: bytes) -> bool:
        self._worker(instance_id)
        pending = (instance_id, key.request_id, key.start, key.end)
        with self._lock:
            reserved = self._writes.pop(pending, None)
        if data:
            self._abort([k for k, _ in reserved or []])
            self.refused["pickle_refused"] += 1
            log.warning(
                "LMCache worker %d sent a pickled store (it could not map the L1 region %s):"
                " refused, kvatlas never unpickles client data",
                instance_id,
                self._store.region.name,
            )
            return False
        if reserved is None:
            return False
        ok = True
        with self._guarded.lock:
            now = self._guarded.clock()
            for k, lid in reserved:
                info = self._store.pool.get(k)
                if info is None or info.committed:
                    ok = False
                    continue
                digest = checksum(self._store.region.view(info.offset, info.size))
                ok = self._store.commit(k, now, digest, lid) is not None and ok
            self._guarded.drain_locked()
        return ok

    def _read_leases(
        self, key: IPCKey, keys: Sequence[ObjectKey]
    ) -> list[tuple[ObjectKey, LeaseId, int, int]] | None:
        """A read lease per key (the lookup's, else a new one) as (key, lease, offset,
        size); None, holding nothing, when any key is missing."""
        taken = self.sessions.take(key.request_id, keys)
        out: list[tuple[ObjectKey, LeaseId, int, int]] = []
        with self._guarded.lock:
            now = self._guarded.clock()
            if any(k not in taken for k in keys):
                self._store.lookup_prefix(keys, now)
            for k in keys:
                lid = taken.pop(k, None)
                lease = self._store.pool.read_lease(lid) if lid is not None else None
                if lease is None:
                    lease = self._store.acquire_read(k, HOLDER, now, self.identity.lease_s)
                if lease is None:
                    for lid_ in [o[1] for o in out] + list(taken.values()):
                        self._store.release(lid_, HOLDER)
                    return None
                out.append((k, lease.lease_id, lease.offset, lease.size))
        return out

    def op_prepare_retrieve(self, key: IPCKey, instance_id: int) -> dict[str, Any]:
        w = self._worker(instance_id)
        keys = self._keys(key, key.start, key.end, key.worker_id or 0)
        leases = self._read_leases(key, keys) if keys else None
        if not leases:
            return {"success": False, "data": b"", "context": {}}
        g = w.geometry
        if any(size != g.nbytes for _, _, _, size in leases):
            self._release([lid for _, lid, _, _ in leases])
            raise MpError("contract", f"stored chunks are not {g.nbytes} bytes of {g.shape}")
        pending = (instance_id, key.request_id, key.start, key.end)
        with self._lock:
            old = self._reads.pop(pending, [])
            self._reads[pending] = [lid for _, lid, _, _ in leases]
        self._release(old)
        slots = [
            {"offset": off, "length": size, "shape": g.shape, "dtype": g.dtype}
            for _, _, off, size in leases
        ]
        return {"success": True, "data": b"", "context": {"slots": slots}}

    def op_commit_retrieve(self, key: IPCKey, instance_id: int) -> bool:
        pending = (instance_id, key.request_id, key.start, key.end)
        with self._lock:
            leases = self._reads.pop(pending, [])
        self._release(leases)
        return True

    # ------------------------------------------------------------------ lmcache-driven

    def _mapped(self, instance_id: int) -> PagedKV:
        kv = self._worker(instance_id).kv
        if kv is None:
            raise MpError("invalid", f"worker {instance_id} registered engine-driven, not KV")
        return kv

    def op_store(
        self, key: IPCKey, instance_id: int, block_ids: list[list[int]], event: bytes
    ) -> tuple[bytes, bool]:
        kv = self._mapped(instance_id)
        if len(block_ids) != 1:
            raise MpError("unsupported", f"{len(block_ids)} KV groups; one is supported")
        keys = self._keys(key, key.start, key.end, key.worker_id or 0)
        nbytes = kv.geometry.nbytes
        if len(block_ids[0]) < len(keys) * kv.blocks_per_chunk:
            log.warning("store of %s: too few block ids for %d chunks", key.request_id, len(keys))
            return b"", False
        ok = True
        kv.begin(event)
        for i, k in enumerate(keys):
            with self._guarded.lock:
                now = self._guarded.clock()
                res = self._store.reserve(k, nbytes, now, self.identity.lease_s, HOLDER)
                self._guarded.drain_locked()
            if not isinstance(res, Reserved):
                ok = ok and res.reason is not Refusal.NO_SPACE
                continue
            view = self._store.slot_view(res.slot)
            try:
                kv.gather(block_ids[0], i, view)
                digest = checksum(view)
            except BaseException:
                self._abort([k])
                raise
            with self._guarded.lock:
                done = self._store.commit(k, self._guarded.clock(), digest, res.slot.lease_id)
                self._guarded.drain_locked()
            ok = ok and done is not None
        return kv.end(), ok

    def op_retrieve(
        self,
        key: IPCKey,
        instance_id: int,
        block_ids: list[list[int]],
        event: bytes,
        skip_first_n_tokens: int,
    ) -> tuple[bytes, bool]:
        kv = self._mapped(instance_id)
        if len(block_ids) != 1:
            raise MpError("unsupported", f"{len(block_ids)} KV groups; one is supported")
        keys = self._keys(key, key.start, key.end, key.worker_id or 0)
        if not keys or len(block_ids[0]) < len(keys) * kv.blocks_per_chunk:
            self._release(list(self.sessions.take(key.request_id, keys).values()))
            return b"", False
        leases = self._read_leases(key, keys)
        if leases is None:
            return b"", False
        try:
            kv.begin(event)
            skip = max(0, skip_first_n_tokens) // kv.block_size
            for i, (_, _, off, size) in enumerate(leases):
                if size != kv.geometry.nbytes:
                    raise MpError(
                        "contract",
                        f"stored chunk of {size} bytes, worker expects {kv.geometry.nbytes}",
                    )
                first = max(0, skip - i * kv.blocks_per_chunk)
                if first < kv.blocks_per_chunk:
                    kv.scatter(block_ids[0], i, self._store.region.view(off, size), first)
            handle = kv.end()
        finally:
            self._release([lid for _, lid, _, _ in leases])
        return handle, True
