"""Snapshot files: atomic writes and startup restores of the fleet state.

Owns the file format's outer handling (the body is `FleetState.snapshot`'s bytes), atomic
replacement (write a temp file in the same folder, fsync, `os.replace`, fsync the
folder, so a crash leaves the old or the new file, never half of one), the periodic
writer thread, and the startup checks that a snapshot fits the configuration.

A failed write, whatever the cause (disk, permissions, state an encoder cannot hold), is
logged, counted (``kvatlas_coordinator_snapshot_failures``) and makes `/readyz` fail
with its reason until a write succeeds again; the writer thread never dies of it and
the next interval retries.

The file is a header and the body: ``MAGIC`` (8 bytes), the format version (u32), the
body's length (u64) and the blake3 digest of the body (32 bytes), little-endian. A file
whose header, length or digest does not match is refused at startup, naming the file and
the previous snapshot to use instead: before each write the file being replaced is kept
as ``<file>.prev`` (a hard link, so the file itself never goes missing). A file without
the header (written before the format had one) is read as a bare body with a warning;
the next write adds the header. Must not change the state: it only reads the service's
consistent snapshot bytes.
"""

from __future__ import annotations

import logging
import os
import struct
import tempfile
import threading
import time
from pathlib import Path
from typing import Final

from blake3 import blake3

from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.metrics import CoordinatorMetrics
from kvatlas.coordinator.service import CoordinatorService
from kvatlas.core.coordinator.fleet import FleetState
from kvatlas.core.errors import ConfigError, SnapshotError
from kvatlas.runtime.periodic import Periodic

log = logging.getLogger(__name__)

MAGIC: Final = b"KVATSNAP"
FORMAT_VERSION: Final = 1
_HEADER = struct.Struct("<8sIQ32s")
PREV_SUFFIX: Final = ".prev"
USAGE_SUFFIX: Final = ".l2usage"
"""The service's companion state (`Snapshots.companion` in `state.snapshots`: the L2
usage book) is written beside the snapshot under this suffix, before the snapshot itself."""


def frame(body: bytes) -> bytes:
    """``body`` behind the header that lets `unframe` tell it intact."""
    return _HEADER.pack(MAGIC, FORMAT_VERSION, len(body), blake3(body).digest()) + body


_LEGACY_FIRST_BYTES: Final = frozenset(bytes([b]) for b in (*range(0x80, 0xA0), *range(0xDC, 0xE0)))
"""A bare body is a msgpack array or map (`FleetState.snapshot`'s struct); no bit flip
of ``MAGIC``'s first byte reaches one of these."""


def unframe(data: bytes, where: object = "snapshot") -> bytes:
    """The body of a framed snapshot; SnapshotError when the header, the length or the
    digest do not match. A file without the header (the format before it) is returned
    as it is, with a warning."""
    if not data.startswith(MAGIC):
        if data[:1] in _LEGACY_FIRST_BYTES:
            log.warning(
                "%s has no header (written by an older kvatlas): reading it unchecked;"
                " the next snapshot is written with a checksum",
                where,
            )
            return data
        raise SnapshotError("not a kvatlas snapshot (no header)")
    if len(data) < _HEADER.size:
        raise SnapshotError(f"truncated header ({len(data)} bytes)")
    _, version, length, digest = _HEADER.unpack_from(data)
    if version != FORMAT_VERSION:
        raise SnapshotError(f"snapshot file format {version} is not supported")
    body = data[_HEADER.size :]
    if len(body) != length:
        raise SnapshotError(f"body is {len(body)} bytes, the header says {length}")
    if blake3(body).digest() != digest:
        raise SnapshotError("checksum mismatch: the file is corrupt")
    return body


def keep_previous(path: Path) -> None:
    """Keep the file about to be replaced as ``<path>.prev`` (hard link, else a copy),
    so a corrupt newest file leaves one to restore from."""
    prev = path.with_name(path.name + PREV_SUFFIX)
    tmp = path.with_name(f".{path.name}.prev.tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(path, tmp)
    except FileNotFoundError:
        return
    except OSError:
        tmp.write_bytes(path.read_bytes())
    os.replace(tmp, prev)


def write_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically (temp file + fsync + os.replace)."""
    folder = path.parent
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def load(config: CoordinatorConfig, now: float | None) -> tuple[FleetState, dict[str, int]] | None:
    """The state restored from ``config.snapshot_path``, or None if there is no file.

    Raises ConfigError (naming the flags) when the file is unreadable or corrupt (also
    naming the previous snapshot to use, when there is an intact one) or was written
    under a contradicting configuration.
    """
    if not config.snapshot_path:
        return None
    path = Path(config.snapshot_path)
    if not path.exists():
        log.info("No snapshot at %s; starting empty", path)
        return None
    t0 = time.perf_counter()
    try:
        fleet, extra = FleetState.restore(
            unframe(path.read_bytes(), path),
            now,
            instance_timeout=config.instance_timeout,
            keep_tokens=not config.drop_token_ids,
            l2_retention=config.l2_retention_s,
        )
    except (OSError, SnapshotError) as exc:
        raise ConfigError(
            f"--snapshot-path {path} cannot be restored ({exc}); {_fallback(path)}"
        ) from exc
    if fleet.chunk_size_bound:
        # The fleet's servers bound it (PUT /config/chunk-size, or a registration's
        # chunk_size); --chunk-size is then only the minimum that binding had to meet.
        if fleet.chunk_size < config.chunk_size:
            raise ConfigError(
                f"--snapshot-path {path} holds chunk size {fleet.chunk_size}, bound by the"
                f" fleet's servers, below --chunk-size {config.chunk_size} (the minimum);"
                " lower --chunk-size or move the file away"
            )
        log.info("Chunk size %d, bound by the fleet's servers, restored", fleet.chunk_size)
    elif fleet.chunk_size != config.chunk_size:
        raise ConfigError(
            f"--snapshot-path {path} was written with --chunk-size {fleet.chunk_size}, not"
            f" {config.chunk_size}; use the same chunk size or move the file away"
        )
    if (fleet.blend is not None) != config.enable_blend_lookup:
        raise ConfigError(
            f"--snapshot-path {path} was written with blend lookup"
            f" {'on' if fleet.blend is not None else 'off'}; match --enable-blend-lookup or"
            " move the file away"
        )
    log.info(
        "Restored snapshot %s in %.2f s: %d keys, %d live instances, digest %s",
        path,
        time.perf_counter() - t0,
        len(fleet.directory),
        len(fleet.membership),
        fleet.digest()[:16],
    )
    return fleet, extra


def _fallback(path: Path) -> str:
    """What the operator can do about an unrestorable ``path``."""
    prev = path.with_name(path.name + PREV_SUFFIX)
    try:
        unframe(prev.read_bytes())
    except (OSError, SnapshotError):
        return f"no intact previous snapshot ({prev}); move the file away to start empty"
    return (
        f"the previous snapshot {prev} is intact: move it to {path} to restore from it,"
        " or move the file away to start empty"
    )


class SnapshotWriter:
    """Writes the service's snapshot to a file, periodically and on demand."""

    def __init__(
        self, service: CoordinatorService, path: Path, interval: float, metrics: CoordinatorMetrics
    ) -> None:
        self._svc = service
        self._path = path
        self._interval = interval
        self._metrics = metrics
        # try_write logs and counts its own failures; the next interval retries.
        self._periodic = (
            Periodic("snapshot", interval, self.try_write, what="the snapshot")
            if interval > 0
            else None
        )
        self._write_lock = threading.Lock()

    def write(self) -> int:
        """Write one snapshot now; returns its size in bytes."""
        with self._write_lock:
            t0 = time.perf_counter()
            body, extra, locked = self._svc.snapshots.parts()
            if extra is not None:
                write_atomic(self._path.with_name(self._path.name + USAGE_SUFFIX), frame(extra))
            data = frame(body)
            keep_previous(self._path)
            write_atomic(self._path, data)
            took = time.perf_counter() - t0
        self._metrics.snapshot_seconds.observe(took)
        self._metrics.snapshot_lock_seconds.observe(locked)
        self._metrics.snapshot_bytes.set(len(data))
        log.info(
            "Wrote snapshot %s: %d bytes in %.3f s (state locked for %.3f s of it)",
            self._path,
            len(data),
            took,
            locked,
        )
        return len(data)

    def try_write(self) -> bool:
        """`write`, and on any failure log it, count it and mark the service not ready
        (until a later write succeeds); True when the snapshot was written."""
        try:
            self.write()
        except Exception as exc:
            self._metrics.snapshot_failures.inc()
            self._svc.readiness.set_snapshot_failure(
                f"last snapshot to {self._path} failed: {exc!r}"
            )
            log.exception("Snapshot to %s failed", self._path)
            return False
        self._svc.readiness.set_snapshot_failure("")
        return True

    def start(self) -> None:
        if self._periodic is not None:
            self._periodic.start()

    @property
    def running(self) -> bool:
        """Its periodic writes are on (started, not stopped, an interval set)."""
        return self._periodic is not None and self._periodic.running

    def stop(self) -> None:
        if self._periodic is not None:
            self._periodic.stop(timeout_s=None)
