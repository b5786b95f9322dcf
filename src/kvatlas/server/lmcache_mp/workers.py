"""The LMCache workers registered with this server, and the hash contracts they declared.

A worker registers its KV cache once (``register_kv_cache`` for lmcache-driven mode,
``register_kv_cache_engine_driven_context`` for engine-driven mode); ``Workers`` checks
the registration (the transfer modes served, dtypes, the chunk size), maps the KV of an
lmcache-driven one (``cpu_kv``, or ``cuda_kv`` loaded only then), declares the model's
hash contract to the coordinator on its first registration and refuses one that
contradicts it, and keeps the KV groups of hybrid models (what a lookup, which names
no worker, needs to know which chunks make a hit). ``ping`` tells a worker this
process never saw to re-register once.

Must not: touch the store (the transfers release a worker's open transfers), or parse
frames (``wire``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvatlas.core.keys import HASH_ALGORITHM, HashContract
from kvatlas.server.lmcache_mp.core import KVGroup, MpError, MpIdentity
from kvatlas.server.lmcache_mp.cpu_kv import ITEMSIZES, ChunkGeometry, CpuPagedKV, PagedKV
from kvatlas.server.lmcache_mp.kv_checksums import Digests
from kvatlas.server.lmcache_mp.wire import EngineDrivenRegistration, GroupLayout, IpcDescriptor

log = logging.getLogger(__name__)


@dataclass
class Worker:
    model: str
    world_size: int
    geometry: ChunkGeometry
    kv: PagedKV | None = None
    """Mapped KV (lmcache-driven); None for an engine-driven registration."""
    groups: tuple[KVGroup, ...] = ()
    """A hybrid engine-driven worker's LMCache KV groups (two or more); empty for one."""


class Workers:
    """Registered workers by LMCache instance id, and the contracts of their models."""

    def __init__(
        self,
        identity: MpIdentity,
        *,
        transfer_mode: str = "auto",
        declare_contract: Callable[[HashContract], str | None] | None = None,
    ) -> None:
        """``transfer_mode``: the modes served (``--supported-transfer-mode``);
        ``declare_contract``: the coordinator's answer to a model's first contract (a
        refusal, or None)."""
        self._identity = identity
        self._modes = (
            {"engine_driven", "lmcache_driven"} if transfer_mode == "auto" else {transfer_mode}
        )
        self._declare = declare_contract
        self._lock = threading.Lock()
        self._workers: dict[int, Worker] = {}
        self._contracts: dict[str, HashContract] = {}
        self._hybrid: dict[tuple[str, int], tuple[KVGroup, ...]] = {}
        """(model, world size) -> the KV groups its hybrid workers registered."""
        self._told_unknown: set[int] = set()

    def set_declarer(self, declare: Callable[[HashContract], str | None]) -> None:
        self._declare = declare

    # ------------------------------------------------------------------ reads

    def get(self, instance_id: int) -> Worker:
        """The registered worker; MpError ``not_registered`` for one this process does
        not know."""
        with self._lock:
            w = self._workers.get(instance_id)
        if w is None:
            raise MpError(
                "not_registered",
                f"worker instance {instance_id} registered no KV cache with server"
                f" {self._identity.instance_id} (restarted? the worker re-registers)",
            )
        return w

    def mapped(self, instance_id: int) -> PagedKV:
        """The KV a lmcache-driven worker registered."""
        kv = self.get(instance_id).kv
        if kv is None:
            raise MpError("invalid", f"worker {instance_id} registered engine-driven, not KV")
        return kv

    def hybrid_groups(self, model: str, world_size: int) -> tuple[KVGroup, ...]:
        """The KV groups hybrid workers of (model, world size) registered; empty for a
        model of one group."""
        with self._lock:
            return self._hybrid.get((model, world_size), ())

    def models(self) -> set[str]:
        """The models workers registered here."""
        with self._lock:
            return set(self._contracts)

    def modes(self) -> dict[str, int]:
        """Registered workers by transfer mode."""
        with self._lock:
            kv = sum(1 for w in self._workers.values() if w.kv is not None)
            return {"lmcache_driven": kv, "engine_driven": len(self._workers) - kv}

    def ping(self, instance_id: int | None) -> bool:
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

    def kv_checksums(
        self, instance_id: int, block_ids: Sequence[int], chunk_blocks: int, layerwise: bool
    ) -> Digests:
        """LMCache's ``POST /cache/checksums``: digests of a registered lmcache-driven
        worker's KV blocks. MpError ``not_registered`` for an unknown worker or one that
        registered engine-driven (the server holds no view of its KV), ``invalid`` for
        block ids outside its KV."""
        w = self.get(instance_id)
        if w.kv is None:
            raise MpError(
                "not_registered",
                f"worker instance {instance_id} registered engine-driven: this server holds"
                " no view of its KV (the worker's own KV is where to hash it)",
            )
        return w.kv.checksums(block_ids, chunk_blocks, layerwise)

    # ------------------------------------------------------------------ registration

    def register_engine_driven(self, p: EngineDrivenRegistration) -> None:
        """A worker that copies its own KV through L1. 0.5.7's hybrid workers (two or
        more ``group_layouts``) store each KV group's chunks as its own object group,
        each in its own geometry (a sliding-window group's chunk holds its window)."""
        self._check_mode("engine_driven")
        cs = self._identity.chunk_size
        if p.dtype_str not in ITEMSIZES:
            raise MpError("invalid", f"KV dtype {p.dtype_str!r} not one of {sorted(ITEMSIZES)}")
        slots = p.num_physical_slots or cs
        if slots != cs:
            raise MpError(
                "invalid",
                f"{slots} physical slots per chunk; this server stores {cs}"
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

    def _kv_group(self, gl: GroupLayout, use_mla: bool) -> KVGroup:
        cs = self._identity.chunk_size
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

    def register_mapped(  # noqa: PLR0917 (LMCache's positional arguments)
        self,
        instance_id: int,
        kv_caches: list[Any],
        model_name: str,
        world_size: int,
        layout_hints: dict[str, Any],
        engine_group_infos: list[Any],
    ) -> None:
        """A lmcache-driven worker: its KV mapped here (``register_kv_cache``)."""
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
        cs = self._identity.chunk_size
        kv: PagedKV
        if kinds == {"cpu_shm"}:
            # LMCache reads CPU KV without a hint as HND (vLLM's CPU attention layout)
            kv = CpuPagedKV(descs, cs, str(hint or "HND"))
        elif kinds == {"cuda"}:
            # Only now: torch stays out of a server no CUDA worker registers with.
            from kvatlas.server.lmcache_mp import cuda_kv  # noqa: PLC0415 (loads torch)

            kv = cuda_kv.CudaPagedKV(descs, cs, str(hint or "NHD"))
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

    def pop(self, instance_id: int) -> Worker | None:
        """Forget a worker (its KV still mapped: the caller closes it)."""
        with self._lock:
            return self._workers.pop(instance_id, None)

    def close(self) -> None:
        with self._lock:
            workers, self._workers = list(self._workers.values()), {}
        for w in workers:
            if w.kv is not None:
                w.kv.close()

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
            chunk_size=self._identity.chunk_size,
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
            self._identity.instance_id,
            self._identity.incarnation,
        )
