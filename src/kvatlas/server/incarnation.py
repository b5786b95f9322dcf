"""Incarnations: a fresh number per process start, strictly greater than any earlier one.

Owns the per-instance counter file ``<state dir>/<instance id>.incarnation``. The new
incarnation is ``max(time.time_ns(), last + 1)``, written before it is returned, under an
exclusive ``flock`` so that two processes of the same instance id starting in the same
nanosecond still get different, ordered numbers. Time alone is not enough (two restarts
in one clock tick, or a clock stepped backwards); the file alone is not enough (a lost
state dir) — together the number only goes down if the file is lost *and* the clock went
back, which the coordinator then reports as a stale incarnation.

It also keeps, beside the counter, the instance secret of the last registration
(``<state dir>/<instance id>.secret``, owner-only): a process that starts after a crash
presents it to re-register at once, instead of being refused (401) until the crashed
one expires (`core.credentials`).

Must not: know about the coordinator or the network.
"""

from __future__ import annotations

import fcntl
import os
import re
import time
from pathlib import Path

from kvatlas.core.types import Incarnation
from kvatlas.server.errors import ServerError


def counter_path(state_dir: Path, instance_id: str) -> Path:
    """The counter file of ``instance_id`` (the id sanitized into a file name)."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", instance_id) or "_"
    return state_dir / f"{safe}.incarnation"


def secret_path(state_dir: Path, instance_id: str) -> Path:
    """The file that keeps ``instance_id``'s last instance secret."""
    return counter_path(state_dir, instance_id).with_suffix(".secret")


def load_secret(state_dir: Path, instance_id: str) -> str:
    """The secret the last registration of ``instance_id`` was issued, or "" (none, or
    unreadable: the coordinator then refuses a re-registration until the old expires)."""
    try:
        return secret_path(state_dir, instance_id).read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return ""


def save_secret(state_dir: Path, instance_id: str, secret: str) -> None:
    """Keep ``secret`` for the next start (written then renamed, readable by the owner
    only); ServerError naming the file if it cannot be written."""
    path = secret_path(state_dir, instance_id)
    tmp = path.with_suffix(".secret.tmp")
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, f"{secret}\n".encode("ascii"))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as exc:
        raise ServerError(f"cannot write the instance secret file {path}: {exc}") from exc


def next_incarnation(state_dir: Path, instance_id: str) -> Incarnation:
    """Allocate and persist this process start's incarnation of ``instance_id``."""
    path = counter_path(state_dir, instance_id)
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise ServerError(
            f"cannot open the incarnation file {path} (set --state-dir to a writable"
            f" directory): {exc}"
        ) from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        raw = os.pread(fd, 64, 0).decode("ascii", "replace").strip()
        try:
            last = int(raw) if raw else 0
        except ValueError:
            last = 0  # a torn or foreign file: the clock still orders starts
        value = max(time.time_ns(), last + 1)
        data = f"{value}\n".encode("ascii")
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
        os.fsync(fd)
        return Incarnation(value)
    except OSError as exc:
        raise ServerError(f"cannot update the incarnation file {path}: {exc}") from exc
    finally:
        os.close(fd)  # closing releases the flock
