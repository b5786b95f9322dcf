"""Per-request state of LMCache MP clients: lookups in flight, their read leases.

LMCache's scheduler sends ``lookup`` (answered at once), polls ``query_prefetch_status``
for the hit count, and its workers then retrieve the hit chunks, each retrieve taking
over the read locks the lookup took. ``free_lookup_locks`` releases some of them early
and ``end_session`` the rest. A ``Session`` keeps, per request id, the lookup's result
and the read leases still held, by object key; the leases also end on their own when
their time runs out (the store's lease sweep), so a client that vanishes leaks nothing.

Must not: touch the store (the service releases what ``take``/``drop`` hand back).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvatlas.core.keys import ObjectKey
from kvatlas.core.server.l1pool import LeaseId


@dataclass
class Session:
    hit_chunks: int | None = None
    """The lookup's hit count once known; None while its peer fetch runs."""
    done: threading.Event = field(default_factory=threading.Event)
    leases: dict[ObjectKey, list[LeaseId]] = field(default_factory=dict)


class Sessions:
    """Sessions by request id, at most ``limit`` (the oldest is dropped beyond it)."""

    def __init__(self, limit: int = 65536) -> None:
        self._lock = threading.Lock()
        self._by_id: OrderedDict[str, Session] = OrderedDict()
        self._limit = limit
        self.dropped = 0
        """Sessions dropped for the limit (their leases were handed back)."""

    def begin(self, request_id: str) -> tuple[Session, list[LeaseId]]:
        """A fresh session for a lookup; returns the leases of the one it replaces and
        of any dropped for the limit (the caller releases them)."""
        stale: list[LeaseId] = []
        with self._lock:
            old = self._by_id.pop(request_id, None)
            if old is not None:
                stale += _all(old)
            while len(self._by_id) >= self._limit:
                _, gone = self._by_id.popitem(last=False)
                stale += _all(gone)
                self.dropped += 1
            s = self._by_id[request_id] = Session()
        return s, stale

    def get(self, request_id: str) -> Session | None:
        with self._lock:
            return self._by_id.get(request_id)

    def take(self, request_id: str, keys: Sequence[ObjectKey]) -> dict[ObjectKey, LeaseId]:
        """One lease per key of ``keys`` that the session holds, handed over."""
        out: dict[ObjectKey, LeaseId] = {}
        with self._lock:
            s = self._by_id.get(request_id)
            if s is None:
                return out
            for key in keys:
                held = s.leases.get(key)
                if held:
                    out[key] = held.pop()
                    if not held:
                        del s.leases[key]
        return out

    def take_all(self, request_id: str, keys: Sequence[ObjectKey]) -> list[LeaseId]:
        """Every lease the session holds on ``keys``."""
        out: list[LeaseId] = []
        with self._lock:
            s = self._by_id.get(request_id)
            if s is not None:
                for key in keys:
                    out += s.leases.pop(key, [])
        return out

    def end(self, request_id: str) -> tuple[Session | None, list[LeaseId]]:
        with self._lock:
            s = self._by_id.pop(request_id, None)
        return s, (_all(s) if s is not None else [])

    def clear(self) -> list[LeaseId]:
        with self._lock:
            out = [lid for s in self._by_id.values() for lid in _all(s)]
            self._by_id.clear()
        return out

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_id)


def _all(s: Session) -> list[LeaseId]:
    return [lid for held in s.leases.values() for lid in held]
