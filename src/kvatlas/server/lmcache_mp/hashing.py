"""Checksums of the chunks LMCache workers commit, computed in the server's quiet time.

Both transfer modes commit a chunk before its checksum (``StoreSide.commit``):
hashing tens of MiB would sit in the store's latency, and a local retrieve needs none.
``QuietHasher`` computes them afterwards, but only while no LMCache request is being
served and no engine-driven transfer is open between its prepare and its commit: on a
small host the hashing (xxh3 of 64 MiB per 512-token store of an 8B model, about 10 ms
of a core) would otherwise take memory bandwidth and a core from the worker's own copy
into or out of the L1 region, and its threads would hold the GIL and the store's lock
just when a request wants them (measured on two cores: engine-driven stores and
retrieves behind ``lmcache server``'s with eager hashing, even at ``SCHED_IDLE``). A
chunk is hashed in ``PIECE_BYTES`` pieces, each after a quiet check, so a request that
arrives mid-chunk waits for one piece at most. A chunk deferred for ``MAX_DEFER_S`` is
hashed anyway (a server never quiet still gets its checksums), and a reader that needs
one sooner computes it itself: a demotion to L2, a kvatlas engine's lookup, a peer's
``lookup_and_lock`` (``GuardedStore.settle_unhashed``).

Must not: decide what is committed (``store_side``, ``transfers``), or hold the store's lock
while hashing.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Final

from kvatlas.core.checksum import checksum_stream
from kvatlas.server.storage.guarded import GuardedStore
from kvatlas.server.storage.pending_checksums import Unhashed

log = logging.getLogger(__name__)

THREADS: Final = min(2, os.cpu_count() or 1)
"""Threads hashing committed chunks."""
NICE: Final = 19
"""Their nice value: the least share of a busy core (an idle core runs them at full
speed). Not ``SCHED_IDLE``: a thread of that class preempted while it holds the GIL or
the store's lock (between two pieces) stalls the server's request threads until a core
is idle, which on a busy host can be tens of milliseconds; a nice thread gets its turn
within a scheduling period."""
QUIET_S: Final = 0.02
"""Hash only once no LMCache request has been served for this long: a worker's next
call (the lookup after a store, the retrieve after a lookup) usually comes sooner."""
PIECE_BYTES: Final = 4 << 20
"""Bytes hashed between two quiet checks (about a millisecond of a core)."""
MAX_DEFER_S: Final = 10.0
"""A chunk waits at most this long for quiet (a server with no 20 ms pause in ten
seconds), then is hashed between requests anyway."""


def _lower_priority() -> None:
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)


class QuietHasher:
    """Hashes committed chunks when the LMCache side of the server is idle: ``busy``
    marks a request being served, ``open_transfers`` counts the engine-driven transfers
    waiting for their commit (the worker copies meanwhile)."""

    def __init__(self, guarded: GuardedStore, open_transfers: Callable[[], int]) -> None:
        self._guarded = guarded
        self._open_transfers = open_transfers
        self._lock = threading.Lock()
        self._active = 0
        self._last = time.monotonic()
        self._closed = threading.Event()
        self._pool = ThreadPoolExecutor(THREADS, "kvatlas-lmcache-hash", _lower_priority)
        self.deferred_s = 0.0
        """Seconds chunks waited for quiet, summed (the hashing stayed out of the way)."""

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """Around every request served: no hashing meanwhile, nor ``QUIET_S`` after."""
        with self._lock:
            self._active += 1
        try:
            yield
        finally:
            now = time.monotonic()
            with self._lock:
                self._active -= 1
                self._last = now

    def submit(self, pending: Unhashed) -> None:
        """Hash ``pending`` when quiet (or after ``MAX_DEFER_S``); nothing once closed."""
        with contextlib.suppress(RuntimeError):  # shut down: readers compute it
            self._pool.submit(self._settle, pending, time.monotonic() + MAX_DEFER_S)

    def close(self) -> None:
        """Drop the chunks still to hash; returns once no thread holds a view of the
        region (a piece at most)."""
        self._closed.set()
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _quiet(self, deadline: float) -> bool:
        """Wait for quiet, or the deadline; False once closed."""
        t0 = time.monotonic()
        while not self._closed.is_set():
            now = time.monotonic()
            with self._lock:
                idle = self._active == 0 and now - self._last >= QUIET_S
            idle = idle and not self._open_transfers()
            if idle or now >= deadline:
                self.deferred_s += now - t0
                return True
            self._closed.wait(QUIET_S / 2)
        return False

    def _settle(self, pending: Unhashed, deadline: float) -> None:
        """Hash a committed slot piece by piece without the lock; the store keeps the
        digest only if the slot still holds that commit (else it was evicted, or a
        reader computed it first, and it is dropped)."""
        store = self._guarded.store
        try:
            with self._guarded.lock:
                if not store.checksums.wants(pending):
                    return
            h = checksum_stream()
            for off in range(0, pending.size, PIECE_BYTES):
                if not self._quiet(deadline):
                    return
                # a view per piece: none is held while waiting (the region may close)
                n = min(PIECE_BYTES, pending.size - off)
                with store.region.view(pending.offset + off, n) as piece:
                    h.update(piece)
            with self._guarded.lock:
                store.checksums.settle(pending.key, pending.lease_id, pending.offset, h.intdigest())
        except Exception:  # a closed region at shutdown; a reader computes it otherwise
            log.debug("checksum of %s not settled", pending.key.chunk_hash_hex, exc_info=True)
