"""What P2P may do to this server's chunk store, and nothing more.

Owns the two sides' store operations, each one short hold of the shared store lock
(``GuardedStore``) with the store's events drained to the publisher before it is let go:

- owner side (a peer reads from us): ``lock_for_peer`` read-locks the leading run of keys
  we hold for ``peer:<requester id>`` (L2 hits promoted), ``unlock_for_peer`` releases
  that peer's own leases only, ``peer_may_read`` tells the transport whether a live lease
  of that peer covers a byte range;
- requester side (we read from a peer): ``reserve_for_peer_fetch`` write-locks fresh
  slots for what a peer will send, ``commit_peer_fetch`` commits the verified ones
  (published as STOREs like any local store) and aborts the rest.

Locking rule (the engine service's too): a peer fetch runs WITHOUT the lock; only these
calls take it, and none of them waits on the network.

Must not: talk to peers or the coordinator, or know the engine API.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from kvatlas.core.keys import ObjectKey
from kvatlas.core.server.l1pool import LeaseId, ReadLease, Refusal, Reserved, Slot
from kvatlas.server.storage.guarded import GuardedStore

PEER_HOLDER_PREFIX: Final = "peer:"
"""Holder of the read leases a peer's ``lookup_and_lock`` takes: ``peer:<requester id>``."""
FETCH_HOLDER: Final = "p2p"
"""Holder of the write leases on slots a peer fetch fills."""
LOCK_HASH_BYTES: Final = 64 * 2**20
"""The most KV one ``lock_for_peer`` hashes whose checksum is still to come (an LMCache
worker's chunk committed moments ago): about 2 ms at the 28 GB/s xxh3 reaches on one core
here, a tenth of the lock RPC's least deadline (``--p2p-lock-deadline-floor-s``, 25 ms)
even at a quarter of that speed."""


class PeerStoreAccess:
    """The P2P facade over the guarded store; thread-safe."""

    def __init__(self, guarded: GuardedStore, lock_hash_bytes: int = LOCK_HASH_BYTES) -> None:
        self._g = guarded
        self._lock_hash_bytes = lock_hash_bytes

    @property
    def pool_capacity(self) -> int:
        """Bytes the L1 pool manages (P2P requires them to lie in one region)."""
        return self._g.store.pool.capacity_bytes

    # ------------------------------------------------------------------ owner side

    def lock_for_peer(
        self, requester: str, keys: Sequence[ObjectKey], lease_s: float
    ) -> list[ReadLease]:
        """Read-lock the leading run of ``keys`` this server holds (L2 hits promoted) for
        peer ``requester``; the leases expire after ``lease_s`` if it never unlocks.

        Chunks whose checksum is still to come (an LMCache worker's, committed moments
        ago) are hashed first, off the store lock, up to ``lock_hash_bytes`` of them; one
        past that bound ends the run: the lock RPC's deadline is a round trip's, and
        hashing hundreds of MiB inside it could miss that deadline and cost the peer's
        breaker."""
        g = self._g
        holder = PEER_HOLDER_PREFIX + requester
        out: list[ReadLease] = []
        g.settle_unhashed(keys, self._lock_hash_bytes)
        with g.lock:
            now = g.clock()
            hit = g.store.lookup_prefix(keys, now)
            for key in keys[:hit]:
                if not g.store.checksums.known(key):
                    break
                lease = g.store.acquire_read(key, holder, now, lease_s)
                if lease is None:
                    break
                out.append(lease)
            g.drain_locked()
        return out

    def unlock_for_peer(self, requester: str, lease_ids: Sequence[int]) -> int:
        """Release those of ``lease_ids`` that peer ``requester`` holds."""
        g = self._g
        holder = PEER_HOLDER_PREFIX + requester
        n = 0
        with g.lock:
            for raw in lease_ids:
                lease = g.store.pool.read_lease(LeaseId(raw))
                if lease is not None and lease.holder == holder:
                    n += g.store.release(lease.lease_id)
        return n

    def peer_may_read(self, requester: str, lease_id: str, offset: int, size: int) -> bool:
        """Does a live lease of ``requester`` cover ``[offset, offset + size)``?"""
        if not lease_id.isdigit():
            return False
        g = self._g
        with g.lock:
            lease = g.store.pool.read_lease(LeaseId(int(lease_id)))
            now = g.clock()
        return (
            lease is not None
            and lease.holder == PEER_HOLDER_PREFIX + requester
            and lease.deadline > now
            and lease.offset <= offset
            and offset + size <= lease.offset + lease.size
        )

    # ------------------------------------------------------------------ requester side

    def reserve_for_peer_fetch(
        self, items: Sequence[tuple[ObjectKey, int]], lease_s: float
    ) -> list[Slot | Refusal]:
        """Write-lock a fresh L1 slot per (key, size), in order; a refusal per item that
        got none (EXISTS: someone stored it meanwhile)."""
        g = self._g
        out: list[Slot | Refusal] = []
        with g.lock:
            now = g.clock()
            g.store.expire(now)
            for key, size in items:
                res = g.store.reserve(key, size, now, lease_s, holder=FETCH_HOLDER)
                out.append(res.slot if isinstance(res, Reserved) else res.reason)
            g.drain_locked()
        return out

    def commit_peer_fetch(
        self, done: Sequence[tuple[Slot, int]], failed: Sequence[Slot], keep_failed: bool
    ) -> list[ObjectKey]:
        """Commit slots whose bytes arrived verified (with their checksums) and abort the
        failed ones, unless ``keep_failed`` (a transfer may still write them: their write
        leases then expire instead). STOREs are published like any local store."""
        g = self._g
        committed: list[ObjectKey] = []
        with g.lock:
            now = g.clock()
            for slot, checksum in done:
                if g.store.commit(slot.key, now, checksum, slot.lease_id) is not None:
                    committed.append(slot.key)
            if not keep_failed:
                for slot in failed:
                    g.store.abort(slot.key)
            g.drain_locked()
        return committed
