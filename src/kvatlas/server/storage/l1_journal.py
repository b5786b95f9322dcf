"""Warm restart: the journal beside a kept L1 region, and the recovery that reads it.

Owns the file ``/dev/shm/<region name>.journal`` and the decision, at start, whether a
kept region's bytes may be served again. The region (``runtime.region.L1Region.keep``)
outlives the process, so a server that exits (SIGTERM for an upgrade, SIGKILL, a crash)
and starts again with the same ``--instance-id`` and ``--state-dir`` finds its chunks
where it left them. What the journal records, and how a replay reads it, is
``kvatlas.core.server.l1_replay``; the chunk store calls this journal under its lock.

File: a superblock (``b"KVJ1"`` | u32 LE length | msgpack ``Superblock``), then framed
records appended with one ``write`` each (a SIGKILL cannot lose a record the lock had
handed back; it can tear the last one, which the replay ignores). The file is rewritten
from the pool (compacted) when its records outnumber the live slots several times over,
and at every start.

A start is cold (the pool starts empty, the region's bytes are ignored) when:
- the region did not exist with this size (first start, ``--l1-size-gb`` changed, a
  reboot emptied ``/dev/shm``);
- the journal is missing or its superblock unreadable or of another format;
- the superblock names another boot (``/proc/sys/kernel/random/boot_id``), another host,
  another instance, another alignment or another capacity (the layout changed).

Otherwise each sealed chunk's bytes are checked against its checksum (in parallel
threads: xxh3 runs without the GIL for large buffers) and kept when they match; chunks
whose bytes do not match, and writes never sealed, are dropped. An unsealed write's range
is held for one write lease (``L1Pool.restore``), so that an engine of the previous
process still copying into it cannot overwrite a chunk stored there since.

Must not: decide what to do with the kept chunks beyond restoring the pool (publishing
them is the composition root's), or log (the caller logs ``WarmStart``).
"""

from __future__ import annotations

import fcntl
import os
import re
import secrets
import socket
import struct
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import msgspec
from blake3 import blake3

from kvatlas.core.checksum import checksum as compute_checksum
from kvatlas.core.errors import InvalidInput
from kvatlas.core.keys import ObjectKey
from kvatlas.core.server.l1_replay import Kept, Record, RecordKind, encode, encode_many, replay
from kvatlas.core.server.l1pool import L1Pool, SlotInfo
from kvatlas.runtime.region import SHM_DIR, L1Region

MAGIC: Final = b"KVJ1"
FORMAT: Final = 1
"""Bump when the record or superblock layout changes: an older journal then starts cold."""
_HEAD: Final = struct.Struct("<4sI")
JOURNAL_SUFFIX: Final = ".journal"
VERIFY_THREADS: Final = max(1, min(4, os.cpu_count() or 1))
COMPACT_FACTOR: Final = 4
COMPACT_SLACK: Final = 4096


class Superblock(msgspec.Struct, frozen=True):
    """What a journal's region was laid out for; a start compares it with its own."""

    format: int
    boot_id: str
    hostname: str
    instance_id: str
    state_dir: str
    region_bytes: int
    align_bytes: int
    capacity_bytes: int


def kept_region_name(instance_id: str, state_dir: Path) -> str:
    """``kvatlas-<instance>-<8 hex of the state dir>-l1``: the same for every start of
    ``instance_id`` with the same ``--state-dir``, so the next start finds it."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", instance_id)[:64] or "node"
    where = blake3(str(state_dir.resolve()).encode()).hexdigest()[:8]
    return f"kvatlas-{safe}-{where}-l1"


def journal_path(region_name: str) -> Path:
    return SHM_DIR / f"{region_name}{JOURNAL_SUFFIX}"


def discard_kept(region_name: str) -> bool:
    """Remove the region an earlier start kept under ``region_name``, and its journal,
    unless a running process holds it; True when something was removed."""
    path = SHM_DIR / region_name
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        path.unlink(missing_ok=True)
        journal_path(region_name).unlink(missing_ok=True)
        return True
    finally:
        os.close(fd)


def boot_id() -> str:
    """This boot's id ("" where the kernel does not say): a reboot changes it."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text(encoding="ascii").strip()
    except OSError:
        return ""


def superblock_for(
    instance_id: str, state_dir: Path, region_bytes: int, pool: L1Pool
) -> Superblock:
    return Superblock(
        FORMAT,
        boot_id(),
        socket.gethostname(),
        instance_id,
        str(state_dir.resolve()),
        region_bytes,
        pool.align_bytes,
        pool.capacity_bytes,
    )


@dataclass(frozen=True, slots=True)
class WarmStart:
    """What a start found in its region; ``warm`` False: a cold start, ``reason`` why."""

    warm: bool
    reason: str
    chunks: int = 0
    """Sealed chunks kept (bytes checked)."""
    bytes: int = 0
    corrupt: int = 0
    """Sealed chunks dropped: their bytes do not match their checksum."""
    unsealed: int = 0
    """Writes never sealed: dropped, their ranges held for one write lease."""
    torn: bool = False
    verify_s: float = 0.0
    """Wall time spent checking the kept chunks' bytes."""


def cold(reason: str) -> WarmStart:
    return WarmStart(False, reason)


def recover(
    region: L1Region, path: Path, expect: Superblock, pool: L1Pool, *, now: float, hold_s: float
) -> WarmStart:
    """Fill the empty ``pool`` with the chunks of the kept ``region`` the journal at
    ``path`` vouches for and whose bytes check out; a cold ``WarmStart`` (pool left
    empty) when the journal does not match ``expect``."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return cold("no journal beside the region")
    except OSError as exc:
        return cold(f"journal unreadable: {exc}")
    found, start = _read_superblock(data)
    if found is None:
        return cold("journal superblock unreadable or of another format")
    for field in ("boot_id", "hostname", "instance_id", "state_dir", "region_bytes", "align_bytes"):
        if getattr(found, field) != getattr(expect, field):
            return cold(f"region laid out for another {field.replace('_', ' ')}")
    if found.capacity_bytes != expect.capacity_bytes:
        return cold("region laid out for another capacity")
    replayed = replay(data, start, pool.align_bytes, pool.capacity_bytes)
    t0 = time.perf_counter()
    sums = _checksums(region, replayed.kept)
    verify_s = time.perf_counter() - t0
    slots: list[SlotInfo] = []
    corrupt = 0
    for kept, digest in zip(replayed.kept, sums, strict=True):
        if kept.checksum is not None and kept.checksum != digest:
            corrupt += 1
            continue
        slots.append(SlotInfo(kept.key, kept.offset, kept.size, 0, digest, committed=True))
    slots.extend(
        SlotInfo(p.key, p.offset, p.reserved, 0, 0, committed=False) for p in replayed.pending
    )
    slots.sort(key=lambda s: s.offset)
    try:
        pool.restore(slots, now, hold_s)
    except InvalidInput as exc:  # replay never yields this; a pool refusal is still cold
        return cold(f"journal inconsistent: {exc}")
    kept_bytes = sum(s.size for s in slots if s.committed)
    return WarmStart(
        True,
        "journal and region match",
        chunks=len(slots) - len(replayed.pending),
        bytes=kept_bytes,
        corrupt=corrupt,
        unsealed=len(replayed.pending),
        torn=replayed.torn,
        verify_s=verify_s,
    )


def kept_state_dir(region_name: str) -> Path | None:
    """The state dir of the server that kept the region ``region_name`` (from its
    journal's superblock); None when there is no readable journal."""
    try:
        with open(journal_path(region_name), "rb") as f:
            head = f.read(_HEAD.size + (1 << 12))
    except OSError:
        return None
    found, _ = _read_superblock(head)
    return Path(found.state_dir) if found is not None else None


def _read_superblock(data: bytes) -> tuple[Superblock | None, int]:
    if len(data) < _HEAD.size:
        return None, 0
    magic, length = _HEAD.unpack_from(data)
    end = _HEAD.size + length
    if magic != MAGIC or end > len(data):
        return None, 0
    try:
        block = msgspec.msgpack.decode(data[_HEAD.size : end], type=Superblock)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None, 0
    return (block, end) if block.format == FORMAT else (None, 0)


def _checksums(region: L1Region, kept: tuple[Kept, ...]) -> list[int]:
    """The xxh3 of every kept chunk's bytes, hashed on ``VERIFY_THREADS`` threads."""
    if not kept:
        return []

    def one(k: Kept) -> int:
        return compute_checksum(region.view(k.offset, k.size))

    if VERIFY_THREADS == 1 or len(kept) == 1:
        return [one(k) for k in kept]
    with ThreadPoolExecutor(VERIFY_THREADS, thread_name_prefix="kvatlas-l1-verify") as pool:
        return list(pool.map(one, kept, chunksize=max(1, len(kept) // (4 * VERIFY_THREADS))))


class L1Journal:
    """The append side: one record per pool change, written before the lock is let go.

    Writes that fail (``/dev/shm`` full) turn the journal off: it is truncated so that
    the next start is cold rather than trusting a journal with a hole, and ``broken``
    says why. Not thread-safe: the chunk store's lock serialises every call.
    """

    def __init__(
        self,
        path: Path,
        superblock: Superblock,
        slots: Iterable[SlotInfo] = (),
        unhashed: frozenset[ObjectKey] = frozenset(),
    ) -> None:
        """Start the file afresh with ``slots`` (what the pool holds now)."""
        self.path = path
        self._head = _head(superblock)
        self._fd = -1
        self._records = 0
        self.broken = ""
        self.compactions = -1  # the first rewrite is the start's, not a compaction
        self.rewrite(slots, unhashed)

    def reserved(self, key: ObjectKey, offset: int, reserved: int) -> None:
        self._append(Record(RecordKind.RESERVE, key, offset, reserved))

    def committed(self, info: SlotInfo, checksum_known: bool) -> None:
        checksum = info.checksum if checksum_known else None
        self._append(Record(RecordKind.COMMIT, info.key, info.offset, info.size, checksum))

    def checksum(self, key: ObjectKey, checksum: int) -> None:
        self._append(Record(RecordKind.CHECKSUM, key, checksum=checksum))

    def dropped(self, key: ObjectKey) -> None:
        self._append(Record(RecordKind.DROP, key))

    def wants_compaction(self, live: int) -> bool:
        """True when the records outnumber the ``live`` slots enough to rewrite them."""
        return not self.broken and self._records > COMPACT_FACTOR * live + COMPACT_SLACK

    def rewrite(
        self, slots: Iterable[SlotInfo], unhashed: frozenset[ObjectKey] = frozenset()
    ) -> None:
        """Replace the file by the superblock and one record per slot (a written
        slot: COMMIT, a write in progress: RESERVE), through a temp file renamed over."""
        if self.broken:
            return
        records = [
            Record(
                RecordKind.COMMIT,
                s.key,
                s.offset,
                s.size,
                None if s.key in unhashed else s.checksum,
            )
            if s.committed
            else Record(RecordKind.RESERVE, s.key, s.offset, s.reserved)
            for s in slots
        ]
        tmp = self.path.with_name(f".{self.path.name}.{secrets.token_hex(4)}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o600)
            try:
                _write_all(fd, self._head + encode_many(records))
                os.replace(tmp, self.path)
            except BaseException:
                os.close(fd)
                tmp.unlink(missing_ok=True)
                raise
        except OSError as exc:
            self._break(f"cannot rewrite {self.path}: {exc}")
            return
        if self._fd >= 0:
            os.close(self._fd)
        self._fd = fd
        self._records = len(records)
        self.compactions += 1

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _append(self, record: Record) -> None:
        if self.broken:
            return
        try:
            _write_all(self._fd, encode(record))
        except OSError as exc:
            self._break(f"cannot append to {self.path}: {exc}")
            return
        self._records += 1

    def _break(self, why: str) -> None:
        self.broken = why
        try:
            os.truncate(self.path, 0)  # a journal with a hole must not vouch for anything
        except OSError:
            self.path.unlink(missing_ok=True)
        self.close()


def _head(superblock: Superblock) -> bytes:
    body = msgspec.msgpack.encode(superblock)
    return _HEAD.pack(MAGIC, len(body)) + body


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]
