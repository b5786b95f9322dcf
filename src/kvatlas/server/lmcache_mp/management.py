"""The LMCache MP requests that manage rather than transfer: chunk size, heartbeats,
plug-in calls, block-allocation reports and ``clear``.

Must not: take the store's lock (``StoreSide`` does), or keep worker state
(``Workers``).
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

from kvatlas.server.lmcache_mp.core import MpError
from kvatlas.server.lmcache_mp.lookups import Lookups
from kvatlas.server.lmcache_mp.store_side import StoreSide
from kvatlas.server.lmcache_mp.wire import BlockAllocation, ServerModuleCall
from kvatlas.server.lmcache_mp.workers import Workers

log = logging.getLogger(__name__)


class Management:
    """Answers the management operations."""

    def __init__(
        self, chunk_size: int, workers: Workers, lookups: Lookups, store: StoreSide
    ) -> None:
        self._chunk_size = chunk_size
        self._workers = workers
        self._lookups = lookups
        self._store = store
        self.refused: Counter[str] = Counter()
        """Requests refused, by reason (``server_module``)."""
        self.block_allocations = 0
        """Block-allocation records workers reported."""

    def get_chunk_size(self) -> int:
        return self._chunk_size

    def negotiate_chunk_size(self, required_chunk_alignment: int) -> int:
        """0.5.7: the chunk size, if it is a multiple of the model's block alignment.
        Answered as 0.5.7's server answers once its chunk size is selected: this one's is
        fixed (--chunk-size), so it is never rounded up."""
        cs = self._chunk_size
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

    def get_experimental(self) -> list[str]:
        return []  # no kv_event_stream: workers report their own stores to vLLM

    def ping(self, instance_id: int | None) -> bool:
        return self._workers.ping(instance_id)

    def noop(self) -> str:
        return "OK"

    def server_module_call(self, call: ServerModuleCall) -> dict[str, Any]:
        """LMCache's answer to a plug-in method its server does not serve, word for word
        (``ExtServerModuleRouter``): this server loads no LMCache server modules, so
        every method is unknown. The client's call fails with this reason at once."""
        self.refused["server_module"] += 1
        return {
            "success": False,
            "payload": b"",
            "error": f"unknown server module method: {call.method}",
        }

    def server_module_affinity_call(self, call: ServerModuleCall) -> dict[str, Any]:
        """0.5.7: a plug-in method run on the calling client's affinity thread, in order
        with its stores and retrieves. Its only meaning is a plug-in's, and this server
        has none: answered as ``server_module_call`` (LMCache's own error reply)."""
        return self.server_module_call(call)

    def report_block_allocation(
        self, instance_id: int, model_name: str, records: list[BlockAllocation]
    ) -> None:
        self.block_allocations += len(records)

    def clear(self, force: bool) -> None:
        """vLLM's prefix-cache reset: end the sessions' read leases, then delete every
        unlocked L1 chunk of the models LMCache clients registered here (DELETE events
        follow). Chunks a reader holds stay even with ``force``: bytes are never pulled
        from under a copy. Other models' chunks (kvatlas engines') and L2 stay."""
        self._lookups.clear()
        models = self._workers.models()
        deleted, kept = self._store.delete_models(models)
        log.info(
            "LMCache clear(force=%s) of models %s: %d L1 chunks deleted, %d kept (locked)",
            force,
            sorted(models),
            deleted,
            kept,
        )
