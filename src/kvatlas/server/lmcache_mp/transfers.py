"""LMCache's two transfer modes on kvatlas' store.

Engine-driven mode (the worker copies; no CUDA needed in the server, works for a GPU
worker too): the shared-memory pool LMCache advertises on registration is kvatlas' L1
region itself. ``prepare_store`` write-locks L1 slots and hands their offsets (with the
chunk's tensor shape) to the worker, which maps the region by name and gathers its KV
straight into them; ``commit_store`` commits the slots. ``prepare_retrieve``
read-locks the chunks (taking over the lookup's leases) and hands their offsets;
``commit_retrieve`` releases them. No copy in the server, no pickle: a worker that falls
back to LMCache's pickle transport is refused (``commit_store`` answers False, counted),
since unpickling a client's bytes would run its code in the server.

A hybrid model's worker (0.5.7: full attention beside sliding-window or recurrent
layers, one LMCache KV group each) transfers engine-driven only: each group's chunks are
ObjectKeys of their own object group, in the group's own geometry; a window group's
chunks before its window are never written (``skipped_chunks``: all their blocks are the
null block) and never asked for (``prepare_retrieve`` and the lookup want its window).

Lmcache-driven mode: the worker's paged KV is mapped by the server (``cpu_kv`` for CPU
POSIX SHM, ``cuda_kv`` for CUDA IPC handles, loaded only then), which gathers chunks
into L1 slots on ``store`` and scatters them back on ``retrieve``. Both modes write the
same chunk bytes (``[2, layers, tokens, hidden]``), so either retrieves the other's. A
chunk whose block ids are all the null block (``cpu_kv.NULL_BLOCK_ID``) holds no KV: it
is not stored, as LMCache's servers skip it, and no retrieve writes into that block.

Both modes commit a chunk before its checksum (``StoreSide.commit``): the worker
gives none, and hashing tens of MiB would sit in the store's latency. The checksum is
computed off the lock once the workers are quiet (``hashing``); a reader that needs it
sooner computes it then: a demotion to L2 (``ChunkStore``), a kvatlas engine's lookup
and a peer's ``lookup_and_lock`` (both off the lock, ``GuardedStore.settle_unhashed``;
a peer's up to 64 MiB per request, past which the chunk is left out until known). A
local retrieve needs none.

``Transfers`` also answers (un)registrations, which ``Workers`` checks and records: an
unregistering worker's open transfers (``OpenTransfers``, prepared and not yet
committed) are aborted and released.

Must not: parse frames (``wire``), take the store's lock (``StoreSide`` does), or import
torch at module level.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Sequence
from typing import Any

from kvatlas.core.keys import ObjectKey
from kvatlas.core.server.l1pool import LeaseId, Refusal, Reserved
from kvatlas.server.lmcache_mp.core import ChunkKeys, KVGroup, MpError
from kvatlas.server.lmcache_mp.cpu_kv import NULL_BLOCK_ID
from kvatlas.server.lmcache_mp.sessions import Sessions
from kvatlas.server.lmcache_mp.store_side import ReadSlot, StoreSide
from kvatlas.server.lmcache_mp.wire import EngineDrivenRegistration, IPCKey
from kvatlas.server.lmcache_mp.workers import Workers

log = logging.getLogger(__name__)

_Pending = tuple[int, str, int, int]
"""(instance id, request id, start, end) of a prepared engine-driven transfer."""


class OpenTransfers:
    """Engine-driven transfers between their prepare and their commit: the write leases
    of a ``prepare_store``, the read leases of a ``prepare_retrieve``. Their count is
    what the ``QuietHasher`` waits on (the worker copies meanwhile)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._writes: dict[_Pending, list[tuple[ObjectKey, LeaseId]]] = {}
        self._reads: dict[_Pending, list[LeaseId]] = {}

    def __len__(self) -> int:
        return len(self._writes) + len(self._reads)

    def open_writes(
        self, p: _Pending, reserved: list[tuple[ObjectKey, LeaseId]]
    ) -> list[tuple[ObjectKey, LeaseId]]:
        """Record a prepared store; the writes of the one it replaces (to abort)."""
        with self._lock:
            old = self._writes.pop(p, [])
            self._writes[p] = reserved
        return old

    def close_writes(self, p: _Pending) -> list[tuple[ObjectKey, LeaseId]] | None:
        with self._lock:
            return self._writes.pop(p, None)

    def open_reads(self, p: _Pending, leases: list[LeaseId]) -> list[LeaseId]:
        """Record a prepared retrieve; the leases of the one it replaces (to release)."""
        with self._lock:
            old = self._reads.pop(p, [])
            self._reads[p] = leases
        return old

    def close_reads(self, p: _Pending) -> list[LeaseId]:
        with self._lock:
            return self._reads.pop(p, [])

    def drop_instance(self, instance_id: int) -> tuple[list[ObjectKey], list[LeaseId]]:
        """Forget a worker's open transfers: the keys to abort, the leases to release."""
        with self._lock:
            writes = [k for k in self._writes if k[0] == instance_id]
            reads = [k for k in self._reads if k[0] == instance_id]
            aborted = [key for k in writes for key, _ in self._writes.pop(k)]
            released = [lid for k in reads for lid in self._reads.pop(k)]
        return aborted, released


class Transfers:
    """The registration and transfer requests of both modes."""

    def __init__(
        self,
        workers: Workers,
        keys: ChunkKeys,
        store: StoreSide,
        sessions: Sessions,
        open_transfers: OpenTransfers,
    ) -> None:
        """``sessions``: the lookups' sessions, whose read leases a retrieve takes over."""
        self._workers = workers
        self._keys = keys
        self._store = store
        self._sessions = sessions
        self._open = open_transfers
        self.refused: Counter[str] = Counter()
        """Transfers refused or failed, by reason (``no_space``, ``pickle_refused``)."""

    # ------------------------------------------------------------------ registration

    def register_kv_cache_engine_driven_context(
        self, p: EngineDrivenRegistration
    ) -> dict[str, Any]:
        """A worker that copies its own KV through L1 (``Workers.register_engine_driven``):
        told the region to map."""
        self._workers.register_engine_driven(p)
        region = self._store.region
        # null_block_id: 0.5.7's workers leave chunks of it only out of their stores
        return {"shm_name": region.name, "pool_size": region.size, "null_block_id": NULL_BLOCK_ID}

    def unregister_kv_cache_engine_driven_context(self, instance_id: int) -> None:
        self.unregister_kv_cache(instance_id)

    def register_kv_cache(  # noqa: PLR0917 (LMCache's positional arguments)
        self,
        instance_id: int,
        kv_caches: list[Any],
        model_name: str,
        world_size: int,
        engine_type: str,
        layout_hints: dict[str, Any],
        engine_group_infos: list[Any],
    ) -> None:
        self._workers.register_mapped(
            instance_id, kv_caches, model_name, world_size, layout_hints, engine_group_infos
        )

    def unregister_kv_cache(self, instance_id: int) -> None:
        w = self._workers.pop(instance_id)
        aborted, released = self._open.drop_instance(instance_id)
        if w is None:
            log.warning("unregister of unknown LMCache worker %d", instance_id)
            return
        self._store.abort_and_release(aborted, released)
        if w.kv is not None:
            w.kv.close()
        log.info("LMCache worker %d unregistered", instance_id)

    # ------------------------------------------------------------------ engine-driven

    def prepare_store(
        self, key: IPCKey, instance_id: int, skipped_chunks: Sequence[Sequence[int]] = ()
    ) -> dict[str, Any]:
        """Write-locked slots for the key's chunks not stored yet. 0.5.7's
        ``skipped_chunks``: per registered KV group, the chunk positions the worker will
        not write (all their blocks are the null block): no slot is reserved for them.
        A hybrid worker's answer names each slot's group (``group_ids``)."""
        w = self._workers.get(instance_id)
        groups = w.groups or (KVGroup(w.geometry),)
        keys = self._keys.group_keys(
            key, key.start, key.end, key.worker_id or 0, groups=len(groups), learn=True
        )
        skips = _skips(skipped_chunks, len(groups), len(keys[0]), instance_id)
        wanted = [
            (gid, i, k)
            for gid, (g_keys, skip) in enumerate(zip(keys, skips, strict=True))
            for i, k in enumerate(g_keys)
            if i not in skip
        ]
        results = self._store.reserve([(k, groups[gid].geometry.nbytes) for gid, _, k in wanted])
        slots: list[dict[str, Any]] = []
        indices: list[int] = []
        group_ids: list[int] = []
        reserved: list[tuple[ObjectKey, LeaseId]] = []
        for (gid, i, k), res in zip(wanted, results, strict=True):
            if isinstance(res, Reserved):
                g, s = groups[gid].geometry, res.slot
                slots.append(
                    {"offset": s.offset, "length": s.size, "shape": g.shape, "dtype": g.dtype}
                )
                indices.append(i)
                group_ids.append(gid)
                reserved.append((k, s.lease_id))
            elif res.reason is Refusal.NO_SPACE:
                self.refused["no_space"] += 1
        if reserved:
            pending = (instance_id, key.request_id, key.start, key.end)
            old = self._open.open_writes(pending, reserved)
            self._store.abort([k for k, _ in old])
        context: dict[str, Any] = {"slots": slots, "chunk_indices": indices}
        if w.groups:
            context["group_ids"] = group_ids
        return {"context": context}

    def commit_store(self, key: IPCKey, instance_id: int, data: bytes) -> bool:
        self._workers.get(instance_id)
        reserved = self._open.close_writes((instance_id, key.request_id, key.start, key.end))
        if data:
            self._store.abort([k for k, _ in reserved or []])
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
        return self._store.commit(reserved)

    def prepare_retrieve(self, key: IPCKey, instance_id: int) -> dict[str, Any]:
        """Read-locked slots of the key's chunks (the lookup's leases taken over), or a
        miss. A hybrid worker's KV groups each give the chunks of their window only
        (what the lookup locked), and each slot names its group and chunk."""
        w = self._workers.get(instance_id)
        groups = w.groups or (KVGroup(w.geometry),)
        keys = self._keys.group_keys(
            key, key.start, key.end, key.worker_id or 0, groups=len(groups)
        )
        wanted: list[ObjectKey] = []
        where: list[tuple[int, int]] = []  # (group, chunk) of each wanted key
        for gid, (grp, g_keys) in enumerate(zip(groups, keys, strict=True)):
            for c in range(grp.first_needed(len(g_keys)), len(g_keys)):
                wanted.append(g_keys[c])
                where.append((gid, c))
        leases = self._read_leases(key, wanted) if wanted else None
        if not leases:
            return {"success": False, "data": b"", "context": {}}
        geometries = [groups[gid].geometry for gid, _ in where]
        if any(size != g.nbytes for (_, _, _, size), g in zip(leases, geometries, strict=True)):
            self._store.release([lid for _, lid, _, _ in leases])
            raise MpError("contract", "stored chunks are not the size of the worker's layout")
        pending = (instance_id, key.request_id, key.start, key.end)
        self._store.release(self._open.open_reads(pending, [lid for _, lid, _, _ in leases]))
        slots = [
            {"offset": off, "length": size, "shape": g.shape, "dtype": g.dtype}
            for (_, _, off, size), g in zip(leases, geometries, strict=True)
        ]
        context: dict[str, Any] = {"slots": slots}
        if w.groups:
            context["group_ids"] = [gid for gid, _ in where]
            context["chunk_indices"] = [c for _, c in where]
        return {"success": True, "data": b"", "context": context}

    def commit_retrieve(self, key: IPCKey, instance_id: int) -> bool:
        self._store.release(
            self._open.close_reads((instance_id, key.request_id, key.start, key.end))
        )
        return True

    # ------------------------------------------------------------------ lmcache-driven

    def store(
        self, key: IPCKey, instance_id: int, block_ids: list[list[int]], event: bytes
    ) -> tuple[bytes, bool]:
        kv = self._workers.mapped(instance_id)
        if len(block_ids) != 1:
            raise MpError("unsupported", f"{len(block_ids)} KV groups; one is supported")
        keys = self._keys.keys(key, key.start, key.end, key.worker_id or 0, learn=True)
        nbytes = kv.geometry.nbytes
        if len(block_ids[0]) < len(keys) * kv.blocks_per_chunk:
            log.warning("store of %s: too few block ids for %d chunks", key.request_id, len(keys))
            return b"", False
        ok = True
        kv.begin(event)
        bpc = kv.blocks_per_chunk
        for i, k in enumerate(keys):
            if all(b == NULL_BLOCK_ID for b in block_ids[0][i * bpc : (i + 1) * bpc]):
                # no KV in it (a dropped window's blocks): storing it would serve garbage
                # to a later hit on this prefix; LMCache's server skips it so too
                continue
            (res,) = self._store.reserve([(k, nbytes)])
            if not isinstance(res, Reserved):
                ok = ok and res.reason is not Refusal.NO_SPACE
                continue
            try:
                kv.gather(block_ids[0], i, self._store.slot_view(res.slot))
            except BaseException:
                self._store.abort([k])
                raise
            done = self._store.commit([(k, res.slot.lease_id)])
            ok = ok and done
        return kv.end(), ok

    def retrieve(
        self,
        key: IPCKey,
        instance_id: int,
        block_ids: list[list[int]],
        event: bytes,
        skip_first_n_tokens: int,
    ) -> tuple[bytes, bool]:
        kv = self._workers.mapped(instance_id)
        if len(block_ids) != 1:
            raise MpError("unsupported", f"{len(block_ids)} KV groups; one is supported")
        keys = self._keys.keys(key, key.start, key.end, key.worker_id or 0)
        if not keys or len(block_ids[0]) < len(keys) * kv.blocks_per_chunk:
            self._store.release(list(self._sessions.take(key.request_id, keys).values()))
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
                    kv.scatter(block_ids[0], i, self._store.view(off, size), first)
            handle = kv.end()
        finally:
            self._store.release([lid for _, lid, _, _ in leases])
        return handle, True

    def _read_leases(self, key: IPCKey, keys: Sequence[ObjectKey]) -> list[ReadSlot] | None:
        """A read lease per key, the lookup's taken over; None, holding nothing, when any
        key is missing."""
        return self._store.read_leases(keys, self._sessions.take(key.request_id, keys))


def _skips(
    skipped_chunks: Sequence[Sequence[int]], groups: int, chunks: int, instance_id: int
) -> list[set[int]]:
    if not skipped_chunks:
        return [set() for _ in range(groups)]
    if len(skipped_chunks) != groups:
        raise MpError(
            "invalid",
            f"skipped_chunks has {len(skipped_chunks)} groups for {groups} registered"
            f" group(s) (instance_id={instance_id})",
        )
    skips = [set(s) for s in skipped_chunks]
    for gid, skip in enumerate(skips):
        if any(not 0 <= i < chunks for i in skip):
            raise MpError(
                "invalid",
                f"skipped_chunks for group {gid} is outside its {chunks} chunks"
                f" (instance_id={instance_id})",
            )
    return skips
