"""Per-tenant L1 shares: what each ``cache_salt`` holds in the L1 pool, the share it is
guaranteed, and the order in which an allocation may take victims under that guarantee
(pure).

A request's ``cache_salt`` is its tenant ("" is the unsalted namespace, itself one
tenant). ``SaltShares`` keeps, per salt, the bytes it holds in L1 (reserved, so rounded up
to the alignment, from ``reserve`` until the slot is freed: a write in progress takes its
room too) and its committed chunks, plus how many of its chunks were evicted by its own
allocations and by other salts'. ``L1Pool`` keeps it in step; it never sees a chunk's
bytes, offsets or leases.

The share rule (``--l1-tenant-min-share FRACTION``, off at 0). With ``N`` active salts (a
salt is active while it holds any L1 bytes; the allocating salt counts as active) and a
capacity of ``C`` bytes, every salt is guaranteed::

    share = min(floor(FRACTION * C), C // N)

the fraction of L1 an operator promised each tenant, cut down to the equal split when
more tenants are active than the promises fit. ``N * share <= C`` always, so every
guarantee can be honoured at once. A salt at or below its share keeps its chunks against
every other salt's allocations. Free space is anyone's (the rule is work-conserving), so
a salt may hold more than its share; those bytes are what another salt takes first, and
a salt over its own share that needs room recycles its own chunks before it takes them.

Victim order (``victims``), for an allocation of ``need`` bytes by salt ``r``:

1. when ``r`` would exceed its share with the new slot (``held(r) + need > share``):
   ``r``'s own chunks, least recently used first (a tenant over its share pays for its
   own growth, as LMCache 0.5.6's ``IsolatedLRUEvictionPolicy`` evicts only from the
   over-quota salt's own LRU list; LMCache applies it to L2 quotas, its L1 has one
   global LRU);
2. other salts' chunks, taken one at a time from the salt holding the most bytes above
   its share (ties: the smaller salt string), least recently used first within the salt,
   and only while that salt keeps at least its share after the chunk goes (a salt is
   never pushed below its share by someone else; one whose next chunk would do so gives
   nothing more to this allocation);
3. when step 1 did not run: ``r``'s own chunks, least recently used first (a salt under
   its share may still make room by evicting its own older chunks).

The caller skips locked chunks (``unlocked`` yields only chunks no lease holds) and stops
iterating as soon as it has room, so the common case (one flooding tenant over its share)
costs what the global LRU costs: step 1 walks the flooder's own LRU list. Step 2 builds a
heap of the salts over their share (O(salts), not O(chunks)). The order is deterministic:
it depends only on the pool's state.

A flood of distinct salts shrinks every share (``C // N``): the router derives salts
from API keys, so the number of tenants is the operator's to bound.

Per-salt books are dropped when a salt holds nothing (as LMCache drops an empty
per-salt bucket); its eviction counters are kept for the ``RETIRED_SALTS_KEPT`` most
recently emptied salts, so that a tenant evicted to nothing still shows what was done to
it, and the table stays bounded.

Must not: do I/O, read clocks, log, or know the region's layout.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Final

from kvatlas.core.errors import InvalidInput
from kvatlas.core.keys import ObjectKey

RETIRED_SALTS_KEPT: Final = 1024
"""Salts that hold nothing in L1 any more whose eviction counters are still reported."""


@dataclass(frozen=True, slots=True)
class SaltUsage:
    """One salt's L1 figures, for ``/status`` and metrics."""

    cache_salt: str
    bytes: int
    """Reserved L1 bytes (committed chunks and writes in progress)."""
    chunks: int
    """Committed chunks."""
    evicted_by_own: int
    """Its chunks evicted to make room for its own allocations."""
    evicted_by_others: int
    """Its chunks evicted to make room for another salt's allocations."""


@dataclass(slots=True)
class _Book:
    bytes: int = 0
    chunks: int = 0
    evicted_by_own: int = 0
    evicted_by_others: int = 0


Unlocked = Callable[[str], Iterator[tuple[ObjectKey, int]]]
"""``unlocked(salt)``: the salt's chunks no lease holds, in eviction order, as
``(key, reserved bytes)``."""


class SaltShares:
    """Per-salt books of one L1 pool of ``capacity_bytes`` and its share rule."""

    def __init__(self, capacity_bytes: int, min_share: float = 0.0) -> None:
        if not 0.0 <= min_share <= 1.0:
            raise InvalidInput(f"tenant min share must be in [0, 1], got {min_share}")
        self.capacity_bytes = capacity_bytes
        self.min_share = min_share
        self._floor = int(min_share * capacity_bytes)
        self._active: dict[str, _Book] = {}
        self._retired: OrderedDict[str, _Book] = OrderedDict()
        self.cross_salt_evictions = 0
        """Evictions whose victim belonged to another salt than the allocation's."""

    @property
    def enabled(self) -> bool:
        return self._floor > 0

    # --------------------------------------------------------------------- queries

    def held(self, salt: str) -> int:
        book = self._active.get(salt)
        return 0 if book is None else book.bytes

    def share_bytes(self, salt: str) -> int:
        """The bytes ``salt`` is guaranteed now (0 when the rule is off); ``salt`` counts
        as active even when it holds nothing yet (it is the one asking)."""
        if not self.enabled:
            return 0
        n = len(self._active) + (salt not in self._active)
        return min(self._floor, self.capacity_bytes // n)

    def current_share(self) -> int:
        """What each active salt is guaranteed now (0 when the rule is off)."""
        if not self.enabled:
            return 0
        return min(self._floor, self.capacity_bytes // max(1, len(self._active)))

    def usage(self) -> list[SaltUsage]:
        """Every active salt, then the retired ones with counters kept, by salt."""
        rows = {**self._retired, **self._active}
        return [
            SaltUsage(salt, b.bytes, b.chunks, b.evicted_by_own, b.evicted_by_others)
            for salt, b in sorted(rows.items())
        ]

    # ---------------------------------------------------------------------- updates

    def reserved(self, salt: str, nbytes: int) -> None:
        """A slot of ``nbytes`` (reserved size) was handed to a writer of ``salt``."""
        self._book(salt).bytes += nbytes

    def committed(self, salt: str) -> None:
        self._book(salt).chunks += 1

    def freed(self, salt: str, nbytes: int, committed: bool) -> None:
        """A slot of ``salt`` was freed (evicted, deleted, aborted or expired)."""
        book = self._active[salt]
        book.bytes -= nbytes
        if committed:
            book.chunks -= 1
        if book.bytes == 0:
            del self._active[salt]
            self._retired[salt] = book
            while len(self._retired) > RETIRED_SALTS_KEPT:
                self._retired.popitem(last=False)

    def evicted(self, victim: str, by: str) -> None:
        """Count an eviction of ``victim``'s chunk for an allocation of ``by``'s (call
        before ``freed``)."""
        book = self._active[victim]
        if victim == by:
            book.evicted_by_own += 1
        else:
            book.evicted_by_others += 1
            self.cross_salt_evictions += 1

    # ----------------------------------------------------------------------- policy

    def victims(self, requester: str, need: int, unlocked: Unlocked) -> Iterator[ObjectKey]:
        """Keys an allocation of ``need`` bytes by ``requester`` may evict, in the order
        to try them (see the module docstring). Every key yielded counts as gone for the
        share check, so another salt stays at or above its share even when the caller
        evicts only some of them (those inside the run it picks). The caller must not
        change the pool while iterating."""
        share = self.share_bytes(requester)
        own_first = self.held(requester) + need > share
        if own_first:
            yield from (k for k, _ in unlocked(requester))
        heap = [
            (share - book.bytes, salt)
            for salt, book in self._active.items()
            if salt != requester and book.bytes > share
        ]
        heapq.heapify(heap)
        left = {salt: self._active[salt].bytes for _, salt in heap}
        walks: dict[str, Iterator[tuple[ObjectKey, int]]] = {}
        while heap:
            _, salt = heapq.heappop(heap)
            walk = walks.get(salt)
            if walk is None:
                walk = walks[salt] = unlocked(salt)
            step = next(walk, None)
            if step is None or left[salt] - step[1] < share:
                continue  # nothing unlocked left, or it would go below its share
            left[salt] -= step[1]
            yield step[0]
            if left[salt] > share:
                heapq.heappush(heap, (share - left[salt], salt))
        if not own_first:
            yield from (k for k, _ in unlocked(requester))

    # -------------------------------------------------------------------- internals

    def _book(self, salt: str) -> _Book:
        book = self._active.get(salt)
        if book is None:
            book = self._retired.pop(salt, None) or _Book()
            self._active[salt] = book
        return book
