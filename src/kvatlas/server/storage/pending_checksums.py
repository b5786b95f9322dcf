"""The checksums an L1 chunk store owes: chunks committed before their digest was known.

A writer that cannot give the checksum (an LMCache worker) commits first
(``ChunkStore.commit_unhashed``); the digest is computed off the store's lock afterwards
and recorded with ``settle``, matched by the write's lease id, so that a digest of a slot
since evicted or rewritten is dropped. Until then a reader that hands the checksum on
gets the real one, computed on the spot (``hash_now``). ``run`` lists what a reader
about to ask for chunks may settle first; ``known`` lets a caller that must not spend
the time (a peer's lock RPC past its hashing budget) leave such a chunk out instead.

Owns the owed set (key -> the write lease that committed it) and the digests it records
in the pool and the journal. Must not: take locks (the chunk store's caller holds one
around every call, as for the store itself), read clocks, or hash a run off the lock
(``storage.guarded`` and ``lmcache_mp.hashing`` do).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvatlas.core.checksum import checksum as compute_checksum
from kvatlas.core.keys import ObjectKey
from kvatlas.core.server.l1pool import L1Pool, LeaseId
from kvatlas.runtime.region import L1Region
from kvatlas.server.storage.l1_journal import L1Journal


@dataclass(frozen=True, slots=True)
class Unhashed:
    """A committed L1 chunk whose checksum is still to come: what hashing it off the lock
    and ``PendingChecksums.settle`` need."""

    key: ObjectKey
    lease_id: LeaseId
    """The write lease that committed it (``ChunkStore.commit_unhashed``)."""
    offset: int
    size: int


class PendingChecksums:
    """The chunks of one pool committed without their checksum, by the write lease that
    committed each; their pool checksum is a placeholder until settled or computed."""

    def __init__(self, pool: L1Pool, region: L1Region, journal: L1Journal | None) -> None:
        self._pool = pool
        self._region = region
        self._journal = journal
        self._owed: dict[ObjectKey, LeaseId] = {}

    def __len__(self) -> int:
        """Chunks committed whose checksum is still to come."""
        return len(self._owed)

    def owe(self, key: ObjectKey, lease_id: LeaseId) -> None:
        """``key``'s commit by ``lease_id`` has its checksum to come."""
        self._owed[key] = lease_id

    def forget(self, key: ObjectKey) -> bool:
        """``key``'s slot was rewritten or evicted: nothing is owed for it any more; True
        when something was."""
        return self._owed.pop(key, None) is not None

    def keys(self) -> frozenset[ObjectKey]:
        return frozenset(self._owed)

    def known(self, key: ObjectKey) -> bool:
        """False while ``key``'s commit waits for its checksum."""
        return key not in self._owed

    def wants(self, pending: Unhashed) -> bool:
        """Is ``pending``'s commit still the key's, its checksum still to come?"""
        return self._owed.get(pending.key) == pending.lease_id

    def run(self, keys: Sequence[ObjectKey], max_bytes: int | None = None) -> list[Unhashed]:
        """The chunks with a checksum to come among the leading run of ``keys`` committed
        in L1, in order, while their sizes add up to ``max_bytes`` at most (None: no
        bound); the first key not committed in L1, or the first chunk past the bound,
        ends it. Hash them off the lock and ``settle`` each."""
        out: list[Unhashed] = []
        total = 0
        for key in keys:
            info = self._pool.get(key)
            if info is None or not info.committed:
                break
            lease_id = self._owed.get(key)
            if lease_id is None:
                continue
            total += info.size
            if max_bytes is not None and total > max_bytes:
                break
            out.append(Unhashed(key, lease_id, info.offset, info.size))
        return out

    def settle(self, key: ObjectKey, lease_id: LeaseId, offset: int, checksum: int) -> bool:
        """Record the checksum of the bytes the commit by write ``lease_id`` left at
        ``offset``; False (dropped) when that commit is no longer the key's, or a reader
        computed it first."""
        if self._owed.get(key) != lease_id:
            return False
        del self._owed[key]
        info = self._pool.get(key)
        if info is None or not info.committed or info.offset != offset:
            return False
        if self._journal is not None:
            self._journal.checksum(key, checksum)
        return self._pool.set_checksum(key, checksum)

    def hash_now(self, key: ObjectKey) -> None:
        """Compute an owed checksum now (a reader needs it); nothing when none is owed."""
        if self._owed.pop(key, None) is None:
            return
        info = self._pool.get(key)
        if info is not None and info.committed:
            digest = compute_checksum(self._region.view(info.offset, info.size))
            self._pool.set_checksum(key, digest)
            if self._journal is not None:
                self._journal.checksum(key, digest)
