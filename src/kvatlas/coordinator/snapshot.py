"""Snapshot files: atomic writes and startup restores of the fleet state.

Owns the file format's outer handling (the bytes are `FleetState.snapshot`'s), atomic
replacement (write a temp file in the same folder, fsync, `os.replace`, fsync the
folder, so a crash leaves the old or the new file, never half of one), the periodic
writer thread, and the startup checks that a snapshot fits the configuration.

A failed write, whatever the cause (disk, permissions, state an encoder cannot hold), is
logged, counted (``kvatlas_coordinator_snapshot_failures``) and makes `/readyz` fail
with its reason until a write succeeds again; the writer thread never dies of it and
the next interval retries. Must not change the state: it only reads the service's
consistent snapshot bytes.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from pathlib import Path

from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.metrics import CoordinatorMetrics
from kvatlas.coordinator.service import CoordinatorService
from kvatlas.core.errors import ConfigError, SnapshotError
from kvatlas.core.fleet import FleetState

log = logging.getLogger(__name__)


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

    Raises ConfigError (naming the flags) when the file is unreadable or was written
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
            path.read_bytes(),
            now,
            instance_timeout=config.instance_timeout,
            keep_tokens=not config.drop_token_ids,
        )
    except (OSError, SnapshotError) as exc:
        raise ConfigError(
            f"--snapshot-path {path} cannot be restored ({exc}); move the file away to start empty"
        ) from exc
    if fleet.chunk_size != config.chunk_size:
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


class SnapshotWriter:
    """Writes the service's snapshot to a file, periodically and on demand."""

    def __init__(
        self, service: CoordinatorService, path: Path, interval: float, metrics: CoordinatorMetrics
    ) -> None:
        self._svc = service
        self._path = path
        self._interval = interval
        self._metrics = metrics
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._write_lock = threading.Lock()

    def write(self) -> int:
        """Write one snapshot now; returns its size in bytes."""
        with self._write_lock:
            t0 = time.perf_counter()
            data, locked = self._svc.snapshot()
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
            self._svc.set_snapshot_failure(f"last snapshot to {self._path} failed: {exc!r}")
            log.exception("Snapshot to %s failed", self._path)
            return False
        self._svc.set_snapshot_failure("")
        return True

    def start(self) -> None:
        if self._interval > 0:
            self._thread = threading.Thread(target=self._run, name="snapshot", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.try_write()  # a failure is logged and counted; the next interval retries

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
