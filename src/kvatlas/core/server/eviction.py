"""L1 eviction orders: which READY chunk the pool evicts first.

Owns the ``EvictionPolicy`` interface the pool asks (``candidates``, and
``salt_candidates`` for per-tenant shares) and its one implementation, ``LRUPolicy``
(kept globally and per ``cache_salt``, LMCache's isolated LRU), chosen by name
(``--eviction-policy``, ``make_policy``).

Must not: know slots, offsets or leases (the pool skips locked candidates itself).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import Protocol

from kvatlas.core.errors import InvalidInput
from kvatlas.core.keys import ObjectKey


class EvictionPolicy(Protocol):
    """Orders READY chunks for eviction. The pool skips locked candidates itself."""

    name: str

    def add(self, key: ObjectKey) -> None: ...
    def touch(self, key: ObjectKey) -> None: ...
    def remove(self, key: ObjectKey) -> None: ...
    def candidates(self) -> Iterator[ObjectKey]:
        """Keys in eviction order (first = evict first). The pool does not mutate the
        policy while iterating."""
        ...

    def salt_candidates(self, cache_salt: str) -> Iterator[ObjectKey]:
        """The keys of one ``cache_salt`` in eviction order, without walking the others'
        (what per-tenant shares ask for); same rule about mutation."""
        ...


class LRUPolicy:
    """Least recently used first (an OrderedDict; most recent at the end), kept globally
    and per ``cache_salt`` (LMCache's isolated LRU: one order per salt), so that either
    walk starts at its least recently used key."""

    name = "LRU"

    def __init__(self) -> None:
        self._order: OrderedDict[ObjectKey, None] = OrderedDict()
        self._by_salt: dict[str, OrderedDict[ObjectKey, None]] = {}

    def add(self, key: ObjectKey) -> None:
        self._order[key] = None
        self._order.move_to_end(key)
        salt = self._by_salt.get(key.cache_salt)
        if salt is None:
            salt = self._by_salt[key.cache_salt] = OrderedDict()
        salt[key] = None
        salt.move_to_end(key)

    def touch(self, key: ObjectKey) -> None:
        if key in self._order:
            self._order.move_to_end(key)
            self._by_salt[key.cache_salt].move_to_end(key)

    def remove(self, key: ObjectKey) -> None:
        if key in self._order:
            del self._order[key]
            salt = self._by_salt[key.cache_salt]
            del salt[key]
            if not salt:
                del self._by_salt[key.cache_salt]

    def candidates(self) -> Iterator[ObjectKey]:
        return iter(self._order)

    def salt_candidates(self, cache_salt: str) -> Iterator[ObjectKey]:
        return iter(self._by_salt.get(cache_salt, ()))


POLICIES: dict[str, type[LRUPolicy]] = {"LRU": LRUPolicy}


def make_policy(name: str) -> EvictionPolicy:
    """The policy called ``name`` (case-insensitive); InvalidInput names the accepted ones."""
    cls = POLICIES.get(name.upper())
    if cls is None:
        accepted = ", ".join(sorted(POLICIES))
        raise InvalidInput(f"unknown eviction policy {name!r}; accepted: {accepted}")
    return cls()
