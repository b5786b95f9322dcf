"""The L2 tier's interface, its records, and the in-memory backend.

Owns what every L2 backend promises (``L2Adapter``) and the small in-memory backend used
by server tests and as the second backend of the conformance suite
(tests/server/test_l2_conformance.py). The disk backend lives in ``l2_disk``. Adapters are
single-threaded (the chunk store's caller holds a lock) and must not log or deliver
events: like the L1 pool they record STORE/DELETE events that ``take_events()`` drains.

Contract of every adapter:

- ``put`` stores (or replaces) a chunk with the checksum the caller computed; the data is
  not re-hashed. When storing would exceed the capacity, the adapter first evicts its
  least recently used chunks (DELETE, reason ``evicted``). A chunk larger than the whole
  capacity raises InvalidInput; a backend failure raises L2Error.
- ``get_into`` copies a chunk into ``buf`` and verifies its checksum. It returns the
  number of bytes read, or None when the chunk is absent *or corrupt*; a corrupt chunk is
  dropped (DELETE, reason ``corrupt``) so that it is never served, and ``buf``'s contents
  are then undefined. A ``buf`` smaller than the chunk raises InvalidInput. A hit counts
  as an access for the eviction order.
- ``list()`` yields every chunk, least recently used first.
"""

from __future__ import annotations

import builtins
from collections import OrderedDict
from collections.abc import Iterator
from typing import ClassVar, Protocol

import msgspec

from kvatlas.core.checksum import checksum as compute_checksum
from kvatlas.core.errors import InvalidInput
from kvatlas.core.keys import ObjectKey
from kvatlas.core.server.l1pool import PoolEvent
from kvatlas.core.types import EventType
from kvatlas.server.errors import ServerError


class L2Error(ServerError):
    """An L2 backend failed (disk full, permissions, ...); the message names the path."""


class L2Item(msgspec.Struct, frozen=True, gc=False):
    """One chunk held by an L2 backend."""

    key: ObjectKey
    size: int
    checksum: int


class L2Capabilities(msgspec.Struct, frozen=True):
    """What a backend can do beyond the contract; the conformance suite selects tests by it."""

    persistent: bool
    """Chunks survive closing and reopening the adapter on the same location."""


class L2Adapter(Protocol):
    """The interface every L2 backend implements (see the module docstring)."""

    name: str
    capabilities: ClassVar[L2Capabilities]

    def put(self, key: ObjectKey, data: bytes | bytearray | memoryview, checksum: int) -> None: ...
    def get_into(self, key: ObjectKey, buf: memoryview) -> int | None: ...
    def item(self, key: ObjectKey) -> L2Item | None: ...
    def contains(self, key: ObjectKey) -> bool: ...
    def delete(self, key: ObjectKey) -> bool: ...
    def take_events(self) -> builtins.list[PoolEvent]: ...
    def list(self) -> Iterator[L2Item]: ...
    def usage(self) -> tuple[int, int]:
        """(used bytes, capacity bytes)."""
        ...

    def close(self) -> None: ...


def as_bytes_view(data: bytes | bytearray | memoryview) -> memoryview:
    """``data`` as a flat, contiguous byte view (InvalidInput for a non-contiguous view)."""
    view = memoryview(data)
    if not view.c_contiguous:
        raise InvalidInput("L2 data must be a contiguous buffer")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def check_capacity(name: str, size: int, capacity: int) -> None:
    if size > capacity:
        raise InvalidInput(
            f"chunk of {size} bytes does not fit in the {name} L2 tier of {capacity} bytes"
        )


class MemoryL2Adapter:
    """L2 in process memory: LRU by access, not persistent. For tests and small setups."""

    name = "memory"
    capabilities: ClassVar[L2Capabilities] = L2Capabilities(persistent=False)

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise InvalidInput(f"L2 capacity must be positive, got {capacity_bytes}")
        self._capacity = capacity_bytes
        self._chunks: OrderedDict[ObjectKey, tuple[bytes, int]] = OrderedDict()
        self._used = 0
        self._events: builtins.list[PoolEvent] = []

    def put(self, key: ObjectKey, data: bytes | bytearray | memoryview, checksum: int) -> None:
        view = as_bytes_view(data)
        check_capacity(self.name, view.nbytes, self._capacity)
        self._discard(key)
        while self._used + view.nbytes > self._capacity:
            victim, (old, _) = self._chunks.popitem(last=False)
            self._used -= len(old)
            self._events.append(PoolEvent(EventType.DELETE, victim, len(old), "evicted"))
        self._chunks[key] = (view.tobytes(), checksum)
        self._used += view.nbytes
        self._events.append(PoolEvent(EventType.STORE, key, view.nbytes, "stored"))

    def get_into(self, key: ObjectKey, buf: memoryview) -> int | None:
        found = self._chunks.get(key)
        if found is None:
            return None
        data, expected = found
        if len(data) > buf.nbytes:
            raise InvalidInput(
                f"buffer of {buf.nbytes} bytes is smaller than the chunk ({len(data)})"
            )
        target = as_bytes_view(buf)[: len(data)]
        target[:] = data
        if compute_checksum(target) != expected:
            self._discard(key)
            self._events.append(PoolEvent(EventType.DELETE, key, len(data), "corrupt"))
            return None
        self._chunks.move_to_end(key)
        return len(data)

    def item(self, key: ObjectKey) -> L2Item | None:
        found = self._chunks.get(key)
        return None if found is None else L2Item(key, len(found[0]), found[1])

    def contains(self, key: ObjectKey) -> bool:
        return key in self._chunks

    def delete(self, key: ObjectKey) -> bool:
        size = self._discard(key)
        if size is None:
            return False
        self._events.append(PoolEvent(EventType.DELETE, key, size, "deleted"))
        return True

    def take_events(self) -> builtins.list[PoolEvent]:
        events, self._events = self._events, []
        return events

    def list(self) -> Iterator[L2Item]:
        return iter([L2Item(k, len(d), c) for k, (d, c) in self._chunks.items()])

    def usage(self) -> tuple[int, int]:
        return self._used, self._capacity

    def close(self) -> None:
        self._chunks.clear()
        self._used = 0

    def _discard(self, key: ObjectKey) -> int | None:
        found = self._chunks.pop(key, None)
        if found is None:
            return None
        self._used -= len(found[0])
        return len(found[0])
