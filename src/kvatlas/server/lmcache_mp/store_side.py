"""What the LMCache MP protocol does to the server's L1 pool, under the store's one lock.

``StoreSide`` is the only part of the MP service that takes the ``GuardedStore``'s lock:
it reserves slots for stores and commits them before their checksums (the
``QuietHasher`` computes those in the server's quiet time, ``hashing``), aborts and
releases, takes read leases for retrieves and read-locks the hit prefix of a lookup
(``lock_prefix``, ``lock_hybrid``), and deletes a clear's chunks. After every change it
drains the store's events to the publisher (ACCESS for the chunks a lookup locked), so
the event stream keeps the store's order. Every lease it takes is held by ``HOLDER``
and measured with the ``clock`` it is given (the store's own, at the composition root).

Must not: know requests, sessions or workers (the lookups and transfers decide what to
ask for), or hash chunk bytes under the lock.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from kvatlas.core.keys import ObjectKey
from kvatlas.core.server.l1pool import DeleteOutcome, LeaseId, Refused, Reserved, Slot
from kvatlas.runtime.region import L1Region
from kvatlas.server.lmcache_mp.core import KVGroup
from kvatlas.server.lmcache_mp.hashing import QuietHasher
from kvatlas.server.storage.guarded import GuardedStore
from kvatlas.server.storage.pending_checksums import Unhashed

HOLDER = "lmcache-mp"
"""The lease holder of every lease this protocol takes."""

ReadSlot = tuple[ObjectKey, LeaseId, int, int]
"""(key, read lease, offset, size) of a read-locked chunk."""


class StoreSide:
    """Reserve, commit, lease and delete in the shared store for the MP protocol."""

    def __init__(
        self,
        guarded: GuardedStore,
        hasher: QuietHasher,
        lease_s: float,
        clock: Callable[[], float],
    ) -> None:
        """``lease_s``: the length of every lease taken; ``clock``: what leases are
        measured with (the store's own: its lease sweep reads the same one)."""
        self._guarded = guarded
        self._store = guarded.store
        self._hasher = hasher
        self._lease_s = lease_s
        self._clock = clock

    @property
    def region(self) -> L1Region:
        """The L1 shared-memory region engine-driven workers map by name."""
        return self._store.region

    @property
    def unhashed(self) -> int:
        """Chunks committed whose checksum is still to be computed (``commit``)."""
        return len(self._store.checksums)

    def view(self, offset: int, size: int) -> memoryview:
        return self._store.region.view(offset, size)

    def slot_view(self, slot: Slot) -> memoryview:
        return self._store.slot_view(slot)

    # ------------------------------------------------------------------ writes

    def reserve(self, wants: Sequence[tuple[ObjectKey, int]]) -> list[Reserved | Refused]:
        """A write-locked slot of ``size`` bytes, or the refusal, per (key, size)."""
        out: list[Reserved | Refused] = []
        with self._guarded.lock:
            now = self._clock()
            for key, size in wants:
                out.append(self._store.reserve(key, size, now, self._lease_s, HOLDER))
            self._guarded.drain_locked()
        return out

    def commit(self, writes: Sequence[tuple[ObjectKey, LeaseId]]) -> bool:
        """Commit written slots before their checksums, which the hasher computes in
        the server's quiet time; False when any write was lost (its lease lapsed)."""
        ok = True
        with self._guarded.lock:
            now = self._clock()
            for key, lid in writes:
                info = self._store.commit_unhashed(key, now, lid)
                if info is None:
                    ok = False
                    continue
                self._hasher.submit(Unhashed(key, lid, info.offset, info.size))
            self._guarded.drain_locked()
        return ok

    def abort(self, keys: Sequence[ObjectKey]) -> None:
        if keys:
            with self._guarded.lock:
                for key in keys:
                    self._store.abort(key)
                self._guarded.drain_locked()

    def release(self, leases: Sequence[LeaseId]) -> None:
        if not leases:
            return
        with self._guarded.lock:
            for lid in leases:
                self._store.release(lid, HOLDER)

    def abort_and_release(self, keys: Sequence[ObjectKey], leases: Sequence[LeaseId]) -> None:
        """Both under one lock (a worker's open transfers, when it unregisters)."""
        with self._guarded.lock:
            for key in keys:
                self._store.abort(key)
            for lid in leases:
                self._store.release(lid, HOLDER)
            self._guarded.drain_locked()

    # ------------------------------------------------------------------ reads

    def read_leases(
        self, keys: Sequence[ObjectKey], taken: dict[ObjectKey, LeaseId]
    ) -> list[ReadSlot] | None:
        """A read lease per key (the one ``taken`` hands over, else a new one); None,
        holding nothing (``taken``'s leases released too), when any key is missing."""
        out: list[ReadSlot] = []
        with self._guarded.lock:
            now = self._clock()
            if any(k not in taken for k in keys):
                self._store.lookup_prefix(keys, now)
            for k in keys:
                lid = taken.pop(k, None)
                lease = self._store.pool.read_lease(lid) if lid is not None else None
                if lease is None:
                    lease = self._store.acquire_read(k, HOLDER, now, self._lease_s, checksum=False)
                if lease is None:
                    for lid_ in [o[1] for o in out] + list(taken.values()):
                        self._store.release(lid_, HOLDER)
                    return None
                out.append((k, lease.lease_id, lease.offset, lease.size))
        return out

    def hit(self, keys: Sequence[Sequence[ObjectKey]]) -> int:
        """The leading chunks every rank's ``keys`` hold (L2 hits promoted)."""
        if not keys or not keys[0]:
            return 0
        with self._guarded.lock:
            now = self._clock()
            return min(self._store.lookup_prefix(k, now) for k in keys)

    def lock_prefix(
        self, keys: Sequence[Sequence[ObjectKey]], readers: int
    ) -> tuple[dict[ObjectKey, list[LeaseId]], int]:
        """Read-lock, ``readers`` leases per key, the leading chunks every rank holds
        (``keys``: per rank, per chunk); the leases by key and the hit count."""
        held: dict[ObjectKey, list[LeaseId]] = {}
        accessed: list[tuple[ObjectKey, int]] = []
        hit = 0
        with self._guarded.lock:
            now = self._clock()
            self._store.lookup_prefix(keys[0], now)  # promote L2 hits of rank 0 too
            for i in range(len(keys[0])):
                got: dict[ObjectKey, list[LeaseId]] = {}
                ok = True
                for rank_keys in keys:
                    k = rank_keys[i]
                    for _ in range(readers):
                        lease = self._store.acquire_read(
                            k, HOLDER, now, self._lease_s, checksum=False
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
        return held, hit

    def lock_hybrid(
        self,
        keys: Sequence[Sequence[Sequence[ObjectKey]]],
        groups: Sequence[KVGroup],
        readers: int,
    ) -> tuple[dict[ObjectKey, list[LeaseId]], int]:
        """A hybrid model's hit (``keys``: per rank, per KV group, per chunk): the
        longest prefix of which every KV group holds the chunks it needs (a
        full-attention group all of them, a windowed one its trailing window: its
        earlier chunks were never stored), on every rank; those chunks read-locked as
        ``lock_prefix`` locks."""
        ranks = range(len(keys))
        n = len(keys[0][0])
        held: dict[ObjectKey, list[LeaseId]] = {}
        accessed: list[tuple[ObjectKey, int]] = []
        hit = 0
        with self._guarded.lock:
            now = self._clock()
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
                for _ in range(readers):
                    lease = self._store.acquire_read(k, HOLDER, now, self._lease_s, checksum=False)
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
        return held, hit

    # ------------------------------------------------------------------ clear

    def delete_models(self, models: Collection[str]) -> tuple[int, int]:
        """Delete every committed L1 chunk of ``models`` that no lease holds; (deleted,
        kept). L2 and other models' chunks stay."""
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
        return deleted, kept
