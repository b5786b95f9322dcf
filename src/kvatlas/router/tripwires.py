"""Per engine (and for the coordinator), the router's awaits on it that a fault must
end now, not at a timeout.

An engine that freezes (a stopped process, a stuck GPU) keeps its sockets open: a request
waiting for its answer (a stream's first event, any other answer whole), or for a
stream's next piece, would wait the whole
``--engine-timeout-s``. The router arms a wire around each such await (``arm``); when the
probe finds the engine not answering, or its breaker opens, ``trip`` ends the awaits
armed on it: each raises ``Tripped`` with the cause, and the request is retried on its
next choice (nothing of its answer went to the client yet) or its stream is ended with
an error (after its first event). The
coordinator's prefix lookups are armed the same way (kind ``lookup``, under the key
``COORDINATOR``): the first lookup that finds the coordinator out ends the others
waiting on it, which route by load at once.

An armed wire works as ``asyncio.timeout`` does, without a deadline (and cheaper: no
timer, nothing but the task read on entry): tripping it cancels the task that awaits in
it, and the wire takes that cancel back as ``Tripped`` on its way out, so only that await
ends, at once, whatever it waits for (the connection it used is closed by httpx as for
any cancelled request). Wires are armed only around the await itself, never around a
``yield``, so a trip never lands outside it.

Single-threaded: the router's event loop owns it. Must not: decide when an engine is
at fault (the service does, from its probes and breakers).
"""

from __future__ import annotations

import asyncio
from types import TracebackType
from typing import Final, Literal

Kind = Literal["first_byte", "stream", "lookup"]
"""What an armed await waits for: an answer until the client may be sent it (a stream's
first event, any other answer whole), a stream's next piece, or the coordinator's answer
to a prefix lookup."""
KINDS: Final[tuple[Kind, ...]] = ("first_byte", "stream", "lookup")
COORDINATOR: Final = "coordinator"
"""The key the coordinator's lookups are armed under (engines are keyed by URL)."""


class Tripped(Exception):
    """An armed await was ended by a fault of its engine."""

    def __init__(self, url: str, cause: str) -> None:
        super().__init__(f"engine {url} {cause}")
        self.url = url
        self.cause = cause


class _Wire:
    """One armed await (``async with``); see the module doc."""

    __slots__ = ("_armed", "_cancelling", "_task", "_url", "cause")

    def __init__(self, armed: set[_Wire], url: str) -> None:
        self._armed = armed
        self._url = url
        self._task: asyncio.Task[object] | None = None
        self._cancelling = 0
        self.cause = ""

    async def __aenter__(self) -> _Wire:
        self._task = asyncio.current_task()
        self._armed.add(self)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._armed.discard(self)
        if not self.cause:
            return
        assert self._task is not None
        # take back the cancel ``trip`` sent; a cancel from elsewhere (the client went
        # away, the router stops) stays a cancel
        if self._task.uncancel() > self._cancelling and exc_type is asyncio.CancelledError:
            return
        if exc is not None:
            # the cancel itself, or what a library made of it
            raise Tripped(self._url, self.cause) from None

    def trip(self, cause: str) -> bool:
        """End the await now; False when it was tripped already. The task awaits inside
        the wire (it is armed only there, and this runs on another task), so the cancel
        lands on that await."""
        if self.cause or self._task is None:
            return False
        self.cause = cause
        self._cancelling = self._task.cancelling()
        self._task.cancel()
        return True


class Tripwires:
    """The armed awaits, per engine URL and kind (see the module doc)."""

    def __init__(self) -> None:
        self._armed: dict[tuple[str, Kind], set[_Wire]] = {}

    def arm(self, url: str, kind: Kind) -> _Wire:
        """A wire to ``async with`` around one await on engine ``url`` (or on
        ``COORDINATOR``)."""
        armed = self._armed.get((url, kind))
        if armed is None:
            armed = self._armed[(url, kind)] = set()
        return _Wire(armed, url)

    def armed(self, url: str, kind: Kind) -> int:
        """How many awaits on ``url`` of ``kind`` are armed now."""
        return len(self._armed.get((url, kind), ()))

    def trip(self, url: str, cause: str, kinds: tuple[Kind, ...] = KINDS) -> int:
        """End every await armed on ``url`` of ``kinds`` with ``cause``; how many."""
        n = 0
        for kind in kinds:
            for wire in list(self._armed.get((url, kind), ())):
                n += wire.trip(cause)
        return n

    def forget(self, url: str) -> None:
        """Drop the (empty) sets of an engine that left the listing."""
        for kind in KINDS:
            if not self._armed.get((url, kind)):
                self._armed.pop((url, kind), None)
