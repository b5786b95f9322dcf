"""The garbage collector's pauses in this process, timed through `gc.callbacks`.

Owns one callback that times every collection (start to stop, by generation) and keeps
running totals that a shell reads without a lock: collections, seconds paused, the
longest pause, and the total a request handler reads before and after its work to say
how much of its time was the collector's. Must not take a lock, log or allocate more
than a float in the callback (it runs inside the collector, in whichever thread
allocated the object that set it off), nor change the collector's settings.
"""

from __future__ import annotations

import gc
import time
from typing import Final

GENERATIONS: Final = 3


class GcPauses:
    """Totals of this process's collections since `install()`."""

    def __init__(self) -> None:
        self.collections = [0] * GENERATIONS
        self.seconds = [0.0] * GENERATIONS
        self.longest = [0.0] * GENERATIONS
        self.total = 0.0
        """Seconds paused over all generations: read it around a piece of work."""
        self._started = 0.0

    def install(self) -> None:
        if self._on_gc not in gc.callbacks:
            gc.callbacks.append(self._on_gc)

    def remove(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        # The collector runs one collection at a time, under the GIL: a start and its
        # stop are never interleaved with another collection's.
        if phase == "start":
            self._started = time.perf_counter()
            return
        took = time.perf_counter() - self._started
        g = info["generation"]
        self.collections[g] += 1
        self.seconds[g] += took
        self.longest[g] = max(self.longest[g], took)
        self.total += took
