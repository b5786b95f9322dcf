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

Both modes commit a chunk before its checksum (``MpCore._commit_unhashed``): the worker
gives none, and hashing tens of MiB would sit in the store's latency. The checksum is
computed off the lock once the workers are quiet (``hashing``); a reader that needs it
sooner computes it then: a demotion to L2 (``ChunkStore``), a kvatlas engine's lookup
and a peer's ``lookup_and_lock`` (both off the lock, ``GuardedStore.settle_unhashed``;
a peer's up to 64 MiB per request, past which the chunk is left out until known). A
local retrieve needs none.

Must not: parse frames (``wire``) or import torch at module level.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from kvatlas.core.keys import ObjectKey
from kvatlas.core.server.l1pool import LeaseId, Refusal, Reserved
from kvatlas.server.lmcache_mp.core import HOLDER, KVGroup, MpCore, MpError, Worker
from kvatlas.server.lmcache_mp.cpu_kv import (
    ITEMSIZES,
    NULL_BLOCK_ID,
    ChunkGeometry,
    CpuPagedKV,
    PagedKV,
)
from kvatlas.server.lmcache_mp.wire import (
    EngineDrivenRegistration,
    GroupLayout,
    IpcDescriptor,
    IPCKey,
)

log = logging.getLogger(__name__)


class Transfers(MpCore):
    """The registration and transfer requests of both modes."""

    # ------------------------------------------------------------------ registration

    def op_register_kv_cache_engine_driven_context(
        self, p: EngineDrivenRegistration
    ) -> dict[str, Any]:
        """A worker that copies its own KV through L1. 0.5.7's hybrid workers (two or
        more ``group_layouts``) store each KV group's chunks as its own object group,
        each in its own geometry (a sliding-window group's chunk holds its window)."""
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
        groups: tuple[KVGroup, ...] = ()
        if len(p.group_layouts) > 1:
            groups = tuple(self._kv_group(gl, p.use_mla) for gl in p.group_layouts)
            geometry = groups[0].geometry  # group 0's layout doubles as the top-level one
        self._register(p.instance_id, Worker(p.model_name, p.world_size, geometry, groups=groups))
        if groups:
            with self._lock:
                self._hybrid[(p.model_name, p.world_size)] = groups
        region = self._store.region
        # null_block_id: 0.5.7's workers leave chunks of it only out of their stores
        return {"shm_name": region.name, "pool_size": region.size, "null_block_id": NULL_BLOCK_ID}

    def _kv_group(self, gl: GroupLayout, use_mla: bool) -> KVGroup:
        cs = self.identity.chunk_size
        tokens = gl.window_tokens or cs
        if gl.dtype_str not in ITEMSIZES:
            raise MpError("invalid", f"group dtype {gl.dtype_str!r} not one of {sorted(ITEMSIZES)}")
        if not 0 < tokens <= cs or gl.window_chunks < 0 or gl.num_layers < 1:
            raise MpError(
                "invalid",
                f"group layout {gl}: window_tokens must be in (0, {cs}], window_chunks >= 0",
            )
        single = gl.kv_size == 1 if gl.kv_size else use_mla
        planes = 1 if single else 2
        geometry = ChunkGeometry(gl.num_layers, tokens, gl.hidden_dim_size, gl.dtype_str, planes)
        return KVGroup(geometry, gl.window_chunks)

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
            raise MpError(
                "unsupported",
                f"{len(engine_group_infos)} KV cache groups (a hybrid model): this kvatlas"
                " server serves hybrid models engine-driven only"
                ' ("lmcache.mp.mp_transfer_mode": "engine_driven")',
            )
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
            self._register(instance_id, Worker(model_name, world_size, kv.geometry, kv))
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

    # ------------------------------------------------------------------ engine-driven

    def op_prepare_store(
        self, key: IPCKey, instance_id: int, skipped_chunks: Sequence[Sequence[int]] = ()
    ) -> dict[str, Any]:
        """Write-locked slots for the key's chunks not stored yet. 0.5.7's
        ``skipped_chunks``: per registered KV group, the chunk positions the worker will
        not write (all their blocks are the null block): no slot is reserved for them.
        A hybrid worker's answer names each slot's group (``group_ids``)."""
        w = self._worker(instance_id)
        groups = w.groups or (KVGroup(w.geometry),)
        keys = self._group_keys(
            key, key.start, key.end, key.worker_id or 0, groups=len(groups), learn=True
        )
        skips = self._skips(skipped_chunks, len(groups), len(keys[0]), instance_id)
        slots: list[dict[str, Any]] = []
        indices: list[int] = []
        group_ids: list[int] = []
        reserved: list[tuple[ObjectKey, LeaseId]] = []
        with self._guarded.lock:
            now = self._guarded.clock()
            for gid, (grp, g_keys, skip) in enumerate(zip(groups, keys, skips, strict=True)):
                g = grp.geometry
                for i, k in enumerate(g_keys):
                    if i in skip:
                        continue
                    res = self._store.reserve(k, g.nbytes, now, self.identity.lease_s, HOLDER)
                    if isinstance(res, Reserved):
                        s = res.slot
                        slots.append(
                            {
                                "offset": s.offset,
                                "length": s.size,
                                "shape": g.shape,
                                "dtype": g.dtype,
                            }
                        )
                        indices.append(i)
                        group_ids.append(gid)
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
        context: dict[str, Any] = {"slots": slots, "chunk_indices": indices}
        if w.groups:
            context["group_ids"] = group_ids
        return {"context": context}

    @staticmethod
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
        with self._guarded.lock:
            now = self._guarded.clock()
            ok = self._commit_unhashed(reserved, now)
            self._guarded.drain_locked()
        return ok

    def op_prepare_retrieve(self, key: IPCKey, instance_id: int) -> dict[str, Any]:
        """Read-locked slots of the key's chunks (the lookup's leases taken over), or a
        miss. A hybrid worker's KV groups each give the chunks of their window only
        (what the lookup locked), and each slot names its group and chunk."""
        w = self._worker(instance_id)
        groups = w.groups or (KVGroup(w.geometry),)
        keys = self._group_keys(key, key.start, key.end, key.worker_id or 0, groups=len(groups))
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
            self._release([lid for _, lid, _, _ in leases])
            raise MpError("contract", "stored chunks are not the size of the worker's layout")
        pending = (instance_id, key.request_id, key.start, key.end)
        with self._lock:
            old = self._reads.pop(pending, [])
            self._reads[pending] = [lid for _, lid, _, _ in leases]
        self._release(old)
        slots = [
            {"offset": off, "length": size, "shape": g.shape, "dtype": g.dtype}
            for (_, _, off, size), g in zip(leases, geometries, strict=True)
        ]
        context: dict[str, Any] = {"slots": slots}
        if w.groups:
            context["group_ids"] = [gid for gid, _ in where]
            context["chunk_indices"] = [c for _, c in where]
        return {"success": True, "data": b"", "context": context}

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
        keys = self._keys(key, key.start, key.end, key.worker_id or 0, learn=True)
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
            with self._guarded.lock:
                now = self._guarded.clock()
                res = self._store.reserve(k, nbytes, now, self.identity.lease_s, HOLDER)
                self._guarded.drain_locked()
            if not isinstance(res, Reserved):
                ok = ok and res.reason is not Refusal.NO_SPACE
                continue
            try:
                kv.gather(block_ids[0], i, self._store.slot_view(res.slot))
            except BaseException:
                self._abort([k])
                raise
            with self._guarded.lock:
                done = self._commit_unhashed([(k, res.slot.lease_id)], self._guarded.clock())
                self._guarded.drain_locked()
            ok = ok and done
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
