"""The state and helpers both LMCache transfer modes and the lookups share.

Keys: LMCache's server hashes the ``IPCCacheServerKey``'s tokens with the blake3 prefix
chain (the same scheme and none-hash as ``kvatlas.core.keys``) and keys each chunk by
``(chunk hash, model, kv rank, object group 0, cache salt)`` with kv rank
``pack_kv_rank(world_size, worker, world_size, worker)``: exactly kvatlas' ObjectKey,
so chunks an LMCache client stores are found by the coordinator's directory, by P2P
peers and by kvatlas engines of the same contract, and the other way round.

``MpCore`` owns the registered workers, their hash contracts, the engine-driven
transfers between prepare and commit, and the sessions; every chunk lives in the
``GuardedStore`` the kvatlas engine API shares, taken under its one lock.

Must not: parse frames (``wire``), import torch, or keep chunk bytes of its own.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Container, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

from msgspec import structs

from kvatlas.core.errors import InvalidInput
from kvatlas.core.keys import (
    HASH_ALGORITHM,
    HashContract,
    ObjectKey,
    chunk_hashes,
    pack_kv_rank,
)
from kvatlas.core.server.l1pool import LeaseId
from kvatlas.core.types import ChunkHash
from kvatlas.server.lmcache_mp.cpu_kv import ChunkGeometry, PagedKV
from kvatlas.server.lmcache_mp.hashing import QuietHasher
from kvatlas.server.lmcache_mp.sessions import Sessions
from kvatlas.server.lmcache_mp.wire import IPCKey
from kvatlas.server.storage.chunkstore import Unhashed
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


@dataclass(frozen=True, slots=True)
class KVGroup:
    """One LMCache KV group of a hybrid engine-driven worker (0.5.7 ``GroupLayout``):
    its chunks are ObjectKeys of object group = the group's index."""

    geometry: ChunkGeometry
    window_chunks: int = 0
    """The trailing chunks of a prefix this group needs for a hit (a sliding window's,
    or 1 for recurrent state); 0: every chunk (full attention)."""

    def first_needed(self, chunks: int) -> int:
        """The first chunk of a ``chunks``-chunk prefix this group must hold."""
        return 0 if self.window_chunks <= 0 else max(0, chunks - self.window_chunks)


@dataclass
class Worker:
    model: str
    world_size: int
    geometry: ChunkGeometry
    kv: PagedKV | None = None
    """Mapped KV (lmcache-driven); None for an engine-driven registration."""
    groups: tuple[KVGroup, ...] = ()
    """A hybrid engine-driven worker's LMCache KV groups (two or more); empty for one."""


_Pending = tuple[int, str, int, int]
"""(instance id, request id, start, end) of a prepared engine-driven transfer."""


class MpCore:
    """Shared state of the LMCache MP service (see ``service.LMCacheMPService``)."""

    def __init__(
        self,
        guarded: GuardedStore,
        identity: MpIdentity,
        *,
        declare_contract: Callable[[HashContract], str | None] | None = None,
        prefetch_workers: int = 4,
        transfer_mode: str = "auto",
        on_prompt: Callable[[Sequence[int], Sequence[bytes], str], None] | None = None,
    ) -> None:
        """``transfer_mode``: the modes served (``--supported-transfer-mode``).
        ``on_prompt``: told the tokens, chunk hashes and cache salt of every prompt a
        lookup or a store names (it must not block), so that the KV event publisher can
        publish the chunks stored from it with their tokens."""
        self._on_prompt = on_prompt
        self._modes = (
            {"engine_driven", "lmcache_driven"} if transfer_mode == "auto" else {transfer_mode}
        )
        self._guarded = guarded
        self._store = guarded.store
        self.identity = identity
        self._declare = declare_contract
        self._peers: PrefixFetcher | None = None
        self._lock = threading.Lock()
        self._workers: dict[int, Worker] = {}
        self._contracts: dict[str, HashContract] = {}
        self._hybrid: dict[tuple[str, int], tuple[KVGroup, ...]] = {}
        """(model, world size) -> the KV groups its hybrid workers registered: what a
        lookup, which names no worker, needs to know which chunks make a hit."""
        self._writes: dict[_Pending, list[tuple[ObjectKey, LeaseId]]] = {}
        self._reads: dict[_Pending, list[LeaseId]] = {}
        self._told_unknown: set[int] = set()
        self.sessions = Sessions()
        self._prefetch = ThreadPoolExecutor(prefetch_workers, "kvatlas-lmcache-prefetch")
        self._hasher = QuietHasher(guarded, lambda: len(self._writes) + len(self._reads))
        self.counts: Counter[str] = Counter()
        """Requests served, by operation."""
        self.refused: Counter[str] = Counter()
        """Requests refused or failed, by reason."""
        self.block_allocations = 0

    # ------------------------------------------------------------------ keys

    def _hashes(self, key: IPCKey, start: int, end: int, learn: bool = False) -> list[bytes]:
        """The chunk hashes of ``[start, end)``; ``learn``: also show the prompt up to
        ``end`` to ``on_prompt`` (lookups and stores: the chunks a store makes)."""
        cs = self.identity.chunk_size
        if start % cs or start < 0 or end < start:
            raise MpError("invalid", f"range [{start}, {end}) is not chunk-aligned ({cs})")
        tokens = key.token_ids[: min(end, len(key.token_ids))]
        try:
            hashes = chunk_hashes(tokens, cs)
        except InvalidInput as exc:
            raise MpError("invalid", str(exc)) from exc
        if learn and self._on_prompt is not None:
            self._on_prompt(tokens, [bytes(h) for h in hashes], key.cache_salt)
        return [bytes(h) for h in hashes[start // cs :]]

    def _keys(
        self, key: IPCKey, start: int, end: int, rank: int, *, learn: bool = False, group: int = 0
    ) -> list[ObjectKey]:
        """The chunk keys of ``[start, end)`` for ``rank``, in object group ``group`` (a
        hybrid worker's KV group; 0 otherwise)."""
        if key.world_size < 1 or not 0 <= rank < key.world_size:
            raise MpError("invalid", f"worker {rank} of world size {key.world_size}")
        kv_rank = pack_kv_rank(key.world_size, rank, key.world_size, rank)
        return [
            ObjectKey(ChunkHash(h), key.model_name, kv_rank, group, key.cache_salt)
            for h in self._hashes(key, start, end, learn)
        ]

    def _group_keys(
        self, key: IPCKey, start: int, end: int, rank: int, *, groups: int, learn: bool = False
    ) -> list[list[ObjectKey]]:
        """``_keys`` of each of ``groups`` object groups (the chunk hashes computed once)."""
        base = self._keys(key, start, end, rank, learn=learn)
        return [base] + [
            [structs.replace(k, object_group_id=g) for k in base] for g in range(1, groups)
        ]

    def _worker(self, instance_id: int) -> Worker:
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

    def _register(self, instance_id: int, worker: Worker) -> None:
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

    def _commit_unhashed(self, writes: Sequence[tuple[ObjectKey, LeaseId]], now: float) -> bool:
        """Commit written slots before their checksums, which the hasher computes in
        the server's quiet time (store lock held); False when any write was lost (its
        lease lapsed)."""
        ok = True
        for k, lid in writes:
            info = self._store.commit_unhashed(k, now, lid)
            if info is None:
                ok = False
                continue
            self._hasher.submit(Unhashed(k, lid, info.offset, info.size))
        return ok

    def _release(self, leases: Sequence[LeaseId]) -> None:
        if not leases:
            return
        with self._guarded.lock:
            for lid in leases:
                self._store.release(lid, HOLDER)

    def _abort(self, keys: Sequence[ObjectKey]) -> None:
        if keys:
            with self._guarded.lock:
                for k in keys:
                    self._store.abort(k)
                self._guarded.drain_locked()

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
                    lease = self._store.acquire_read(
                        k, HOLDER, now, self.identity.lease_s, checksum=False
                    )
                if lease is None:
                    for lid_ in [o[1] for o in out] + list(taken.values()):
                        self._store.release(lid_, HOLDER)
                    return None
                out.append((k, lease.lease_id, lease.offset, lease.size))
        return out
