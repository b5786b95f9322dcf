"""The HTTP edge's parser on a fake clock: `RequestReader` fed bytes and times as
`edge.state.Connection` feeds it, without a socket, a loop or real time. The read deadlines
(408: headers late, a body below the minimum rate over a window, the window restarting
while an earlier request is answered), the idle timeout, the limits (413, 414, 431, 400),
the buffered-bytes budget (503 with Retry-After, counted, given back), and the verdicts'
exact answers. What a connection does with the requests (keep-alive, pipelining, close,
linger): ``test_edge_state.py``. The same rules over real sockets:
``test_edge_server.py``."""

from __future__ import annotations

import functools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvatlas.coordinator.http.edge.messages import HttpRequest
from kvatlas.coordinator.http.edge.protocol import (
    DIRECT_BODY_BYTES,
    HEAD_READ_BYTES,
    MAX_HEADER_BYTES,
    MAX_URL_BYTES,
    READ_BUFFER_BYTES,
    UNRESERVED_BODY_BYTES,
    Ledger,
    Limits,
    Refusal,
    RequestReader,
)

MIB = 1 << 20
T0 = 1000.0
LIMITS = Limits(max_body_bytes=MIB, header_timeout=10.0, body_timeout=10.0, min_body_rate=1000.0)


class Conn:
    """One connection's reader and what it completed (`RequestReader.ready`), fed as the
    connection feeds it: each read fills at most what `RequestReader.buffer` offers."""

    def __init__(
        self, limits: Limits = LIMITS, budget: int = 4 * MIB, ledger: Ledger | None = None
    ) -> None:
        self.ledger = Ledger(budget) if ledger is None else ledger
        view = memoryview(bytearray(READ_BUFFER_BYTES))
        self.reader = RequestReader(
            limits, self.ledger, read_view=view, head_view=view[:HEAD_READ_BYTES], now=T0
        )

    @property
    def requests(self) -> list[tuple[HttpRequest, bool, int]]:
        return list(self.reader.ready)

    def feed(self, data: bytes, now: float) -> Refusal | None:
        at = 0
        while at < len(data):
            target = self.reader.buffer()
            n = min(len(target), len(data) - at)
            target[:n] = data[at : at + n]
            refusal = self.reader.received(n, now)
            if refusal is not None:
                return refusal
            at += n
        return None

    def bodies(self) -> list[bytes]:
        return [bytes(r.body) for r, _, _ in self.requests]


def _post(body: bytes) -> bytes:
    return b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body)


def _answer(status: int, phrase: bytes, error: bytes, extra: bytes = b"") -> bytes:
    body = b'{"error":"%b"}' % error
    return (
        b"HTTP/1.1 %d %b\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%b"
        b"connection: close\r\n\r\n%b" % (status, phrase, len(body), extra, body)
    )


# ---- the header deadline -------------------------------------------------------------


def test_headers_trickled_byte_by_byte_get_408_at_the_deadline_of_the_first_byte() -> None:
    """Every byte is activity, yet the headers must be complete within header_timeout of
    the request's first byte: not a microsecond later, and not a microsecond before."""
    c = Conn()
    head = b"GET /items/a HTTP/1.1\r\nX-Slow: " + b"z" * 200
    for i, byte in enumerate(head):
        assert c.feed(bytes([byte]), T0 + i * 0.04) is None  # 9.4 s of trickle
        assert c.reader.overdue(T0 + i * 0.04, busy=False) is None
    assert not c.reader.idle_expired(T0 + 10.0)
    assert c.reader.overdue(T0 + 10.0, busy=False) is None
    refusal = c.reader.overdue(T0 + 10.001, busy=False)
    assert refusal is not None
    assert refusal.answer() == _answer(
        408, b"Request Timeout", b"request line and headers not received in 10.0 s"
    )
    assert c.ledger.refused == {
        "header_deadline": 1,
        "body_rate": 0,
        "connections": 0,
        "buffered_bytes": 0,
    }
    assert c.requests == []


def test_the_header_deadline_counts_per_request_on_a_kept_alive_connection() -> None:
    """Four requests, each arriving over 8 s, are all taken: 32 s in all, past the
    10 s deadline, which counts from each request's own first byte."""
    c = Conn()
    now = T0
    for name in "abcd":
        raw = f"GET /items/{name} HTTP/1.1\r\nHost: x\r\n\r\n".encode()
        for i, byte in enumerate(raw):
            at = now + 8.0 * i / (len(raw) - 1)
            assert c.reader.overdue(at, busy=False) is None
            assert c.feed(bytes([byte]), at) is None
        now += 8.0
    assert [r.path for r, _, _ in c.requests] == ["/items/a", "/items/b", "/items/c", "/items/d"]
    assert [r.arrived for r, _, _ in c.requests] == [T0, T0 + 8, T0 + 16, T0 + 24]
    assert c.ledger.refused["header_deadline"] == 0


def test_a_request_says_when_its_first_byte_arrived() -> None:
    c = Conn()
    data = _post(b"y" * 50_000)
    assert c.feed(data[:20], T0) is None
    assert c.feed(data[20:30_000], T0 + 0.15) is None
    assert c.feed(data[30_000:], T0 + 0.3) is None
    ((request, keep_alive, _),) = c.requests
    assert (request.arrived, keep_alive, len(request.body)) == (T0, True, 50_000)


def test_a_request_waiting_behind_an_answer_is_not_held_to_its_deadlines() -> None:
    """While the connection is busy (reading may be paused), neither the header deadline
    nor the body's rate applies, and the body's window starts again at each sweep."""
    c = Conn()
    assert c.feed(b"GET /a HTTP/1.1\r\n", T0) is None
    assert c.reader.overdue(T0 + 60, busy=True) is None
    assert c.reader.overdue(T0 + 10.001, busy=False) is not None  # not busy: late

    c = Conn()
    assert c.feed(_post(b"x" * 30_000)[:-20_000], T0) is None  # the body has begun
    assert c.reader.overdue(T0 + 30, busy=True) is None  # its window starts at T0 + 30
    assert c.reader.overdue(T0 + 39.9, busy=False) is None
    refusal = c.reader.overdue(T0 + 40, busy=False)  # a whole window without a byte
    assert refusal is not None and refusal.status == 408


# ---- the body's minimum rate -----------------------------------------------------------


def _body_at(rate: float, seconds: int, size: int) -> tuple[Conn, Refusal | None, float]:
    """A ``size`` body sent at ``rate`` bytes/s, a piece each second, the sweep checking
    each second: the connection, the first refusal, and when it came."""
    c = Conn()
    data = _post(b"b" * size)
    head = len(data) - size
    assert c.feed(data[:head], T0) is None
    sent = head
    for s in range(1, seconds + 1):
        now = T0 + s
        upto = min(len(data), head + int(rate * s))
        assert c.feed(data[sent:upto], now) is None
        sent = upto
        refusal = c.reader.overdue(now, busy=False)
        if refusal is not None or sent == len(data):
            return c, refusal, now
    return c, None, T0 + seconds


def test_a_body_at_the_minimum_rate_is_served_and_below_it_gets_408() -> None:
    c, refusal, _ = _body_at(1000, 60, 50_000)
    assert refusal is None
    assert c.bodies() == [b"b" * 50_000]

    c, refusal, when = _body_at(999, 60, 50_000)
    assert refusal is not None and when == T0 + 10  # the first window's end
    assert refusal.answer() == _answer(
        408, b"Request Timeout", b"request body arriving slower than 1000 bytes/s"
    )
    assert c.ledger.refused["body_rate"] == 1
    assert c.requests == []


def test_a_body_that_arrived_fast_and_then_stalls_is_cut_within_two_windows() -> None:
    """900 KB at once buy no 900 s of silence: the rate holds over every window."""
    c = Conn()
    assert c.feed(_post(b"x" * MIB)[:900_000], T0) is None
    assert c.ledger.buffered == MIB  # the declared length is reserved
    for at, late in ((9.9, False), (10.0, False), (19.9, False), (20.0, True)):
        refusal = c.reader.overdue(T0 + at, busy=False)
        assert (refusal is not None) == late, at
    assert c.ledger.refused["body_rate"] == 1
    assert c.reader.drop() == MIB
    assert c.ledger.buffered == 0


def test_the_idle_timeout_counts_from_the_last_data_or_answer() -> None:
    c = Conn(Limits(max_body_bytes=MIB, idle_timeout=75.0))
    assert not c.reader.idle_expired(T0 + 75.0)
    assert c.reader.idle_expired(T0 + 75.001)
    assert c.feed(b"GET /a HTTP/1.1\r\n\r\n", T0 + 50) is None
    c.reader.touch(T0 + 60)  # answered
    assert not c.reader.idle_expired(T0 + 135.0)
    assert c.reader.idle_expired(T0 + 135.001)


# ---- limits ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "status", "reason"),
    [
        (b"GET /" + b"a" * MAX_URL_BYTES + b" HTTP/1.1\r\n\r\n", 414, b"request target longer"),
        (b"GET / HTTP/1.1\r\nX: " + b"b" * MAX_HEADER_BYTES + b"\r\n\r\n", 431, b"headers exceed"),
        (
            b"POST / HTTP/1.1\r\nContent-Length: 20000\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"5\r\nhello\r\n0\r\n\r\n",
            400,
            b"malformed HTTP request",
        ),
        (b"NOT HTTP AT ALL\r\n\r\n", 400, b"malformed HTTP request"),
        (b"GET / HTTP/1.1\r\nUpgrade: ws\r\nConnection: upgrade\r\n\r\n", 400, b"upgrades"),
        (b"GET http://[ HTTP/1.1\r\nHost: x\r\n\r\n", 400, b"malformed request target"),
    ],
)
def test_requests_over_a_limit_or_malformed_are_refused(
    raw: bytes, status: int, reason: bytes
) -> None:
    c = Conn()
    refusal = c.feed(raw, T0)
    assert refusal is not None
    assert refusal.status == status
    assert reason in refusal.answer()
    assert c.requests == []  # an upgrade too is refused before it is queued


def test_a_body_over_the_limit_is_refused_before_it_is_read() -> None:
    c = Conn()
    refusal = c.feed(b"POST /echo HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % (MIB + 1), T0)
    assert refusal is not None
    assert refusal.answer() == _answer(
        413,
        b"Request Entity Too Large",
        b"body of %d bytes exceeds the limit of %d" % (MIB + 1, MIB),
    )
    assert c.ledger.buffered == 0
    chunked = b"POST /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
    c = Conn(Limits(max_body_bytes=1024))
    refusal = c.feed(chunked + (b"400\r\n" + b"x" * 1024 + b"\r\n") * 2, T0)
    assert refusal is not None and refusal.status == 413
    assert b"body exceeds the limit of 1024 bytes" in refusal.answer()


def test_the_budget_refuses_503_counts_and_gets_its_bytes_back() -> None:
    """Two stalled 1 MiB bodies hold a server's 2 MiB budget: a third large body is
    refused before any of it is read, a small one is still taken."""
    ledger = Ledger(2 * MIB)
    a, b, third = Conn(ledger=ledger), Conn(ledger=ledger), Conn(ledger=ledger)
    assert a.feed(_post(b"x" * MIB)[:1000], T0) is None
    assert b.feed(_post(b"y" * MIB)[:1000], T0) is None
    assert ledger.buffered == 2 * MIB
    refusal = third.feed(_post(b"z" * (UNRESERVED_BODY_BYTES + 1)), T0)
    assert refusal is not None
    assert refusal.answer() == _answer(
        503,
        b"Service Unavailable",
        b"request bodies buffered at once reached the limit of 2097152 bytes; retry later",
        b"retry-after: 1\r\n",
    )
    small = b"s" * UNRESERVED_BODY_BYTES  # unreserved: taken while the budget is full
    fourth = Conn(ledger=ledger)
    assert fourth.feed(_post(small), T0) is None
    assert fourth.bodies() == [small]
    assert a.reader.drop() == MIB
    assert a.ledger.buffered == MIB
    assert a.ledger.refused["buffered_bytes"] == 1
    assert a.ledger.over_connection_cap(7).answer() == _answer(
        503,
        b"Service Unavailable",
        b"too many open connections (the limit is 7); retry later",
        b"retry-after: 1\r\n",
    )
    assert a.ledger.refused["connections"] == 1


def test_a_chunked_body_reserves_what_has_arrived() -> None:
    c = Conn(budget=MIB)
    head = b"POST /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
    chunk = b"%x\r\n%b\r\n" % (100_000, b"c" * 100_000)
    assert c.feed(head + chunk, T0) is None
    assert c.ledger.buffered == 100_000
    assert c.feed(chunk + b"0\r\n\r\n", T0) is None
    ((_, _, reserved),) = c.requests
    assert reserved == 200_000 and c.bodies() == [b"c" * 200_000]


def test_expect_continue_is_noted_once_the_headers_are_in() -> None:
    c = Conn()
    head = b"POST /echo HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n"
    assert c.feed(head[:-1], T0) is None
    assert not c.reader.continue_asked
    assert c.feed(head[-1:], T0) is None
    assert (c.reader.continue_asked, c.requests) == (True, [])
    c.reader.continued()
    assert not c.reader.continue_asked
    assert c.feed(b"ok", T0) is None
    assert c.bodies() == [b"ok"]
    assert not c.reader.continue_asked


def test_http10_and_connection_close_are_not_kept_alive() -> None:
    for raw, keep_alive in (
        (b"GET /a HTTP/1.0\r\n\r\n", False),
        (b"GET /b HTTP/1.1\r\nConnection: close\r\n\r\n", False),
        (b"GET /c HTTP/1.1\r\n\r\n", True),
    ):
        c = Conn()
        assert c.feed(raw, T0) is None
        assert [keep for _, keep, _ in c.requests] == [keep_alive]


# ---- bodies read straight into their own buffer ---------------------------------------


@functools.cache
def _pattern(n: int, seed: int) -> bytes:
    """``n`` bytes that differ from a shifted copy (a misplaced chunk shows)."""
    return bytes((i * 7 + i // 251 + seed) & 0xFF for i in range(n))


def test_a_direct_body_is_offered_exactly_its_missing_span() -> None:
    c = Conn()
    body = _pattern(DIRECT_BODY_BYTES * 4, 1)
    data = _post(body) + _post(b"next")
    assert c.feed(data[:HEAD_READ_BYTES], T0) is None
    assert len(c.reader.buffer()) == len(_post(body)) - HEAD_READ_BYTES
    assert c.feed(data[HEAD_READ_BYTES:], T0) is None
    assert c.bodies() == [body, b"next"]
    assert isinstance(c.requests[0][0].body, bytearray)


@st.composite
def _pipelined(draw: st.DrawFn) -> tuple[list[bytes], list[int]]:
    sizes = st.sampled_from(
        [0, 3, DIRECT_BODY_BYTES - 1, DIRECT_BODY_BYTES, DIRECT_BODY_BYTES + 1, 70_000, 200_000]
    )
    bodies = [_pattern(n, i) for i, n in enumerate(draw(st.lists(sizes, min_size=1, max_size=4)))]
    total = sum(len(_post(b)) for b in bodies)
    cuts = draw(st.lists(st.integers(1, total - 1), max_size=12, unique=True))
    return bodies, sorted(cuts)


@settings(max_examples=150, deadline=None)
@given(case=_pipelined())
def test_pipelined_bodies_cut_anywhere_arrive_whole_in_order_and_give_back(
    case: tuple[list[bytes], list[int]],
) -> None:
    bodies, cuts = case
    data = b"".join(_post(b) for b in bodies)
    c = Conn()
    at = 0
    for cut in [*cuts, len(data)]:
        assert c.feed(data[at:cut], T0) is None
        at = cut
    assert c.bodies() == bodies
    reserved = sum(r for _, _, r in c.requests)
    assert reserved == sum(len(b) for b in bodies if len(b) > UNRESERVED_BODY_BYTES)
    assert c.ledger.buffered == reserved  # held until the shell answers them
    assert not c.reader.arriving
