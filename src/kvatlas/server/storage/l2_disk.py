"""The disk L2 backend: one file per chunk in one directory, found again after a restart.

Owns the on-disk format and the directory's LRU. It follows the ``L2Adapter`` contract in
``kvatlas.server.storage.l2`` and, like every adapter, records events instead of delivering them
and does not log.

File ``<blake3(msgpack(key)) hex>.kv`` (safe names whatever the key holds)::

    b"KVL2" | version u8 | 3 zero bytes | header length u32 LE | msgpack header | data

The header carries the full ObjectKey, the size and the checksum, so opening the
directory rebuilds the index by reading headers only (data is verified on read, by
``get_into``). A write goes to a hidden temp file renamed over the target with
``os.replace``, so a crash leaves the old file or the new one, never half of one; stray
temp files and files whose header does not parse, whose name does not match their key or
whose length does not match their header are removed when the directory is opened.
Files are not fsync'ed by default: L2 is a cache and every read is checksummed.

Eviction order is LRU by access; an access also bumps the file's mtime so that the order
roughly survives a restart (opening sorts by mtime, whose granularity is the kernel's
coarse clock, a few milliseconds).
"""

from __future__ import annotations

import builtins
import contextlib
import os
import secrets
import struct
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Final

import msgspec
from blake3 import blake3

from kvatlas.core.checksum import checksum as compute_checksum
from kvatlas.core.errors import InvalidInput
from kvatlas.core.keys import ObjectKey
from kvatlas.core.server.l1pool import PoolEvent
from kvatlas.core.types import EventType
from kvatlas.server.storage.l2 import L2Capabilities, L2Error, L2Item, as_bytes_view, check_capacity

MAGIC: Final = b"KVL2"
VERSION: Final = 1
_PREFIX = struct.Struct("<4sB3xI")
SUFFIX: Final = ".kv"
TMP_SUFFIX: Final = ".tmp"
_MAX_HEADER = 1 << 16


class _Header(msgspec.Struct, array_like=True, frozen=True):
    key: ObjectKey
    size: int
    checksum: int


_encode_header = msgspec.msgpack.Encoder().encode
_decode_header = msgspec.msgpack.Decoder(_Header).decode


@dataclass(frozen=True, slots=True)
class _Entry:
    path: Path
    size: int
    checksum: int
    data_offset: int
    file_bytes: int


def file_name(key: ObjectKey) -> str:
    """The file name of ``key``: hex of blake3 over its msgpack encoding."""
    return blake3(msgspec.msgpack.encode(key)).hexdigest() + SUFFIX


class DiskL2Adapter:
    """L2 on a local directory (created when missing), at most ``capacity_bytes`` of files."""

    name = "disk"
    capabilities: ClassVar[L2Capabilities] = L2Capabilities(persistent=True)

    def __init__(
        self, path: str | os.PathLike[str], capacity_bytes: int, fsync: bool = False
    ) -> None:
        if capacity_bytes <= 0:
            raise InvalidInput(f"L2 capacity must be positive, got {capacity_bytes}")
        self.path = Path(path)
        self._capacity = capacity_bytes
        self._fsync = fsync
        self._index: OrderedDict[ObjectKey, _Entry] = OrderedDict()
        self._used = 0
        self._events: builtins.list[PoolEvent] = []
        self.discarded_on_open = 0
        """Files removed when opening: stray temp files and unreadable chunks."""
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            self._scan()
        except OSError as exc:
            raise L2Error(f"cannot open L2 directory {self.path}: {exc}") from exc
        self._evict_until(0)

    # ------------------------------------------------------------------------- contract

    def put(self, key: ObjectKey, data: bytes | bytearray | memoryview, checksum: int) -> None:
        view = as_bytes_view(data)
        header = _encode_header(_Header(key, view.nbytes, checksum))
        prefix = _PREFIX.pack(MAGIC, VERSION, len(header))
        file_bytes = len(prefix) + len(header) + view.nbytes
        check_capacity(self.name, file_bytes, self._capacity)
        name = file_name(key)
        replaced = self._forget(key)
        self._evict_until(file_bytes)
        target = self.path / name
        tmp = self.path / f".{name}.{secrets.token_hex(4)}{TMP_SUFFIX}"
        try:
            with open(tmp, "wb") as f:
                f.write(prefix)
                f.write(header)
                f.write(view)
                if self._fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, target)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            if replaced is not None and replaced.path.exists():
                self._index[key] = replaced  # the old file is still intact: keep serving it
                self._used += replaced.file_bytes
            raise L2Error(f"cannot write L2 chunk {target}: {exc}") from exc
        entry = _Entry(target, view.nbytes, checksum, len(prefix) + len(header), file_bytes)
        self._index[key] = entry
        self._used += file_bytes
        self._events.append(PoolEvent(EventType.STORE, key, view.nbytes, "stored"))

    def get_into(self, key: ObjectKey, buf: memoryview) -> int | None:
        entry = self._index.get(key)
        if entry is None:
            return None
        if entry.size > buf.nbytes:
            raise InvalidInput(
                f"buffer of {buf.nbytes} bytes is smaller than the chunk ({entry.size})"
            )
        target = as_bytes_view(buf)[: entry.size]
        try:
            with open(entry.path, "rb", buffering=0) as f:
                f.seek(entry.data_offset)
                got = 0
                while got < entry.size:
                    n = f.readinto(target[got:])
                    if not n:
                        break
                    got += n
        except FileNotFoundError:
            self._drop(key, "lost")
            return None
        except OSError as exc:
            raise L2Error(f"cannot read L2 chunk {entry.path}: {exc}") from exc
        if got != entry.size or compute_checksum(target) != entry.checksum:
            self._drop(key, "corrupt")
            return None
        self._index.move_to_end(key)
        with contextlib.suppress(OSError):  # the order is a hint; the read itself succeeded
            os.utime(entry.path)  # keeps the LRU order across restarts
        return entry.size

    def item(self, key: ObjectKey) -> L2Item | None:
        entry = self._index.get(key)
        return None if entry is None else L2Item(key, entry.size, entry.checksum)

    def contains(self, key: ObjectKey) -> bool:
        return key in self._index

    def delete(self, key: ObjectKey) -> bool:
        return self._drop(key, "deleted")

    def take_events(self) -> builtins.list[PoolEvent]:
        events, self._events = self._events, []
        return events

    def list(self) -> Iterator[L2Item]:
        return iter([L2Item(k, e.size, e.checksum) for k, e in self._index.items()])

    def usage(self) -> tuple[int, int]:
        return self._used, self._capacity

    def close(self) -> None:
        """Nothing is held open between calls; the files stay for the next start."""
        self._index.clear()
        self._used = 0

    # ------------------------------------------------------------------------ internals

    def _scan(self) -> None:
        found: builtins.list[tuple[int, ObjectKey, _Entry]] = []
        for child in self.path.iterdir():
            if child.name.endswith(TMP_SUFFIX) and child.name.startswith("."):
                child.unlink(missing_ok=True)
                self.discarded_on_open += 1
                continue
            if not child.name.endswith(SUFFIX) or not child.is_file():
                continue  # not ours: leave it alone
            parsed = self._read_header(child)
            if parsed is None:
                child.unlink(missing_ok=True)
                self.discarded_on_open += 1
                continue
            key, entry, mtime_ns = parsed
            found.append((mtime_ns, key, entry))
        for _, key, entry in sorted(found, key=lambda t: (t[0], t[2].path.name)):
            self._index[key] = entry
            self._used += entry.file_bytes

    @staticmethod
    def _read_header(path: Path) -> tuple[ObjectKey, _Entry, int] | None:
        try:
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                magic, version, header_len = _PREFIX.unpack(f.read(_PREFIX.size))
                if magic != MAGIC or version != VERSION or header_len > _MAX_HEADER:
                    return None
                header = _decode_header(f.read(header_len))
        except (OSError, struct.error, msgspec.DecodeError):
            return None
        data_offset = _PREFIX.size + header_len
        if path.name != file_name(header.key) or st.st_size != data_offset + header.size:
            return None
        entry = _Entry(path, header.size, header.checksum, data_offset, st.st_size)
        return header.key, entry, st.st_mtime_ns

    def _evict_until(self, incoming: int) -> None:
        while self._index and self._used + incoming > self._capacity:
            victim = next(iter(self._index))
            self._drop(victim, "evicted")

    def _forget(self, key: ObjectKey) -> _Entry | None:
        entry = self._index.pop(key, None)
        if entry is not None:
            self._used -= entry.file_bytes
        return entry

    def _drop(self, key: ObjectKey, reason: str) -> bool:
        entry = self._forget(key)
        if entry is None:
            return False
        try:
            entry.path.unlink(missing_ok=True)
        except OSError as exc:
            raise L2Error(f"cannot remove L2 chunk {entry.path}: {exc}") from exc
        self._events.append(PoolEvent(EventType.DELETE, key, entry.size, reason))
        return True
