"""One conformance suite for every L2 adapter (HOUSE_STYLE habit 6).

Tests that need a capability (persistence, bytes on disk to corrupt) are parametrized only
over the backends that declare it, so no backend is skipped at run time.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvatlas.core.checksum import checksum
from kvatlas.core.errors import InvalidInput
from kvatlas.core.keys import ObjectKey
from kvatlas.core.server.l1pool import PoolEvent
from kvatlas.core.types import EventType
from kvatlas.server.storage.l2 import L2Adapter, L2Capabilities, L2Item, MemoryL2Adapter
from kvatlas.server.storage.l2_disk import DiskL2Adapter, file_name


@dataclass(frozen=True)
class Backend:
    name: str
    capabilities: L2Capabilities
    open: Callable[[Path, int], L2Adapter]
    """Open (or reopen) the backend at a location with a capacity."""
    corrupt: Callable[[L2Adapter, ObjectKey], None] | None = None
    """Damage one stored chunk behind the adapter's back; None when there is no way to."""
    header_bytes: int = 0
    """At most this many bytes a chunk costs beyond its data (per-file header)."""


def _flip_a_byte_on_disk(adapter: L2Adapter, key: ObjectKey) -> None:
    assert isinstance(adapter, DiskL2Adapter)
    path = adapter.path / file_name(key)
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))


DISK = Backend(
    "disk",
    DiskL2Adapter.capabilities,
    lambda p, cap: DiskL2Adapter(p / "l2", cap),
    _flip_a_byte_on_disk,
    header_bytes=512,
)
MEMORY = Backend("memory", MemoryL2Adapter.capabilities, lambda p, cap: MemoryL2Adapter(cap))
BACKENDS = [DISK, MEMORY]
PERSISTENT = [b for b in BACKENDS if b.capabilities.persistent]
CORRUPTIBLE = [b for b in BACKENDS if b.corrupt is not None]

all_backends = pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)


def key(i: int, model: str = "m") -> ObjectKey:
    return ObjectKey(i.to_bytes(32, "big"), model, 16777472, 0, "salt/../x")


def payload(i: int, size: int = 10_000) -> bytes:
    return bytes((i * 7 + j) % 251 for j in range(size))


@pytest.fixture
def opened(tmp_path: Path) -> Iterator[Callable[[Backend, int], L2Adapter]]:
    adapters: list[L2Adapter] = []

    def open_(backend: Backend, capacity: int = 1 << 20) -> L2Adapter:
        adapter = backend.open(tmp_path, capacity)
        adapters.append(adapter)
        return adapter

    yield open_
    for adapter in adapters:
        adapter.close()


@all_backends
def test_put_get_roundtrip(backend: Backend, opened: Callable[[Backend, int], L2Adapter]) -> None:
    l2 = opened(backend, 1 << 20)
    data = payload(1)
    l2.put(key(1), memoryview(data), checksum(data))
    buf = bytearray(len(data) + 100)
    assert l2.get_into(key(1), memoryview(buf)) == len(data)
    assert bytes(buf[: len(data)]) == data
    assert l2.item(key(1)) == L2Item(key(1), len(data), checksum(data))
    assert l2.get_into(key(2), memoryview(buf)) is None
    with pytest.raises(InvalidInput, match="smaller"):
        l2.get_into(key(1), memoryview(bytearray(10)))


@all_backends
def test_contains_delete_list_and_events(
    backend: Backend, opened: Callable[[Backend, int], L2Adapter]
) -> None:
    l2 = opened(backend, 1 << 20)
    for i in range(3):
        l2.put(key(i), payload(i, 1000 + i), checksum(payload(i, 1000 + i)))
    assert all(l2.contains(key(i)) for i in range(3))
    assert {item.key for item in l2.list()} == {key(0), key(1), key(2)}
    assert l2.delete(key(1)) and not l2.delete(key(1))
    assert not l2.contains(key(1))
    assert sorted(item.size for item in l2.list()) == [1000, 1002]
    assert l2.take_events() == [
        PoolEvent(EventType.STORE, key(0), 1000, "stored"),
        PoolEvent(EventType.STORE, key(1), 1001, "stored"),
        PoolEvent(EventType.STORE, key(2), 1002, "stored"),
        PoolEvent(EventType.DELETE, key(1), 1001, "deleted"),
    ]
    assert l2.take_events() == []
    used, cap = l2.usage()
    assert cap == 1 << 20 and 2002 <= used <= 2002 + 2 * backend.header_bytes


@all_backends
def test_put_replaces_an_existing_key(
    backend: Backend, opened: Callable[[Backend, int], L2Adapter]
) -> None:
    l2 = opened(backend, 1 << 20)
    l2.put(key(1), payload(1), checksum(payload(1)))
    l2.put(key(1), payload(2, 500), checksum(payload(2, 500)))
    buf = bytearray(10_000)
    assert l2.get_into(key(1), memoryview(buf)) == 500
    assert bytes(buf[:500]) == payload(2, 500)
    assert len(list(l2.list())) == 1
    assert l2.usage()[0] <= 500 + backend.header_bytes


@all_backends
def test_capacity_evicts_least_recently_used(
    backend: Backend, opened: Callable[[Backend, int], L2Adapter]
) -> None:
    size = 10_000
    l2 = opened(backend, 3 * (size + backend.header_bytes))
    for i in range(3):
        l2.put(key(i), payload(i, size), checksum(payload(i, size)))
    buf = memoryview(bytearray(size))
    assert l2.get_into(key(0), buf) == size  # 0 is now more recent than 1
    l2.take_events()
    l2.put(key(3), payload(3, size), checksum(payload(3, size)))
    assert not l2.contains(key(1))
    assert {i for i in range(4) if l2.contains(key(i))} == {0, 2, 3}
    assert l2.take_events() == [
        PoolEvent(EventType.DELETE, key(1), size, "evicted"),
        PoolEvent(EventType.STORE, key(3), size, "stored"),
    ]
    used, cap = l2.usage()
    assert used <= cap
    with pytest.raises(InvalidInput, match="does not fit"):
        l2.put(key(9), bytes(cap + 1), 0)


@pytest.mark.parametrize("backend", CORRUPTIBLE, ids=lambda b: b.name)
def test_corrupt_chunk_is_never_served(
    backend: Backend, opened: Callable[[Backend, int], L2Adapter]
) -> None:
    assert backend.corrupt is not None
    l2 = opened(backend, 1 << 20)
    data = payload(5)
    l2.put(key(5), data, checksum(data))
    l2.take_events()
    backend.corrupt(l2, key(5))
    assert l2.get_into(key(5), memoryview(bytearray(len(data)))) is None
    assert not l2.contains(key(5))
    assert l2.take_events() == [PoolEvent(EventType.DELETE, key(5), len(data), "corrupt")]


@pytest.mark.parametrize("backend", PERSISTENT, ids=lambda b: b.name)
def test_restart_finds_every_chunk(
    backend: Backend, opened: Callable[[Backend, int], L2Adapter]
) -> None:
    first = opened(backend, 1 << 20)
    keys = [key(i, model=f"model-{i % 2}") for i in range(5)]
    for i, k in enumerate(keys):
        first.put(k, payload(i), checksum(payload(i)))
    first.close()
    again = opened(backend, 1 << 20)
    assert sorted((item.key.chunk_hash, item.key.model_name) for item in again.list()) == sorted(
        (k.chunk_hash, k.model_name) for k in keys
    )
    assert {item.key for item in again.list()} == set(keys)
    buf = bytearray(10_000)
    assert again.get_into(keys[3], memoryview(buf)) == 10_000
    assert bytes(buf) == payload(3)
    assert again.take_events() == []


def test_disk_open_discards_temp_and_damaged_files(tmp_path: Path) -> None:
    l2 = DiskL2Adapter(tmp_path, 1 << 20)
    l2.put(key(1), payload(1), checksum(payload(1)))
    l2.put(key(2), payload(2), checksum(payload(2)))
    (tmp_path / f".{file_name(key(3))}.abcd.tmp").write_bytes(b"half a chunk")
    (tmp_path / file_name(key(2))).write_bytes(b"KVL2 garbage")  # bad header
    (tmp_path / "README").write_text("not ours")
    l2.close()
    again = DiskL2Adapter(tmp_path, 1 << 20)
    assert [item.key for item in again.list()] == [key(1)]
    assert again.discarded_on_open == 2
    assert (tmp_path / "README").exists()


def test_disk_file_names_are_safe_hex(tmp_path: Path) -> None:
    l2 = DiskL2Adapter(tmp_path, 1 << 20)
    l2.put(ObjectKey(b"\x00/..", "../../etc", 1, 0, "a/b"), b"x", checksum(b"x"))
    (name,) = os.listdir(tmp_path)
    stem = name.removesuffix(".kv")
    assert len(stem) == 64 and int(stem, 16) >= 0


def test_disk_reopen_with_smaller_capacity_trims(tmp_path: Path) -> None:
    l2 = DiskL2Adapter(tmp_path, 1 << 20)
    for i in range(4):
        l2.put(key(i), payload(i), checksum(payload(i)))
    l2.close()
    small = DiskL2Adapter(tmp_path, 25_000)
    assert small.usage()[0] <= 25_000
    assert len(list(small.list())) == 2
    assert [e.kind for e in small.take_events()] == [EventType.DELETE] * 2
