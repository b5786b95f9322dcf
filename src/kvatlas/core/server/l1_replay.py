"""The L1 journal's records and their replay: what a warm restart may keep (pure).

Owns the record format of the journal ``kvatlas.server.storage.l1_journal`` appends beside
the L1 region, and the replay that turns a journal into the slots a restarted server
may put back. It must not do I/O, read a clock or log: the shell reads the file, checks
each kept chunk's checksum against the region's bytes and fills a fresh pool.

Records, in the order the server's lock saw them::

    RESERVE  key offset reserved    a write lease was handed out on [offset, +reserved)
    COMMIT   key offset size sum    the write was sealed (sum None: checksum to come)
    CHECKSUM key sum                the checksum of a chunk committed without one
    DROP     key                    the key's chunk or write is gone (evicted, deleted,
                                    aborted, expired)

Frame: ``u32 LE payload length | u32 LE crc32(payload) | payload``, the payload a
msgpack array ``[kind, key, offset, size, checksum]``. A frame whose length runs past
the end or whose crc does not match ends the replay (a write torn by SIGKILL): what
follows it is not trusted.

Replay keeps the last state of each key: COMMITs become ``Kept`` chunks (to be verified
against their checksum), RESERVEs never committed become ``Pending`` writes, whose bytes
are not trusted but whose range a writer of the previous process may still be filling,
so the new process holds it for one write lease before reusing it. Ranges never overlap
in a live pool; should two survivors overlap all the same (a record lost before a torn
tail), only the newest of each overlapping group survives.
"""

from __future__ import annotations

import enum
import struct
import zlib
from dataclasses import dataclass
from typing import Final

import msgspec

from kvatlas.core.keys import ObjectKey

_FRAME: Final = struct.Struct("<II")
FRAME_BYTES: Final = _FRAME.size
MAX_RECORD_BYTES: Final = 1 << 16
"""A record longer than this is corrupt (a key is a few hundred bytes at most)."""


class RecordKind(enum.IntEnum):
    RESERVE = 1
    COMMIT = 2
    CHECKSUM = 3
    DROP = 4


class Record(msgspec.Struct, array_like=True, frozen=True, gc=False):
    kind: RecordKind
    key: ObjectKey
    offset: int = 0
    size: int = 0
    checksum: int | None = None


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(Record).decode


def encode(record: Record) -> bytes:
    """One framed record."""
    payload = _encode(record)
    return _FRAME.pack(len(payload), zlib.crc32(payload)) + payload


def encode_many(records: list[Record]) -> bytes:
    return b"".join(encode(r) for r in records)


@dataclass(frozen=True, slots=True)
class Kept:
    """A sealed chunk the journal says is at ``offset``; ``checksum`` None: committed
    before its checksum was known (the shell computes it from the bytes)."""

    key: ObjectKey
    offset: int
    size: int
    checksum: int | None
    seq: int


@dataclass(frozen=True, slots=True)
class Pending:
    """A write the previous process handed out and never sealed: its range is held."""

    key: ObjectKey
    offset: int
    reserved: int
    seq: int


@dataclass(frozen=True, slots=True)
class Replayed:
    kept: tuple[Kept, ...]
    """Sealed chunks, by offset."""
    pending: tuple[Pending, ...]
    """Unsealed writes, by offset."""
    records: int
    """Records read."""
    torn: bool
    """The journal ended in a torn or corrupt frame (its tail was ignored)."""
    overlapping: int
    """Survivors dropped because a newer one overlapped them."""


def replay(data: bytes | memoryview, start: int, align_bytes: int, capacity: int) -> Replayed:
    """Replay the records in ``data[start:]`` for a pool of ``capacity`` bytes aligned
    to ``align_bytes``; records outside the pool or misaligned are corrupt (end)."""
    view = memoryview(data)
    kept: dict[ObjectKey, Kept] = {}
    pending: dict[ObjectKey, Pending] = {}
    pos, seq, torn = start, 0, False
    while pos < len(view):
        if pos + FRAME_BYTES > len(view):
            torn = True
            break
        length, crc = _FRAME.unpack_from(view, pos)
        body = view[pos + FRAME_BYTES : pos + FRAME_BYTES + length]
        if length > MAX_RECORD_BYTES or len(body) < length or zlib.crc32(body) != crc:
            torn = True
            break
        try:
            record = _decode(body)
        except (msgspec.DecodeError, ValueError):
            torn = True
            break
        if not _in_pool(record, align_bytes, capacity):
            torn = True
            break
        pos += FRAME_BYTES + length
        seq += 1
        key = record.key
        if record.kind is RecordKind.RESERVE:
            pending[key] = Pending(key, record.offset, record.size, seq)
        elif record.kind is RecordKind.COMMIT:
            pending.pop(key, None)
            kept[key] = Kept(key, record.offset, record.size, record.checksum, seq)
        elif record.kind is RecordKind.CHECKSUM:
            old = kept.get(key)
            if old is not None:
                kept[key] = Kept(key, old.offset, old.size, record.checksum, old.seq)
        else:
            kept.pop(key, None)
            pending.pop(key, None)
    survivors, overlapping = _without_overlaps([*kept.values(), *pending.values()], align_bytes)
    return Replayed(
        tuple(s for s in survivors if isinstance(s, Kept)),
        tuple(s for s in survivors if isinstance(s, Pending)),
        seq,
        torn,
        overlapping,
    )


def _in_pool(record: Record, align_bytes: int, capacity: int) -> bool:
    if record.kind not in (RecordKind.RESERVE, RecordKind.COMMIT):
        return True
    return (
        record.offset >= 0
        and record.offset % align_bytes == 0
        and record.size > 0
        and record.offset + record.size <= capacity
    )


def _span(entry: Kept | Pending, align_bytes: int) -> int:
    size = entry.size if isinstance(entry, Kept) else entry.reserved
    return -(-size // align_bytes) * align_bytes


def _without_overlaps(
    entries: list[Kept | Pending], align_bytes: int
) -> tuple[list[Kept | Pending], int]:
    """By offset, keeping only the newest (highest seq) of each overlapping group."""
    entries.sort(key=lambda e: e.offset)
    out: list[Kept | Pending] = []
    dropped = 0
    group: list[Kept | Pending] = []
    group_end = -1
    for entry in entries:
        end = entry.offset + _span(entry, align_bytes)
        if group and entry.offset >= group_end:
            out.append(max(group, key=lambda e: e.seq))
            dropped += len(group) - 1
            group = []
        group_end = max(group_end, end) if group else end
        group.append(entry)
    if group:
        out.append(max(group, key=lambda e: e.seq))
        dropped += len(group) - 1
    return out, dropped
