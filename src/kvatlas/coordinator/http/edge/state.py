"""One HTTP/1.1 server connection as a pure state machine, in the manner of h11's
``Connection``: bytes and the time go in, events come out; an answer goes in, the bytes
to write come out.

Owns what a connection does between requests: keep-alive (HTTP/1.0 and
``Connection: close`` end it after their answer, as does the shell's ``close=True``),
pipelining (complete requests wait in line and are handed out one at a time: the next
only once the previous one is answered, so answers leave in order), ``100 Continue``
(sent only when no earlier answer is owed, so it never overtakes one), what arrives after
a request that closes the connection (never read as a request), the protocol errors'
answers (after the answers owed before them), the idle timeout, the read deadlines on
`tick`, the buffered-bytes budget each request holds until it is answered, and the
linger: a closed connection stays `CLOSING` until the client has gone or LINGER_S has
passed, then `tick` says `Reset`.

The shell (`edge.connection`) feeds `buffer_filled` (or `receive_data`, which copies) and
`receive_eof`, answers every request with exactly one `send` (or `abandon` when its
handler gave no answer), then asks `next_events`; it writes what it is given and does
what the last event says: read on (`NeedData`), wait for its handler (`Paused`), write a
refusal and half-close (`Refused`), close (`Close`) or reset (`Reset`). Parsing, limits and
the deadlines' arithmetic are `edge.protocol.RequestReader`'s.

Must not: read a clock (every mutator takes ``now``), touch a socket, a transport or the
event loop, log, route, run handlers, or call back into the shell.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvatlas.coordinator.http.edge.messages import HttpRequest, HttpResponse, response_head
from kvatlas.coordinator.http.edge.protocol import Ledger, Limits, Refusal, RequestReader

LINGER_S = 1.0
"""How long a closed connection may take to flush its answer (a client that does not
read) and a refused one may keep sending, before it is reset."""
JOIN_BYTES = 64 * 1024
"""A body up to this size is joined to its head (one write); a larger one is handed over
as it is, as h11's ``send_with_data_passthrough`` does, so it is never copied."""
CONTINUE_BYTES = b"HTTP/1.1 100 Continue\r\n\r\n"


class State(enum.Enum):
    OPEN = "open"
    """Reading requests and answering them."""
    CLOSING = "closing"
    """The last answer is written and our side closed; lingering until the client goes
    or LINGER_S passes (then `Reset`)."""
    CLOSED = "closed"
    """The transport is gone (`connection_lost`) or was reset."""


# Python 3.11 looks an enum member up through the metaclass (~10x a global's cost), and
# the state is read several times per request: the hot paths compare with these.
OPEN, CLOSING, CLOSED = State.OPEN, State.CLOSING, State.CLOSED


# ---- events ------------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class Continue:
    """Write ``data`` (``100 Continue``): the arriving request's client waits for it."""

    data: bytes = CONTINUE_BYTES


@dataclass(slots=True, frozen=True)
class Refused:
    """The stream cannot go on: write ``data`` (the answer, with ``connection: close``),
    close our side for writing and drop what the client still sends (`CLOSING`)."""

    status: int
    reason: str
    data: bytes


@dataclass(slots=True, frozen=True)
class Close:
    """Close the connection once what was written has gone (`CLOSING`)."""

    reason: str


@dataclass(slots=True, frozen=True)
class Reset:
    """The linger is over: drop the connection now, written or not (`CLOSED`)."""


@dataclass(slots=True, frozen=True)
class NeedData:
    """Nothing to do until more bytes (or the end of input) arrive."""


@dataclass(slots=True, frozen=True)
class Paused:
    """An answer is owed (`Connection.send`); nothing else comes before it."""


Event = HttpRequest | Continue | Refused | Close | Reset | NeedData | Paused
"""An `HttpRequest` is itself the event of a complete request (as h11's ``Request``):
the one to answer now (`Connection.send`); its body holds bytes of the buffered-bytes
budget until then (`Connection.reserved`). The others are frozen; a request is not,
since handlers get it and the router sets its path parameters.

Every call gives at most one event that asks something of the shell, first, and then at
most one marker (`NeedData`, `Paused`): ``(request, PAUSED)``, ``(CONTINUE,
NEED_DATA)``, ``(NEED_DATA,)``, ``(PAUSED,)``, ``(Refused,)``, ``(Close,)``,
``(RESET,)`` or ``()``. A shell may thus look at the first event only."""
NEED_DATA = NeedData()
PAUSED = Paused()
RESET = Reset()
CONTINUE = Continue()
_NEED: tuple[Event, ...] = (NEED_DATA,)
_PAUSED: tuple[Event, ...] = (PAUSED,)
_CONTINUE: tuple[Event, ...] = (CONTINUE, NEED_DATA)
_NOTHING: tuple[Event, ...] = ()
NEED_DATA_ONLY = _NEED
"""What most reads give (the shell has nothing to do): compare with ``is``."""

CLOSE_ANSWERED = "the answer closes the connection"
CLOSE_EOF = "the client sent its last byte"
CLOSE_IDLE = "idle timeout"
CLOSE_SERVER = "closed by the server"
CLOSE_ABANDONED = "the handler gave no answer"
_NO_REQUEST = "no request to answer: send() answers a request event"


class Connection:
    """One client connection's HTTP/1.1 state (see the module docstring).

    Time comes in with every call that changes the state; ``now`` of the latest call is
    when a close counts from. The read buffers are the server's (`RequestReader`):
    `buffer` says where the next read goes, `buffer_filled` takes it.
    """

    __slots__ = (
        "_accepting",
        "_close_reason",
        "_current",
        "_eof",
        "_error",
        "_ledger",
        "_now",
        "_reader",
        "_scratch",
        "closed_at",
        "state",
    )

    def __init__(
        self,
        limits: Limits,
        ledger: Ledger,
        *,
        read_view: memoryview,
        head_view: memoryview,
        now: float,
    ) -> None:
        self._reader = RequestReader(
            limits, ledger, read_view=read_view, head_view=head_view, now=now
        )
        self._ledger = ledger
        self._scratch = head_view
        """Where bytes that will not be read as requests go (and are dropped)."""
        self._current: tuple[str, bool, int] | None = None
        """The request handed out and not yet answered: its method, keep-alive, and the
        bytes of the budget its body holds."""
        self._error: Refusal | None = None
        """A refusal that waits for the answers owed before it."""
        self._eof = False
        self._close_reason = ""
        """Set once an answer or the shell closed the connection; `Close` says it."""
        self._accepting = True
        """Bytes that arrive are parsed: open, no refusal, no request that closes the
        connection, no end of input."""
        self._now = now
        self.state = OPEN
        self.closed_at = 0.0
        """When the connection began `CLOSING` (the linger counts from it)."""

    # ---- receiving -------------------------------------------------------------------

    def buffer(self) -> memoryview:
        """Where the next read goes (bytes not to be read land in a scratch buffer)."""
        return self._reader.buffer() if self._accepting else self._scratch

    def buffer_filled(self, nbytes: int, now: float) -> tuple[Event, ...]:
        """``nbytes`` were read into `buffer` at ``now``: what follows."""
        self._now = now
        if self._accepting:
            reader = self._reader
            refusal = reader.received(nbytes, now)
            ready = reader.ready
            if refusal is None and not ready and not reader.continue_asked:
                # Most reads of a request's bytes (open, nothing whole yet): what
                # next_events would say, without the way there.
                return _NEED if self._current is None else _PAUSED
            if refusal is not None or (ready and not ready[-1][1]):
                self._stop_reading(refusal)
        return self.next_events()

    def receive_data(self, data: bytes, now: float) -> tuple[Event, ...]:
        """``data`` arrived at ``now`` (copied through `buffer`): what follows. Bytes
        that arrive once nothing more is read (after a refusal, after a request that
        closes the connection) are dropped."""
        self._now = now
        view = memoryview(data)
        at = 0
        while at < len(data) and self._accepting:
            target = self._reader.buffer()
            n = min(len(target), len(data) - at)
            target[:n] = view[at : at + n]
            refusal = self._reader.received(n, now)
            ready = self._reader.ready
            if refusal is not None or (ready and not ready[-1][1]):
                self._stop_reading(refusal)
            at += n
        return self.next_events()

    def receive_eof(self, now: float) -> tuple[Event, ...]:
        """The client will send no more: answers owed are still sent, then `Close`; a
        request still arriving is dropped unanswered."""
        self._now = now
        self._eof = True
        self._accepting = False
        return self.next_events()

    # ---- answering -------------------------------------------------------------------

    def send(self, response: HttpResponse, now: float, *, close: bool = False) -> list[bytes]:
        """The answer to the request handed out last: the bytes to write, in
        order (none when the connection has closed meanwhile). The request's budget is
        given back. ``close``: the shell's own wish to close after it (shutdown); HTTP/1.0
        and ``Connection: close`` close after it anyway. Then ask `next_events`."""
        current = self._current
        if current is None:
            raise RuntimeError(_NO_REQUEST)
        self._current = None
        method, keep_alive, reserved = current
        if reserved:
            self._ledger.give_back(reserved)
        if self.state is not OPEN:
            return []
        self._now = now
        self._reader.last_active = now  # the idle timeout counts from the answer
        close = close or not keep_alive
        head = response_head(response, close)
        if close:
            self._close_reason = CLOSE_ANSWERED
            self._accepting = False
        body = response.body
        if method == "HEAD" or not body:
            return [head]
        if len(body) <= JOIN_BYTES:
            return [head + body]
        return [head, body]

    def abandon(self, now: float) -> None:
        """The request handed out last gets no answer (its handler was cancelled
        or died): its budget is given back and the connection closes (`next_events`)."""
        current = self._current
        if current is None:
            raise RuntimeError(_NO_REQUEST)
        self._current = None
        self._ledger.give_back(current[2])
        self._now = now
        if self.state is OPEN:
            self._close_reason = CLOSE_ABANDONED
            self._accepting = False

    def next_events(self) -> tuple[Event, ...]:
        """What follows now: the next pipelined request, a refusal that waited for the
        answers before it, `Continue` owed to the arriving request, `Close`, `NeedData`,
        or `Paused` while an answer is owed (every receiving call ends with it too)."""
        if self.state is not OPEN:
            return _NOTHING
        if self._current is not None:
            return _PAUSED
        reader = self._reader
        if self._accepting:  # the common case: no close, refusal or end of input pending
            if reader.ready:
                request, keep_alive, reserved = reader.ready.popleft()
                self._current = (request.method, keep_alive, reserved)
                return (request, PAUSED)
            if reader.continue_asked:
                reader.continued()
                return _CONTINUE
            return _NEED
        if self._close_reason:
            return (self._close(self._close_reason),)
        if reader.ready:
            return self._hand_out()
        if self._error is not None:
            return (self._refuse(self._error),)
        if self._eof:
            return (self._close(CLOSE_EOF),)
        return _NEED  # after a request that closes the connection, before it is answered

    def _hand_out(self) -> tuple[Event, ...]:
        request, keep_alive, reserved = self._reader.ready.popleft()
        self._current = (request.method, keep_alive, reserved)
        return (request, PAUSED)

    # ---- time and the shell's own decisions -------------------------------------------

    def tick(self, now: float) -> tuple[Event, ...]:
        """The deadlines at ``now``: `Reset` once a linger is over; a request arriving
        too slowly is `Refused` (408); a connection idle past the idle timeout gets
        `Close`. A request that arrives behind an answer owed waits with its deadlines:
        its answer must not overtake the earlier one."""
        if self.state is CLOSING:
            if now - self.closed_at > LINGER_S:
                self.state = CLOSED
                return (RESET,)
            return _NOTHING
        if self.state is CLOSED:
            return _NOTHING
        self._now = now
        reader = self._reader
        busy = self._current is not None or bool(reader.ready)
        refusal = reader.overdue(now, busy=busy)
        if refusal is not None:
            return (self._refuse(refusal),)
        if not busy and reader.idle_expired(now):
            return (self._close(CLOSE_IDLE),)
        return _NOTHING

    def refuse(self, refusal: Refusal, now: float) -> tuple[Event, ...]:
        """The shell refuses the connection outright (over the connection cap)."""
        self._now = now
        if self.state is not OPEN:
            return _NOTHING
        return (self._refuse(refusal),)

    def close(self, now: float) -> tuple[Event, ...]:
        """The shell closes the connection (shutdown): `Close`, whatever is owed."""
        self._now = now
        if self.state is not OPEN:
            return _NOTHING
        return (self._close(CLOSE_SERVER),)

    def connection_lost(self) -> None:
        """The transport is gone: what arrived is forgotten and its budget given back;
        a request being answered keeps its budget until `send` or `abandon`, since its
        handler still holds the body."""
        self.state = CLOSED
        self._accepting = False
        self._drop_input()

    # ---- for the shell's bookkeeping ---------------------------------------------------

    @property
    def idle(self) -> bool:
        """No answer owed and no complete request waiting. A request still arriving
        counts as idle: a client that stalls mid-request is closed like a silent one."""
        return self._current is None and not self._reader.ready

    @property
    def backlogged(self) -> bool:
        """Complete requests wait behind the one being answered: read no more for now."""
        return bool(self._reader.ready)

    @property
    def arriving(self) -> bool:
        """A request has begun to arrive and is not whole yet."""
        return self._reader.arriving

    @property
    def reserved(self) -> int:
        """Bytes of the buffered-bytes budget the request being answered holds."""
        return 0 if self._current is None else self._current[2]

    # ---- inside ----------------------------------------------------------------------

    def _stop_reading(self, refusal: Refusal | None) -> None:
        """A read ended with a refusal or with a request that closes the connection."""
        self._accepting = False
        self._reader.drop()
        ready = self._reader.ready
        if ready and not ready[-1][1]:
            # A request that closes the connection is whole: nothing after it is read
            # (llhttp refuses "data after Connection: close"; it is not the client's
            # next request, and it is not answered).
            return
        self._error = refusal

    def _close(self, reason: str) -> Close:
        self._closing()
        return Close(reason)

    def _refuse(self, refusal: Refusal) -> Refused:
        self._closing()
        return Refused(refusal.status, refusal.reason, refusal.answer())

    def _closing(self) -> None:
        self.state = CLOSING
        self.closed_at = self._now
        self._accepting = False
        self._drop_input()

    def _drop_input(self) -> None:
        """Forget the arriving and the waiting requests; give back what they held."""
        reader = self._reader
        reader.drop()
        held = sum(reserved for _, _, reserved in reader.ready)
        reader.ready.clear()
        self._ledger.give_back(held)
