"""The chunk store behind its one lock, and the way its events reach the publisher.

Owns what the engine service and the P2P store access share: the ``ChunkStore``, the one
lock every call into it holds, the clock its leases are measured with, and the drain that
hands the store's recorded events to the event publisher in the order they happened
(under the lock, so the event stream's order is the store's). Sharing this small object,
rather than one facade reaching into the other, keeps each facade's rules in its own
module while the lock stays one.

Must not: decide what a request does to the store (the facades do), or run anything slow
under the lock (a peer fetch, a network call).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from kvatlas.core.checksum import checksum
from kvatlas.core.events import Entry
from kvatlas.core.keys import ObjectKey
from kvatlas.core.types import EventType, Tier
from kvatlas.server.storage.chunkstore import ChunkStore, ChunkStoreStats, batches
from kvatlas.server.storage.pending_checksums import Unhashed


class EventPublishing(Protocol):
    def publish(self, event_type: EventType, tier: Tier, entries: Sequence[Entry]) -> None: ...


class GuardedStore:
    """``store``, ``lock`` and ``clock`` are shared as they are; ``drain_locked`` is called
    with ``lock`` held, after every change to the store."""

    def __init__(
        self,
        store: ChunkStore,
        *,
        publisher: EventPublishing | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.lock = threading.Lock()
        self.publisher = publisher
        self.clock = clock

    def drain_locked(self, accessed: Sequence[tuple[ObjectKey, int]] = ()) -> None:
        """Publish the store's pending events, then an L1 ACCESS for ``accessed`` (lock held)."""
        events = self.store.take_events()
        if self.publisher is None:
            return
        for kind, tier, entries in batches(events):
            self.publisher.publish(kind, tier, entries)
        if accessed:
            self.publisher.publish(
                EventType.ACCESS, Tier.L1, [Entry(k, size) for k, size in accessed]
            )

    def settle_unhashed(self, keys: Sequence[ObjectKey], max_bytes: int | None = None) -> int:
        """Compute, off the lock, the checksums still to come of the leading run of
        ``keys`` committed in L1 (up to ``max_bytes`` of chunks, ``PendingChecksums.run``),
        so that a reader asking for them next finds them known instead of hashing KV under
        the lock; the number recorded. A chunk committed after this looked is hashed on
        the spot by that reader's own call, or left out of a peer's lock
        (``PendingChecksums.known``)."""
        if not self.store.checksums:  # read without the lock: a commit since is that reader's
            return 0
        with self.lock:
            todo = self.store.checksums.run(keys, max_bytes)
        return self._hash_and_record(todo)

    def settle(self, todo: Sequence[Unhashed]) -> int:
        """``_hash_and_record`` those of ``todo`` the store still wants (a hash job queued
        behind a reader that settled the chunk first, or behind its eviction, hashes
        nothing); the number recorded."""
        if not self.store.checksums:  # without the lock: nothing is wanted, or soon won't be
            return 0
        with self.lock:
            wanted = [u for u in todo if self.store.checksums.wants(u)]
        return self._hash_and_record(wanted)

    def _hash_and_record(self, todo: Sequence[Unhashed]) -> int:
        """Hash each of ``todo``'s slots without the lock, then record the digests the store
        still wants (a slot since evicted, rewritten or hashed by a reader is dropped:
        ``PendingChecksums.settle``); the number recorded."""
        if not todo:
            return 0
        digests = [checksum(self.store.region.view(u.offset, u.size)) for u in todo]
        with self.lock:
            return sum(
                self.store.checksums.settle(u.key, u.lease_id, u.offset, d)
                for u, d in zip(todo, digests, strict=True)
            )

    def drain(self) -> None:
        """Hand pending store events to the publisher (after a lease sweep, say)."""
        with self.lock:
            self.drain_locked()

    def stats(self) -> ChunkStoreStats:
        with self.lock:
            return self.store.stats()
