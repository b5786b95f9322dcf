"""glibc malloc's tuning for a process that takes big request bodies.

Owns the two calls into the C allocator the coordinator makes: `keep_freed_heap`, once at
startup by the process's owner (``mallopt`` with a fixed mmap threshold and a larger trim
threshold), and `trim_heap`, which the HTTP server calls after big bodies were freed
(``malloc_trim``). By default glibc serves blocks over 128 KiB (a threshold it then
moves) with fresh ``mmap``s and gives the heap's top back at every ``free`` past twice
that, so a lookup of a long JSON token list (a dozen 256 KiB numpy temporaries, a big
body) faulted in its pages anew on every request (`bench.coordinator_breakdown` shows the
decode with and without, ``--glibc-defaults``). Kept blocks are given back by the trim.
Must not override what the operator set (``MALLOC_MMAP_THRESHOLD_``,
``MALLOC_TRIM_THRESHOLD_``), nor run outside a process's owner: it changes the whole
process. Under another C library (musl) both are no-ops.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Callable
from typing import Final

MMAP_THRESHOLD: Final = 4 << 20
"""Blocks up to this size come from the heap (and stay mapped when freed)."""
TRIM_THRESHOLD: Final = 16 << 20
"""Free bytes at the heap's top that glibc keeps before it gives them back."""
TRIM_AFTER_BYTES: Final = 32 * 1024 * 1024
"""Once request bodies of this many bytes have been freed, the HTTP server's next sweep
calls `trim_heap`."""
_M_TRIM_THRESHOLD: Final = -1
_M_MMAP_THRESHOLD: Final = -3
_ENV: Final = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name) if name else None


def keep_freed_heap() -> bool:
    """Set the thresholds; False when the operator set either, or the C library is not
    glibc (musl has no ``mallopt``), or glibc refused."""
    if any(name in os.environ for name in _ENV):
        return False
    libc = _libc()
    mallopt = getattr(libc, "mallopt", None) if libc is not None else None
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )


def _load_malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``; None under another C library (musl has none)."""
    libc = _libc()
    trim: Callable[[int], int] | None = getattr(libc, "malloc_trim", None) if libc else None
    return trim


_MALLOC_TRIM = _load_malloc_trim()


def trim_heap() -> bool:
    """Give the allocator's free pages back to the system; False where there is no
    ``malloc_trim``. Bodies arrive as many chunks of up to 256 KiB, allocated between
    other objects' memory; freed, they leave holes inside the heap that glibc keeps (it
    trims only the heap's top), so a burst of big bodies would keep its resident memory
    for good. One call walks the heap, so the server makes it at most once per sweep,
    after TRIM_AFTER_BYTES were given back."""
    if _MALLOC_TRIM is None:
        return False
    _MALLOC_TRIM(0)
    return True
