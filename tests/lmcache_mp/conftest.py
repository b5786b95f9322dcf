"""The .venv-lmcache fixture of the LMCache compatibility suite, and the POSIX SHM
segments a worker's CPU KV lives in, shared."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing import shared_memory

from lmcache.conftest import lmcache_venv

__all__ = ["lmcache_venv", "shm_segments"]


@contextmanager
def shm_segments(count: int, size: int) -> Iterator[list[shared_memory.SharedMemory]]:
    """``count`` fresh segments of ``size`` bytes (a worker's per-layer KV), unlinked after."""
    shms: list[shared_memory.SharedMemory] = []
    try:
        for _ in range(count):
            shms.append(shared_memory.SharedMemory(create=True, size=size))
        yield shms
    finally:
        for s in shms:
            s.close()
            s.unlink()
