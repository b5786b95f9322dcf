"""Random lease ids for a server's L1 pool, drawn from the OS's CSPRNG in batches.

Owns where the pool's lease ids come from: unpredictable (a client cannot end a lease it
was not given), in [0, 2**63) (the pool skips 0 and ids still in use), and one
``os.urandom`` call per ``BATCH`` ids instead of one per id: a 64-chunk lookup takes 64
read leases and a 64-chunk peer fetch ~200 over the two servers, each of them inside a
hold of the store lock, where a system call per id adds up, more so on a loaded
host.

Must not: hand out an id twice from one batch, or be read by anything but the pool.
"""

from __future__ import annotations

import os
from typing import Final

import numpy as np

BATCH: Final = 512
"""Ids drawn per ``os.urandom`` call (4 KiB of randomness)."""


class RandomLeaseIds:
    """``L1Pool(lease_ids=RandomLeaseIds())``: each call returns a fresh random id."""

    def __init__(self, batch: int = BATCH) -> None:
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        self._batch = batch
        self._ids: list[int] = []

    def __call__(self) -> int:
        # No lock: the pool calls under the store lock, and list.pop is atomic anyway, so
        # two callers never get one id; a batch replaced while another caller refilled
        # only loses unused ids.
        while True:
            try:
                return self._ids.pop()
            except IndexError:
                raw = np.frombuffer(os.urandom(8 * self._batch), dtype="<u8")
                self._ids = (raw >> np.uint64(1)).tolist()
