"""One HTTP/1.1 connection as a pure state machine (`edge.state.Connection`), without a
socket, a loop or a clock: bytes and ``now`` in, events out; answers in, bytes out.
Byte-by-byte and split heads, pipelined requests answered in order, keep-alive against
``Connection: close`` and HTTP/1.0, what arrives after a request that closes the
connection, refusals (oversize, bad framing) after the answers owed before them,
``100 Continue`` never overtaking an answer, the end of input, the deadlines, the idle
timeout and the linger on ``now``, the budget each request holds until it is answered,
and (hypothesis) that any cut of the same bytes gives the same events and the same bytes
out. Where each limit and deadline falls to the byte and microsecond:
``test_edge_protocol.py``; the shell over real sockets: ``test_edge_server.py``."""

from __future__ import annotations

import ast
import importlib.util

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvatlas.coordinator.http.edge.messages import HttpRequest, HttpResponse
from kvatlas.coordinator.http.edge.protocol import (
    DIRECT_BODY_BYTES,
    HEAD_READ_BYTES,
    READ_BUFFER_BYTES,
    UNRESERVED_BODY_BYTES,
    Ledger,
    Limits,
    Refusal,
)
from kvatlas.coordinator.http.edge.state import (
    CLOSE_ABANDONED,
    CLOSE_ANSWERED,
    CLOSE_EOF,
    CLOSE_IDLE,
    CLOSE_SERVER,
    CONTINUE,
    JOIN_BYTES,
    LINGER_S,
    NEED_DATA,
    PAUSED,
    RESET,
    Close,
    Connection,
    Event,
    Refused,
    State,
)

MIB = 1 << 20
T0 = 1000.0
LIMITS = Limits(
    max_body_bytes=MIB,
    header_timeout=10.0,
    body_timeout=10.0,
    min_body_rate=1000.0,
    idle_timeout=75.0,
)


def _conn(limits: Limits = LIMITS, ledger: Ledger | None = None) -> Connection:
    view = memoryview(bytearray(READ_BUFFER_BYTES))
    return Connection(
        limits,
        Ledger(4 * MIB) if ledger is None else ledger,
        read_view=view,
        head_view=view[:HEAD_READ_BYTES],
        now=T0,
    )


def _get(path: str, extra: str = "", version: str = "1.1") -> bytes:
    return f"GET {path} HTTP/{version}\r\nHost: x\r\n{extra}\r\n".encode()


def _post(body: bytes, path: str = "/echo", extra: bytes = b"") -> bytes:
    return b"POST %b HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n%b\r\n%b" % (
        path.encode(),
        len(body),
        extra,
        body,
    )


def _echo(request: HttpRequest) -> HttpResponse:
    return HttpResponse(200, request.path.encode() + b":" + bytes(request.body), "text/plain")


def _answer(body: bytes, close: bool = False) -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: %d\r\n%b\r\n%b" % (
        len(body),
        b"connection: close\r\n" if close else b"",
        body,
    )


def _path(event: Event) -> str:
    assert isinstance(event, HttpRequest)
    return event.path


_MARKERS = (NEED_DATA, PAUSED)


def _check_shape(events: tuple[Event, ...]) -> None:
    """At most one event that asks something, first, then at most one marker (the shell
    looks at the first event only)."""
    asks = [e for e in events if e not in _MARKERS]
    assert len(asks) <= 1 and len(events) - len(asks) <= 1, events
    assert not asks or events[0] is asks[0], events
    if isinstance(events[0], HttpRequest):
        assert events == (events[0], PAUSED)
    if events[0] is CONTINUE:
        assert events == (CONTINUE, NEED_DATA)


class Shell:
    """A shell without a socket: answers every request at once with `_echo` (as a plain
    handler on the loop does) and keeps every event and every byte it would write."""

    def __init__(self) -> None:
        self.ledger = Ledger(4 * MIB)
        self.conn = _conn(ledger=self.ledger)
        self.events: list[Event] = []
        self.written = bytearray()

    def act(self, events: tuple[Event, ...], now: float = T0) -> None:
        while events:
            _check_shape(events)
            self.events.extend(events)
            following: tuple[Event, ...] = ()
            for event in events:
                if isinstance(event, HttpRequest):
                    for chunk in self.conn.send(_echo(event), now):
                        self.written += chunk
                    following = self.conn.next_events()
                elif isinstance(event, Refused):
                    self.written += event.data
                elif event is CONTINUE:
                    self.written += CONTINUE.data
            events = following

    def feed(self, data: bytes, now: float = T0) -> None:
        self.act(self.conn.receive_data(data, now), now)

    def feed_reads(self, data: bytes, cuts: list[int], now: float = T0) -> None:
        """``data`` cut at ``cuts``, each piece read as the shell reads: into `buffer`,
        at most what it offers, then `buffer_filled`."""
        at = 0
        for cut in [*cuts, len(data)]:
            while at < cut:
                target = self.conn.buffer()
                n = min(len(target), cut - at)
                target[:n] = data[at : at + n]
                at += n
                self.act(self.conn.buffer_filled(n, now), now)

    def requests(self) -> list[str]:
        return [e.path for e in self.events if isinstance(e, HttpRequest)]

    def actions(self) -> list[Event]:
        """The events but the markers, whose number depends on how bytes are cut."""
        return [e for e in self.events if e not in (NEED_DATA, PAUSED, CONTINUE)]


# ---- one request, byte by byte ----------------------------------------------------------


def test_a_request_fed_byte_by_byte_needs_data_until_its_last_byte() -> None:
    conn = _conn()
    raw = _get("/items/a")
    for i, byte in enumerate(raw[:-1]):
        assert conn.receive_data(bytes([byte]), T0 + i) == (NEED_DATA,)
        assert conn.arriving
    ready, paused = conn.receive_data(raw[-1:], T0 + 99)
    assert paused is PAUSED
    assert isinstance(ready, HttpRequest)
    assert (ready.method, ready.path, ready.arrived) == (
        "GET",
        "/items/a",
        T0,  # the time of the data that held its first byte
    )
    assert not conn.idle and not conn.backlogged
    assert conn.send(_echo(ready), T0 + 100) == [_answer(b"/items/a:")]
    assert conn.next_events() == (NEED_DATA,)
    assert conn.idle and conn.state is State.OPEN


def test_a_head_split_anywhere_gives_one_request() -> None:
    raw = _post(b"hello", extra=b"X-A: 1\r\nX-A: 2\r\n")
    for cut in range(1, len(raw)):
        s = Shell()
        s.feed(raw[:cut])
        s.feed(raw[cut:])
        ((ready,),) = [[e for e in s.events if isinstance(e, HttpRequest)]]
        assert isinstance(ready, HttpRequest)
        assert ready.headers["x-a"] == "1, 2"
        assert bytes(ready.body) == b"hello"
        assert bytes(s.written) == _answer(b"/echo:hello")


def test_send_without_a_request_is_a_bug() -> None:
    with pytest.raises(RuntimeError, match="no request to answer"):
        _conn().send(HttpResponse(200), T0)


def test_head_gets_no_body_and_a_big_body_is_not_copied() -> None:
    conn = _conn()
    (ready, _) = conn.receive_data(b"HEAD /x HTTP/1.1\r\n\r\n", T0)
    assert isinstance(ready, HttpRequest)
    (head,) = conn.send(HttpResponse(200, b"four", "text/plain"), T0)
    assert head.endswith(b"content-length: 4\r\n\r\n")
    assert conn.next_events() == (NEED_DATA,)
    conn.receive_data(_get("/big"), T0)
    big = b"b" * (JOIN_BYTES + 1)
    chunks = conn.send(HttpResponse(200, big), T0)
    assert len(chunks) == 2 and chunks[1] is big


# ---- pipelining ---------------------------------------------------------------------


def test_pipelined_requests_are_handed_out_one_at_a_time_in_order() -> None:
    conn = _conn()
    events = conn.receive_data(_get("/a") + _post(b"two", "/b") + _get("/c"), T0)
    assert [type(e) for e in events] == [HttpRequest, type(PAUSED)]
    assert _path(events[0]) == "/a"
    assert conn.backlogged  # the shell stops reading
    assert conn.receive_data(b"", T0) == (PAUSED,)  # nothing overtakes the owed answer
    out = []
    for expect in ("/b", "/c"):
        out += conn.send(HttpResponse(200, b"x"), T0)
        ready, paused = conn.next_events()
        assert (_path(ready), paused) == (expect, PAUSED)
    assert not conn.backlogged
    out += conn.send(HttpResponse(200, b"x"), T0)
    assert conn.next_events() == (NEED_DATA,)
    assert len(out) == 3


def test_a_refusal_waits_for_the_answers_owed_before_it() -> None:
    s = Shell()
    s.conn.receive_data(b"", T0)
    events = s.conn.receive_data(_get("/a") + _get("/b") + b"NOT HTTP\r\n\r\n" + _get("/c"), T0)
    assert _path(events[0]) == "/a"
    s.act(events)
    assert s.requests() == ["/a", "/b"]
    refused = s.events[-1]
    assert isinstance(refused, Refused) and refused.status == 400
    assert bytes(s.written).startswith(_answer(b"/a:") + _answer(b"/b:") + b"HTTP/1.1 400 ")
    assert s.conn.state is State.CLOSING
    assert s.conn.receive_data(_get("/d"), T0) == ()  # dropped while lingering


# ---- keep-alive and close -------------------------------------------------------------


@pytest.mark.parametrize(
    "raw",
    [
        _get("/a", version="1.0"),
        _get("/a", "Connection: close\r\n"),
        _get("/a", "Connection: keep-alive, close\r\n"),
    ],
)
def test_http10_and_connection_close_end_with_their_answer(raw: bytes) -> None:
    """Nothing after such a request is read as a request, in the same read or later."""
    s = Shell()
    s.feed(raw + _get("/after"))
    s.feed(_get("/later"))
    assert s.requests() == ["/a"]
    assert bytes(s.written) == _answer(b"/a:", close=True)
    assert s.events[-1] == Close(CLOSE_ANSWERED)
    assert s.conn.state is State.CLOSING


def test_http11_stays_open_and_the_shell_may_close_after_an_answer() -> None:
    s = Shell()
    s.feed(_get("/a") + _get("/b"))
    assert (s.requests(), s.conn.state) == (["/a", "/b"], State.OPEN)
    conn = _conn()
    ready, _ = conn.receive_data(_get("/a") + _get("/b"), T0)
    assert isinstance(ready, HttpRequest)
    (answer,) = conn.send(_echo(ready), T0 + 5, close=True)  # shutting down
    assert answer == _answer(b"/a:", close=True)
    assert conn.next_events() == (Close(CLOSE_ANSWERED),)  # /b is dropped
    assert (conn.state, conn.closed_at) == (State.CLOSING, T0 + 5)


def test_the_end_of_input_closes_after_the_answers_owed() -> None:
    conn = _conn()
    assert _path(conn.receive_data(_get("/a") + _get("/b"), T0)[0]) == "/a"
    assert conn.receive_eof(T0) == (PAUSED,)
    conn.send(HttpResponse(200), T0)
    assert _path(conn.next_events()[0]) == "/b"
    conn.send(HttpResponse(200), T0)
    assert conn.next_events() == (Close(CLOSE_EOF),)
    conn = _conn()
    conn.receive_data(_post(b"x" * 100)[:-10], T0)  # a request cut short: no answer
    assert conn.receive_eof(T0) == (Close(CLOSE_EOF),)


# ---- limits and framing ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "status"),
    [
        (b"POST /e HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % (MIB + 1), 413),
        (b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\n\r\n", 414),
        (b"GET / HTTP/1.1\r\nX: " + b"b" * 70_000 + b"\r\n\r\n", 431),
        (b"POST / HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n", 400),
        (b"POST / HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd", 400),
        (b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400),
        (b"GET / HTTP/1.1\r\nUpgrade: ws\r\nConnection: upgrade\r\n\r\n", 400),
        (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03", 400),  # TLS to a plain port
    ],
)
def test_oversize_and_bad_framing_are_refused_whatever_the_cuts(raw: bytes, status: int) -> None:
    for cuts in ([], [1], [len(raw) // 2], list(range(1, len(raw), max(1, len(raw) // 40)))):
        s = Shell()
        s.feed_reads(raw, cuts)
        assert s.requests() == []
        (refused,) = s.actions()
        assert isinstance(refused, Refused) and refused.status == status, cuts
        assert b"connection: close\r\n" in refused.data
        assert s.conn.state is State.CLOSING
        assert s.conn.tick(T0 + LINGER_S) == ()
        assert (s.conn.tick(T0 + LINGER_S + 0.001), s.conn.state) == ((RESET,), State.CLOSED)


def test_a_body_holds_its_budget_until_it_is_answered() -> None:
    ledger = Ledger(2 * MIB)
    conn = _conn(ledger=ledger)
    big = b"x" * (UNRESERVED_BODY_BYTES + 1)
    ready, _ = conn.receive_data(_post(big) + _post(big), T0)
    assert isinstance(ready, HttpRequest) and conn.reserved == len(big)
    assert ledger.buffered == 2 * len(big)
    conn.send(HttpResponse(200), T0)
    assert ledger.buffered == len(big)
    conn.next_events()
    conn.connection_lost()  # its handler still holds the second body
    assert ledger.buffered == len(big)
    assert conn.send(HttpResponse(200), T0) == []  # nobody to write to
    assert ledger.buffered == 0


def test_an_abandoned_request_gives_back_its_budget_and_closes() -> None:
    ledger = Ledger(2 * MIB)
    conn = _conn(ledger=ledger)
    conn.receive_data(_post(b"x" * (UNRESERVED_BODY_BYTES + 1)) + _post(b"y" * 70_000), T0)
    conn.abandon(T0 + 1)
    assert conn.next_events() == (Close(CLOSE_ABANDONED),)
    assert (ledger.buffered, conn.closed_at) == (0, T0 + 1)


# ---- 100 Continue -----------------------------------------------------------------------


def test_continue_is_sent_once_and_never_before_an_owed_answer() -> None:
    head = _post(b"ok", extra=b"Expect: 100-continue\r\n")[:-2]
    conn = _conn()
    assert conn.receive_data(head, T0) == (CONTINUE, NEED_DATA)
    assert conn.receive_data(b"o", T0) == (NEED_DATA,)  # asked once, sent once
    ready, _ = conn.receive_data(b"k", T0)
    assert isinstance(ready, HttpRequest) and bytes(ready.body) == b"ok"

    conn = _conn()
    assert _path(conn.receive_data(_get("/first") + head, T0)[0]) == "/first"
    conn.send(HttpResponse(200), T0)
    assert conn.next_events() == (CONTINUE, NEED_DATA)  # after the first answer

    conn = _conn()  # the body came along: no 100 Continue
    ready, _ = conn.receive_data(_post(b"ok", extra=b"Expect: 100-continue\r\n"), T0)
    assert isinstance(ready, HttpRequest)
    conn.send(HttpResponse(200), T0)
    assert conn.next_events() == (NEED_DATA,)


# ---- time ------------------------------------------------------------------------------


def test_the_header_deadline_idle_timeout_and_linger_run_on_now() -> None:
    conn = _conn()
    conn.receive_data(b"GET /a HTTP/1.1\r\n", T0 + 1)
    assert conn.tick(T0 + 11) == ()
    (refused,) = conn.tick(T0 + 11.001)
    assert isinstance(refused, Refused) and refused.status == 408
    assert conn.tick(T0 + 11.001 + LINGER_S) == ()
    assert conn.tick(T0 + 11.002 + LINGER_S) == (RESET,)

    conn = _conn()
    assert _path(conn.receive_data(_get("/a"), T0)[0]) == "/a"
    assert conn.tick(T0 + 500) == ()  # an answer owed: never idle
    conn.send(HttpResponse(200), T0 + 500)
    conn.next_events()
    assert conn.tick(T0 + 575) == ()
    assert conn.tick(T0 + 575.001) == (Close(CLOSE_IDLE),)


def test_a_request_behind_an_owed_answer_waits_with_its_deadlines() -> None:
    conn = _conn()
    conn.receive_data(_get("/a") + b"GET /b HTTP/1.1\r\n", T0)
    assert conn.tick(T0 + 60) == ()  # /a is being answered: /b's head may wait
    conn.send(HttpResponse(200), T0 + 60)
    assert conn.next_events() == (NEED_DATA,)
    (refused,) = conn.tick(T0 + 60.001)  # the head's deadline counts from its first byte
    assert isinstance(refused, Refused) and refused.status == 408


def test_the_shell_refuses_or_closes_outright() -> None:
    conn = _conn()
    (refused,) = conn.refuse(Refusal(503, "too many", b"retry-after: 1\r\n"), T0)
    assert isinstance(refused, Refused) and b"retry-after: 1\r\n" in refused.data
    assert conn.close(T0) == ()  # already closing
    conn = _conn()
    assert conn.close(T0 + 2) == (Close(CLOSE_SERVER),)
    assert (conn.state, conn.closed_at) == (State.CLOSING, T0 + 2)
    conn.connection_lost()
    assert (conn.state, conn.tick(T0 + 100)) == (State.CLOSED, ())


# ---- any cut of the same bytes -----------------------------------------------------------


def _chunked(body: bytes) -> bytes:
    pieces = b"".join(
        b"%x\r\n%b\r\n" % (len(body[i : i + 700]), body[i : i + 700])
        for i in range(0, len(body), 700)
    )
    return b"POST /chunked HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n%b0\r\n\r\n" % pieces


_PARTS = [
    _get("/a"),
    _get("/q?x=1&y=%20", "Accept: */*\r\n"),
    b"HEAD /h HTTP/1.1\r\n\r\n",
    _post(b""),
    _post(b"small"),
    _post(bytes(range(256)) * 70),  # over DIRECT_BODY_BYTES: read into its own buffer
    _post(b"z" * (DIRECT_BODY_BYTES - 1)),
    _post(b"c" * 3000, extra=b"Expect: 100-continue\r\n"),
    _chunked(b"k" * 2500),
]
_ENDS = [b"", _get("/last", "Connection: close\r\n") + _get("/never"), b"BAD\r\n\r\n", b"GET /cut"]


@st.composite
def _stream(draw: st.DrawFn) -> tuple[bytes, list[int]]:
    parts = draw(st.lists(st.sampled_from(_PARTS), min_size=1, max_size=5))
    data = b"".join(parts) + draw(st.sampled_from(_ENDS))
    cuts = draw(st.lists(st.integers(1, len(data) - 1), max_size=20, unique=True))
    return data, sorted(cuts)


@settings(max_examples=200, deadline=None)
@given(case=_stream())
def test_any_cut_of_the_same_bytes_gives_the_same_events_and_answers(
    case: tuple[bytes, list[int]],
) -> None:
    data, cuts = case
    whole = Shell()
    whole.feed(data)
    cut = Shell()
    cut.feed_reads(data, cuts)
    assert cut.actions() == whole.actions()
    assert bytes(cut.written).replace(CONTINUE.data, b"") == bytes(whole.written).replace(
        CONTINUE.data, b""
    )
    assert cut.conn.state is whole.conn.state
    assert cut.ledger.buffered == whole.ledger.buffered == 0  # every body given back


def test_the_pure_modules_import_no_io_clock_or_loop() -> None:
    """`state` and `protocol` are the pure core of the edge (house style: pure core, thin
    shells): neither imports a socket, a loop, a clock, threads or logging."""
    banned = {"asyncio", "socket", "selectors", "time", "threading", "logging", "uvloop"}
    for name in ("state", "protocol"):
        spec = importlib.util.find_spec(f"kvatlas.coordinator.http.edge.{name}")
        assert spec is not None and spec.origin is not None
        with open(spec.origin, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        imported = {
            alias.name.split(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, ast.Import)
            for alias in node.names
        } | {
            node.module.split(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module
        }
        assert not imported & banned, (name, imported & banned)
