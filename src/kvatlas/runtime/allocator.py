"""glibc malloc's thresholds for a process that takes big request bodies.

Owns one call its process's owner makes at startup, `keep_freed_heap`: ``mallopt`` with
a fixed mmap threshold and a larger trim threshold. By default glibc serves blocks over
128 KiB (a threshold it then moves) with fresh ``mmap``s and gives the heap's top back at
every ``free`` past twice that, so a lookup of 32k JSON tokens (a dozen 256 KiB numpy
temporaries, a 200 KiB body) faulted in its pages anew on every request: its decode
took 6-8 ms instead of ~1 ms in `bench.coordinator_breakdown` on the development VM.
Must not override what the operator set (``MALLOC_MMAP_THRESHOLD_``,
``MALLOC_TRIM_THRESHOLD_``), nor run outside a process's owner: it changes the whole
process. Memory is still given back by the HTTP server's `malloc_trim` after big bodies.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from typing import Final

MMAP_THRESHOLD: Final = 4 << 20
"""Blocks up to this size come from the heap (and stay mapped when freed)."""
TRIM_THRESHOLD: Final = 16 << 20
"""Free bytes at the heap's top that glibc keeps before it gives them back."""
_M_TRIM_THRESHOLD: Final = -1
_M_MMAP_THRESHOLD: Final = -3
_ENV: Final = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def keep_freed_heap() -> bool:
    """Set the thresholds; False when the operator set either, or the C library is not
    glibc (musl has no ``mallopt``), or glibc refused."""
    if any(name in os.environ for name in _ENV):
        return False
    name = ctypes.util.find_library("c")
    mallopt = getattr(ctypes.CDLL(name), "mallopt", None) if name else None
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
