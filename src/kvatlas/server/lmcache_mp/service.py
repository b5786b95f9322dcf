"""The LMCache MP service: the parts that answer LMCache MP requests (0.5.6 or 0.5.7rc2,
``wire``), composed, and the dispatch the transport (``transport``) calls.

The parts, each given only its collaborators (no inheritance between them, as vLLM's KV
cache coordinator composes a block pool and its managers):

- ``Workers`` (``workers``): the registered workers, their contracts, hybrid KV groups;
- ``StoreSide`` (``store_side``): reserve/commit/lease/delete in the shared
  ``GuardedStore`` under its one lock, checksums through the ``QuietHasher``
  (``hashing``), events drained after every change; the only part that takes the lock;
- ``Lookups`` (``lookups``): lookups and each request's ``Sessions`` (``sessions``),
  which hold a lookup's read leases for the retrieves that follow;
- ``Transfers`` (``transfers``): (un)registration and both transfer modes, over the
  ``OpenTransfers`` the hasher waits on;
- ``Management`` (``management``): chunk size, heartbeats, plug-in calls, ``clear``.

Must not: parse frames (``wire``), import torch, or keep store state of its own: every
chunk lives in the ``GuardedStore`` the kvatlas engine API shares.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from kvatlas.core.keys import HashContract
from kvatlas.server.lmcache_mp.core import ChunkKeys, MpError, MpIdentity, PromptListener
from kvatlas.server.lmcache_mp.hashing import QuietHasher
from kvatlas.server.lmcache_mp.kv_checksums import Digests
from kvatlas.server.lmcache_mp.lookups import Lookups, PrefixFetcher
from kvatlas.server.lmcache_mp.management import Management
from kvatlas.server.lmcache_mp.sessions import Sessions
from kvatlas.server.lmcache_mp.store_side import StoreSide
from kvatlas.server.lmcache_mp.transfers import OpenTransfers, Transfers
from kvatlas.server.lmcache_mp.workers import Workers
from kvatlas.server.storage.guarded import GuardedStore

__all__ = ["LMCacheMPService", "MpError", "MpIdentity"]


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
        on_prompt: PromptListener | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        """``transfer_mode``: the modes served (``--supported-transfer-mode``).
        ``on_prompt``: told the tokens, chunk hashes and cache salt of every prompt a
        lookup or a store names (it must not block), so that the KV event publisher can
        publish the chunks stored from it with their tokens. ``clock``: what leases are
        measured with; the store's own (``guarded.clock``) unless given."""
        self.identity = identity
        self.guarded = guarded
        keys = ChunkKeys(identity.chunk_size, on_prompt)
        self.workers = Workers(
            identity, transfer_mode=transfer_mode, declare_contract=declare_contract
        )
        self.sessions = Sessions()
        open_transfers = OpenTransfers()
        self._hasher = QuietHasher(guarded, open_transfers.__len__)
        side = StoreSide(
            guarded, self._hasher, identity.lease_s, guarded.clock if clock is None else clock
        )
        self.store_side = side
        self.lookups = Lookups(
            keys, self.workers, side, self.sessions, prefetch_workers=prefetch_workers
        )
        self.transfers = Transfers(self.workers, keys, side, self.sessions, open_transfers)
        self.management = Management(identity.chunk_size, self.workers, self.lookups, side)
        self.counts: Counter[str] = Counter()
        """Requests served, by operation."""
        t, lk, m = self.transfers, self.lookups, self.management
        self._ops: dict[str, Callable[..., Any]] = {
            "register_kv_cache": t.register_kv_cache,
            "unregister_kv_cache": t.unregister_kv_cache,
            "register_kv_cache_engine_driven_context": t.register_kv_cache_engine_driven_context,
            "unregister_kv_cache_engine_driven_context": (
                t.unregister_kv_cache_engine_driven_context
            ),
            "prepare_store": t.prepare_store,
            "commit_store": t.commit_store,
            "prepare_retrieve": t.prepare_retrieve,
            "commit_retrieve": t.commit_retrieve,
            "store": t.store,
            "retrieve": t.retrieve,
            "lookup": lk.lookup,
            "query_prefetch_status": lk.query_prefetch_status,
            "wait_prefetch_status": lk.wait_prefetch_status,
            "free_lookup_locks": lk.free_lookup_locks,
            "end_session": lk.end_session,
            "clear": m.clear,
            "get_chunk_size": m.get_chunk_size,
            "negotiate_chunk_size": m.negotiate_chunk_size,
            "ping": m.ping,
            "report_block_allocation": m.report_block_allocation,
            "noop": m.noop,
            "get_experimental": m.get_experimental,
            "server_module_call": m.server_module_call,
            "server_module_affinity_call": m.server_module_affinity_call,
        }

    @property
    def operations(self) -> frozenset[str]:
        """The operations ``handle`` serves."""
        return frozenset(self._ops)

    def handle(self, operation: str, args: tuple[Any, ...]) -> Any:
        """The result of one request; MpError (refusals) and other exceptions propagate
        to the transport, which answers them with an error reply."""
        self.counts[operation] += 1
        handler = self._ops[operation]
        with self._hasher.busy():  # no checksums computed meanwhile (``hashing``)
            return handler(*args)

    @property
    def refused(self) -> Counter[str]:
        """Requests refused or failed, by reason."""
        return self.transfers.refused + self.management.refused

    @property
    def unhashed_chunks(self) -> int:
        """Chunks committed whose checksum is still to be computed (``StoreSide.commit``)."""
        return self.store_side.unhashed

    def worker_modes(self) -> dict[str, int]:
        """Registered workers by transfer mode."""
        return self.workers.modes()

    def kv_checksums(
        self, instance_id: int, block_ids: Sequence[int], chunk_blocks: int, layerwise: bool
    ) -> Digests:
        """LMCache's ``POST /cache/checksums`` (``Workers.kv_checksums``)."""
        return self.workers.kv_checksums(instance_id, block_ids, chunk_blocks, layerwise)

    def set_peer_source(self, peers: PrefixFetcher | None) -> None:
        self.lookups.set_peers(peers)

    def set_contract_declarer(self, declare: Callable[[HashContract], str | None]) -> None:
        self.workers.set_declarer(declare)

    def close(self) -> None:
        self.lookups.close()
        self._hasher.close()
        self.workers.close()
