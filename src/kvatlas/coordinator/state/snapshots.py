"""The fleet state as one consistent snapshot, with what is kept beside it.

Owns the capture: the fleet's state and the consumer positions that led to it, and the
companion state (the L2 usage book) copied in the same lock hold; encoding happens after
it. Times the lock hold with the injected ``timer`` (a monotonic seconds counter: the
composition root gives `time.perf_counter`). Must not: write files (`snapshot.py` does),
or read a clock of its own.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from kvatlas.coordinator.state.fleet import LockedFleet


class Snapshots:
    """Capture the fleet state for the snapshot writer."""

    def __init__(self, state: LockedFleet, timer: Callable[[], float]) -> None:
        self._state = state
        self._timer = timer
        self.companion: Callable[[], msgspec.Struct] | None = None
        """State kept beside the fleet's, captured in the same lock hold by `parts`
        (the L2 usage book)."""

    def parts(self) -> tuple[bytes, bytes | None, float]:
        """`snapshot`, and the `companion` state captured in the same lock hold (a copy;
        encoded as msgpack after), and the seconds the state was locked for them."""
        st = self._state
        with st.lock:
            t0 = self._timer()
            capture = st.fleet.capture(extra=dict(st.positions))
            extra = self.companion() if self.companion is not None else None
            locked = self._timer() - t0
        return (
            capture.encode(),
            None if extra is None else msgspec.msgpack.encode(extra),
            locked,
        )

    def snapshot(self) -> tuple[bytes, float]:
        """The state and the consumer positions that led to it, encoded together, and
        the seconds the state was locked for it (the copy only, not the encoding)."""
        body, _, locked = self.parts()
        return body, locked
