"""The coordinator's HTTP/1.1 server on its own, over real loopback sockets: routing,
keep-alive and pipelining order, limits, `Expect: 100-continue`, coroutine and
thread-pool handlers, errors, idle timeouts, read deadlines (408), the connection cap
(503), the buffered-bytes budget (503) and shutdown. Deadlines run on a `FakeClock` the
test steps: what is checked here is that the shell reads and sweeps by the injected
clock; where each deadline falls to the microsecond is ``test_edge_protocol.py``'s."""

from __future__ import annotations

import asyncio
import select
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any, BinaryIO

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvatlas.coordinator.edge.connection import LINGER_S
from kvatlas.coordinator.edge.messages import HttpRequest, HttpResponse
from kvatlas.coordinator.edge.protocol import (
    DIRECT_BODY_BYTES,
    HEAD_READ_BYTES,
    UNRESERVED_BODY_BYTES,
)
from kvatlas.coordinator.edge.routing import Router, always
from kvatlas.coordinator.edge.server import HttpServer
from support.wait import wait_until


class Boom(Exception):
    pass


def _translate(exc: Exception) -> HttpResponse | None:
    if isinstance(exc, ValueError):
        return HttpResponse(400, b'{"error":"bad value"}')
    return None


def _echo(request: HttpRequest) -> HttpResponse:
    return HttpResponse(200, request.body, "application/octet-stream")


def _item(request: HttpRequest) -> HttpResponse:
    body = f"{request.path_params['name']}?{request.query.get('q', '')}".encode()
    return HttpResponse(200, body, "text/plain")


_slow_started: list[float] = []
"""When each /slow request entered its handler (a test waits for one to be in flight)."""


async def _slow(request: HttpRequest) -> HttpResponse:
    _slow_started.append(time.monotonic())
    # the handler's own work, not synchronisation: a coroutine that takes its time
    await asyncio.sleep(float(request.query.get("s", "0.05")))
    return HttpResponse(200, b"slow", "text/plain")


def _thread(request: HttpRequest) -> HttpResponse:
    time.sleep(0.02)  # the handler's own work: a blocking call the pool must absorb
    return HttpResponse(200, threading.current_thread().name.encode(), "text/plain")


def _value_error(request: HttpRequest) -> HttpResponse:
    raise ValueError("no")


def _boom(request: HttpRequest) -> HttpResponse:
    raise Boom("bug")


_BIG = b"b" * (16 << 20)


def _big(request: HttpRequest) -> HttpResponse:
    return HttpResponse(200, _BIG, "application/octet-stream")


def _arrived(request: HttpRequest) -> HttpResponse:
    """When the request's first byte arrived (the server's clock), and its body's length."""
    return HttpResponse(200, b"%.6f %d" % (request.arrived, len(request.body)))


class FakeClock:
    """The server's clock, stepped by the test (read on the server's loop); ``reads``
    counts its reads, so that a test can wait for sweeps to have run."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Served:
    def __init__(
        self,
        idle_timeout: float = 75.0,
        shutdown_grace: float = 5.0,
        max_body_bytes: int = 1024,
        **limits: Any,
    ) -> None:
        r = Router()
        r.add("POST", "/echo", _echo)
        r.add("GET", "/items/{name}", _item)
        r.add("GET", "/slow", _slow)
        r.add("GET", "/thread", _thread, offload=always)
        r.add("GET", "/value-error", _value_error)
        r.add("GET", "/boom", _boom)
        r.add("GET", "/big", _big)
        r.add("POST", "/arrived", _arrived)
        self.server = HttpServer(
            r,
            _translate,
            max_body_bytes=max_body_bytes,
            idle_timeout=idle_timeout,
            shutdown_grace=shutdown_grace,
            **limits,
        )
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        self.port = sock.getsockname()[1]
        self.thread = threading.Thread(target=self.server.run, args=(sock,), daemon=True)
        self.thread.start()
        self.sock = sock
        assert self.server.serving.wait(10), "server did not start"

    def connect(self) -> socket.socket:
        s = socket.create_connection(("127.0.0.1", self.port), timeout=10)
        return s

    def stop(self) -> None:
        self.server.stop()
        self.thread.join(15)
        assert not self.thread.is_alive()
        self.sock.close()


@pytest.fixture
def served() -> Iterator[Served]:
    s = Served()
    yield s
    s.stop()


def _read_response(reader: BinaryIO) -> tuple[int, dict[str, str], bytes]:
    status_line = reader.readline()
    status = int(status_line.split()[1])
    headers: dict[str, str] = {}
    while True:
        line = reader.readline()
        if line in (b"\r\n", b""):
            break
        k, v = line.decode().split(":", 1)
        headers[k.strip().lower()] = v.strip()
    n = int(headers.get("content-length", "0"))
    return status, headers, reader.read(n)


def test_routes_params_query_and_methods(served: Served) -> None:
    with httpx.Client(base_url=f"http://127.0.0.1:{served.port}") as c:
        r = c.post("/echo", content=b"hello")
        assert (r.status_code, r.content) == (200, b"hello")
        assert r.headers["content-type"] == "application/octet-stream"
        r = c.get("/items/abc", params={"q": "x y"})
        assert r.text == "abc?x y"
        r = c.get("/echo")
        assert r.status_code == 405
        assert r.headers["allow"] == "POST"
        r = c.get("/nowhere")
        assert r.status_code == 404
        assert "/nowhere" in r.json()["error"]
        r = c.head("/items/abc")
        assert r.status_code == 200
        assert r.content == b""
        assert r.headers["content-length"] == "4"


def test_handler_errors_are_translated_or_500(served: Served) -> None:
    with httpx.Client(base_url=f"http://127.0.0.1:{served.port}") as c:
        r = c.get("/value-error")
        assert (r.status_code, r.json()) == (400, {"error": "bad value"})
        r = c.get("/boom")
        assert r.status_code == 500
        assert "Boom" in r.json()["error"]
        # The connection survives a handler's error.
        assert c.post("/echo", content=b"after").content == b"after"


def test_pipelined_requests_are_answered_in_order(served: Served) -> None:
    """A coroutine handler and a pool handler in the middle must not reorder answers."""
    s = served.connect()
    reqs = [
        b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\none",
        b"GET /slow?s=0.1 HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET /thread HTTP/1.1\r\nHost: x\r\n\r\n",
        b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n\r\nfour",
    ]
    s.sendall(b"".join(reqs))
    f = s.makefile("rb")
    bodies = [_read_response(f)[2] for _ in reqs]
    assert bodies[0] == b"one"
    assert bodies[1] == b"slow"
    assert bodies[2].startswith(b"http-offload")
    assert bodies[3] == b"four"
    s.close()


def test_chunked_body_and_expect_continue(served: Served) -> None:
    s = served.connect()
    s.sendall(
        b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
    )
    f = s.makefile("rb")
    assert _read_response(f)[::2] == (200, b"abcde")
    s.sendall(
        b"POST /echo HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n"
    )
    assert f.readline().startswith(b"HTTP/1.1 100")
    assert f.readline() == b"\r\n"
    s.sendall(b"ok")
    assert _read_response(f)[::2] == (200, b"ok")
    s.close()


def test_limits_answer_and_close(served: Served) -> None:
    s = served.connect()
    s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n")
    f = s.makefile("rb")
    status, headers, body = _read_response(f)
    assert status == 413
    assert b"5000" in body
    assert headers["connection"] == "close"
    assert f.read() == b""  # closed
    s.close()
    chunk = b"400\r\n" + b"x" * 1024 + b"\r\n"
    for raw, status in (
        # a chunked body that grows past the limit
        (b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + chunk * 2, 413),
        (b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414),
        (b"GET /items/a HTTP/1.1\r\n" + b"X-Big: " + b"b" * 70000 + b"\r\n\r\n", 431),
    ):
        s = served.connect()
        s.sendall(raw)
        assert _read_response(s.makefile("rb"))[0] == status
        s.close()


def test_malformed_request_gets_400(served: Served) -> None:
    s = served.connect()
    s.sendall(b"NOT HTTP AT ALL\r\n\r\n")
    status, _, body = _read_response(s.makefile("rb"))
    assert status == 400
    assert b"malformed" in body
    s.close()


def test_connection_close_and_http10(served: Served) -> None:
    s = served.connect()
    s.sendall(b"GET /items/z HTTP/1.0\r\n\r\n")
    f = s.makefile("rb")
    status, headers, body = _read_response(f)
    assert (status, body, headers["connection"]) == (200, b"z?", "close")
    assert f.read() == b""
    s.close()


def _answered_within(s: socket.socket, seconds: float) -> bool:
    """Whether ``s`` has data or its end to read within ``seconds``."""
    return bool(select.select([s], [], [], seconds)[0])


def _swept(clock: FakeClock) -> None:
    """Wait until a sweep has run to its end since now: two more reads of the clock (at
    most one of them is a connection's, when data arrives; the loop runs one at a time,
    so the first sweep is over when the next read happens)."""
    start = clock.reads
    wait_until(lambda: clock.reads, lambda n: n >= start + 2, what="a sweep", timeout=10)


def _untouched(s: socket.socket, clock: FakeClock) -> bool:
    """A sweep ran at the standing clock, and ``s`` got nothing from it."""
    _swept(clock)
    return not _answered_within(s, 0.05)


def _arriving(served: Served) -> bool:
    return any(c.arriving for c in list(served.server.connections))


def _wait_arriving(served: Served) -> None:
    wait_until(
        lambda: _arriving(served), what="a request arriving", timeout=5, every=0.005,
        ignore=(RuntimeError,),
    )  # fmt: skip


def test_idle_connections_are_closed_by_the_servers_clock() -> None:
    clock = FakeClock()
    served = Served(idle_timeout=0.3, clock=clock)
    try:
        s = served.connect()
        s.sendall(b"GET /items/a HTTP/1.1\r\nHost: x\r\n\r\n")
        f = s.makefile("rb")
        assert _read_response(f)[0] == 200
        assert _untouched(s, clock)  # the clock stands still: open
        clock.advance(0.31)
        assert f.read() == b""  # the server closes it
        s.close()
    finally:
        served.stop()


def test_a_stalled_request_is_closed_like_an_idle_connection() -> None:
    clock = FakeClock()
    served = Served(idle_timeout=0.3, clock=clock)
    try:
        s = served.connect()
        s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nabc")
        _wait_arriving(served)
        assert _untouched(s, clock)
        clock.advance(0.31)
        assert s.makefile("rb").read() == b""  # closed without an answer
        s.close()
    finally:
        served.stop()


def test_half_closed_client_still_gets_its_answers(served: Served) -> None:
    s = served.connect()
    s.sendall(b"GET /slow?s=0.1 HTTP/1.1\r\nHost: x\r\n\r\nGET /thread HTTP/1.1\r\nHost: x\r\n\r\n")
    s.shutdown(socket.SHUT_WR)
    f = s.makefile("rb")
    assert _read_response(f)[2] == b"slow"
    assert _read_response(f)[2].startswith(b"http-offload")
    assert f.read() == b""
    s.close()


def test_stop_lets_a_busy_request_finish() -> None:
    served = Served(shutdown_grace=5.0)
    s = served.connect()
    started = len(_slow_started)
    s.sendall(b"GET /slow?s=0.3 HTTP/1.1\r\nHost: x\r\n\r\n")
    wait_until(lambda: len(_slow_started), lambda n: n > started, what="the request in its handler")
    idle = served.connect()
    stopper = threading.Thread(target=served.stop)
    stopper.start()
    status, headers, body = _read_response(s.makefile("rb"))
    assert (status, body) == (200, b"slow")
    assert headers["connection"] == "close"
    stopper.join(15)
    assert idle.makefile("rb").read() == b""
    s.close()
    idle.close()


@st.composite
def _garbled(draw: st.DrawFn) -> bytes:
    """A valid request cut, spliced or sprinkled with bytes, or plain noise."""
    valid = b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc"
    kind = draw(st.sampled_from(["noise", "cut", "splice"]))
    if kind == "noise":
        return draw(st.binary(min_size=1, max_size=200))
    if kind == "cut":
        return valid[: draw(st.integers(1, len(valid) - 1))]
    at = draw(st.integers(0, len(valid)))
    return valid[:at] + draw(st.binary(min_size=1, max_size=20)) + valid[at:]


@settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=_garbled())
def test_garbled_requests_never_break_the_server(served: Served, data: bytes) -> None:
    """Whatever arrives, the server answers (below 500) or closes; the next client is
    served normally."""
    s = served.connect()
    s.settimeout(5)
    s.sendall(data)
    s.shutdown(socket.SHUT_WR)
    got = b""
    try:
        while chunk := s.recv(65536):
            got += chunk
    except TimeoutError:
        pass  # an incomplete request waits for more: that is fine too
    s.close()
    for status_line in (line for line in got.split(b"\r\n") if line.startswith(b"HTTP/1.1 ")):
        assert int(status_line.split()[1]) < 500, got[:300]
    with httpx.Client(base_url=f"http://127.0.0.1:{served.port}") as c:
        assert c.post("/echo", content=b"ok").content == b"ok"


def _open_connections(served: Served) -> int:
    return len(served.server.connections)


def test_headers_late_get_408_by_the_servers_clock() -> None:
    """Bytes of the headers keep coming, yet past the header timeout of the request's
    first byte on the server's clock, the request gets 408 and the connection closes."""
    clock = FakeClock()
    served = Served(header_timeout=0.5, clock=clock)
    try:
        s = served.connect()
        s.sendall(b"GET /items/a HTTP/1.1\r\n")
        _wait_arriving(served)
        s.sendall(b"X-Slow: zzz")
        assert _untouched(s, clock)  # the clock stands still: no deadline yet
        clock.advance(0.51)
        s.sendall(b"zzz")
        status, headers, body = _read_response(s.makefile("rb"))
        assert status == 408
        assert b"headers" in body
        assert headers["connection"] == "close"
        assert s.recv(1) == b""  # closed
        assert served.server.stats().refused["header_deadline"] == 1
        s.close()
    finally:
        served.stop()


def test_a_body_below_the_minimum_rate_gets_408_by_the_servers_clock() -> None:
    clock = FakeClock()
    served = Served(body_timeout=0.3, min_body_rate=1000, clock=clock)
    try:
        s = served.connect()
        s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n" + b"x" * 100)
        _wait_arriving(served)
        assert _untouched(s, clock)
        clock.advance(0.31)  # 100 bytes in a window of 0.31 s: below 1000 bytes/s
        status, _, body = _read_response(s.makefile("rb"))
        assert status == 408
        assert b"1000 bytes/s" in body
        assert served.server.stats().refused["body_rate"] == 1
        s.close()
    finally:
        served.stop()


def test_connections_over_the_cap_get_503_and_the_next_one_after_a_close_is_served() -> None:
    served = Served(max_connections=2)
    try:
        held = [served.connect() for _ in range(2)]
        for s in held:  # both are served (so both are counted)
            s.sendall(b"GET /items/a HTTP/1.1\r\nHost: x\r\n\r\n")
            assert _read_response(s.makefile("rb"))[0] == 200
        with httpx.Client(base_url=f"http://127.0.0.1:{served.port}") as c:
            r = c.get("/items/b")
        assert r.status_code == 503
        assert r.headers["retry-after"] == "1"
        assert r.headers["connection"] == "close"
        assert "too many open connections (the limit is 2)" in r.json()["error"]
        silent = served.connect()  # a client that sends nothing still gets the answer
        f = silent.makefile("rb")
        assert _read_response(f)[0] == 503
        assert f.read() == b""
        silent.close()
        held.pop().close()
        wait_until(
            lambda: _open_connections(served), lambda n: n < 2, what="the closed one let go",
            timeout=5, every=0.01,
        )  # fmt: skip
        with httpx.Client(base_url=f"http://127.0.0.1:{served.port}") as c:
            assert c.get("/items/c").status_code == 200
        for s in held:
            s.close()
    finally:
        served.stop()


def test_a_client_that_does_not_read_its_last_answer_is_reset_after_the_linger() -> None:
    """A closed connection whose answer cannot flush must not hold its place forever:
    it is reset once LINGER_S has passed on the server's clock, not before."""
    clock = FakeClock()
    served = Served(header_timeout=0.3, clock=clock)
    try:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", served.port))
        s.sendall(b"GET /big HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        wait_until(
            lambda: _open_connections(served), lambda n: n == 1, what="the connection open",
            timeout=5, every=0.01,
        )  # fmt: skip
        _swept(clock)  # at a standing clock: still lingering
        assert _open_connections(served) == 1
        clock.advance(LINGER_S + 0.01)
        wait_until(
            lambda: _open_connections(served), lambda n: n == 0, what="the connection reset",
            timeout=5, every=0.01,
        )  # fmt: skip
        s.close()
    finally:
        served.stop()


MIB = 1 << 20


def _post_head(length: int) -> bytes:
    return b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % length


def _buffered(served: Served) -> int:
    return served.server.stats().buffered_bytes


def test_bodies_reserve_the_buffered_bytes_budget_and_give_it_back() -> None:
    """Two stalled 1 MiB bodies hold a 2 MiB budget: a third large body gets 503 with
    Retry-After before any of it is read, a small one is still served, and a close gives
    the budget back to the next large body."""
    served = Served(max_body_bytes=MIB, max_buffered_bytes=2 * MIB)
    try:
        stalled = []
        for _ in range(2):
            s = served.connect()
            s.sendall(_post_head(MIB) + b"x" * 100_000)
            stalled.append(s)
        wait_until(
            lambda: _buffered(served), lambda n: n == 2 * MIB, what="two bodies reserved",
            timeout=5, every=0.01,
        )  # fmt: skip
        third = served.connect()
        third.sendall(_post_head(UNRESERVED_BODY_BYTES + 1))
        status, headers, body = _read_response(third.makefile("rb"))
        assert (status, headers["retry-after"], headers["connection"]) == (503, "1", "close")
        assert b"buffered at once reached the limit of 2097152 bytes" in body
        third.close()
        with httpx.Client(base_url=f"http://127.0.0.1:{served.port}") as c:
            small = b"s" * UNRESERVED_BODY_BYTES
            r = c.post("/echo", content=small)
            assert (r.status_code, r.content) == (200, small)
            chunked = c.post("/echo", content=iter([b"c" * UNRESERVED_BODY_BYTES, b"c"]))
            assert chunked.status_code == 503  # no declared length: reserved as it arrives
        stalled.pop().close()
        wait_until(
            lambda: _buffered(served), lambda n: n == MIB, what="the closed body given back",
            timeout=5, every=0.01,
        )  # fmt: skip
        with httpx.Client(base_url=f"http://127.0.0.1:{served.port}") as c:
            big = b"b" * MIB
            r = c.post("/echo", content=big)
            assert (r.status_code, r.content) == (200, big)
        assert _buffered(served) == MIB  # the answered body gave its reservation back
        stalled.pop().close()
        wait_until(
            lambda: _buffered(served), lambda n: n == 0, what="every reservation given back",
            timeout=5, every=0.01,
        )  # fmt: skip
        assert served.server.stats().refused["buffered_bytes"] == 2
    finally:
        served.stop()


def test_the_budget_must_hold_the_largest_body() -> None:
    with pytest.raises(ValueError, match="max_buffered_bytes"):
        HttpServer(Router(), _translate, max_body_bytes=MIB, max_buffered_bytes=MIB - 1)


def test_a_body_that_arrived_fast_and_then_stalls_gets_408() -> None:
    """The minimum rate holds over every window: 900 KB at once buy no 900 s of silence.
    The clock steps a window at a time until the body has stopped arriving."""
    clock = FakeClock()
    served = Served(max_body_bytes=MIB, body_timeout=0.3, min_body_rate=1000, clock=clock)
    try:
        s = served.connect()
        s.sendall(_post_head(MIB) + b"x" * 900_000)
        for _ in range(40):
            clock.advance(0.31)
            if _answered_within(s, 0.4):
                break
        status, _, body = _read_response(s.makefile("rb"))
        assert status == 408
        assert b"1000 bytes/s" in body
        s.close()
        wait_until(
            lambda: _buffered(served), lambda n: n == 0, what="the cut body given back",
            timeout=5, every=0.01,
        )  # fmt: skip
        assert served.server.stats().refused["body_rate"] == 1
    finally:
        served.stop()


# ---- bodies read straight into their own buffer (DIRECT_BODY_BYTES and up) ----------


def _pattern(n: int, seed: int) -> bytes:
    """``n`` bytes that differ at every position from a shifted copy (a misplaced chunk
    shows), and from one seed to the next."""
    return bytes((i * 7 + i // 251 + seed) & 0xFF for i in range(n))


def _send_in_pieces(s: socket.socket, data: bytes, cuts: list[int], pause_s: float) -> None:
    """Send ``data`` cut at ``cuts`` (sorted offsets), each piece its own segment: the
    client does not coalesce (TCP_NODELAY) and pauses between pieces."""
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    at = 0
    for cut in [*cuts, len(data)]:
        if cut > at:
            s.sendall(data[at:cut])
            at = cut
            time.sleep(pause_s)


def test_the_direct_body_sizes_are_what_the_tests_assume() -> None:
    """The head read is small enough that a body of DIRECT_BODY_BYTES and more is read
    in at least two reads, the second straight into its buffer."""
    assert UNRESERVED_BODY_BYTES > DIRECT_BODY_BYTES >= HEAD_READ_BYTES


def test_a_big_body_in_many_segments_arrives_whole_and_the_connection_goes_on() -> None:
    """A body over DIRECT_BODY_BYTES sent in pieces of 1 byte to 60 KB, each its own
    segment, arrives whole and in order; the next request on the connection (a fresh
    parser) is served, and every reservation is given back."""
    served = Served(max_body_bytes=MIB)
    try:
        body = _pattern(300_000, 1)
        data = _post_head(len(body)) + body
        cuts = [10, 60, 61, 62, 100, 5000, 20_000, 20_001, 80_000, 140_000, 299_000]
        s = served.connect()
        _send_in_pieces(s, data, cuts, 0.002)
        f = s.makefile("rb")
        assert _read_response(f) == (200, _echo_headers(len(body)), body)
        s.sendall(_post_head(5) + b"after")
        assert _read_response(f)[2] == b"after"
        s.close()
        wait_until(
            lambda: _buffered(served), lambda n: n == 0, what="the reservation given back",
            timeout=5, every=0.01,
        )  # fmt: skip
    finally:
        served.stop()


def _echo_headers(length: int) -> dict[str, str]:
    return {"content-type": "application/octet-stream", "content-length": str(length)}


@st.composite
def _pipelined(draw: st.DrawFn) -> tuple[list[bytes], list[int]]:
    """A few requests' bodies (small, around DIRECT_BODY_BYTES, big) and where to cut
    their pipelined bytes into segments."""
    sizes = st.sampled_from(
        [0, 3, DIRECT_BODY_BYTES - 1, DIRECT_BODY_BYTES, DIRECT_BODY_BYTES + 1, 70_000, 200_000]
    )
    bodies = [_pattern(n, i) for i, n in enumerate(draw(st.lists(sizes, min_size=1, max_size=4)))]
    total = sum(len(_post_head(len(b))) + len(b) for b in bodies)
    cuts = draw(st.lists(st.integers(1, total - 1), max_size=12, unique=True))
    return bodies, sorted(cuts)


@pytest.fixture(scope="module")
def served_big() -> Iterator[Served]:
    """One server for every example of a hypothesis test."""
    s = Served(max_body_bytes=MIB)
    yield s
    s.stop()


@settings(max_examples=30, deadline=None)
@given(case=_pipelined())
def test_pipelined_bodies_cut_anywhere_are_answered_whole_and_in_order(
    served_big: Served, case: tuple[list[bytes], list[int]]
) -> None:
    """Pipelined requests, small and big bodies mixed, their bytes cut into segments
    at any points (a body's end and the next request's head in one segment, a head cut
    in its middle): every body comes back whole, in order."""
    bodies, cuts = case
    data = b"".join(_post_head(len(b)) + b for b in bodies)
    s = served_big.connect()
    try:
        _send_in_pieces(s, data, cuts, 0.0005)
        f = s.makefile("rb")
        for body in bodies:
            assert _read_response(f) == (200, _echo_headers(len(body)), body)
    finally:
        s.close()


def test_content_length_mismatches() -> None:
    """A direct body shorter than declared: with the client gone, nothing is answered
    and its reservation comes back; stalled, it gets 408. Longer than declared: the
    request is answered with the declared bytes, and the rest is the next request (here
    malformed: 400, and the connection closes)."""
    served = Served(max_body_bytes=MIB, body_timeout=0.3, min_body_rate=1000)
    try:
        s = served.connect()
        s.sendall(_post_head(200_000) + b"x" * 100_000)
        s.shutdown(socket.SHUT_WR)
        assert s.makefile("rb").read() == b""  # closed, no answer
        s.close()
        wait_until(
            lambda: _buffered(served), lambda n: n == 0, what="the short body given back",
            timeout=5, every=0.01,
        )  # fmt: skip

        s = served.connect()
        s.sendall(_post_head(200_000) + b"x" * 100_000)
        status, _, body = _read_response(s.makefile("rb"))
        assert status == 408 and b"bytes/s" in body
        s.close()

        s = served.connect()
        body = _pattern(DIRECT_BODY_BYTES * 2, 3)
        s.sendall(_post_head(len(body)) + body + b"garbage that is no request\r\n\r\n")
        f = s.makefile("rb")
        assert _read_response(f) == (200, _echo_headers(len(body)), body)
        status, headers, _ = _read_response(f)
        assert status == 400 and headers["connection"] == "close"
        assert f.read() == b""
        s.close()
        wait_until(
            lambda: _buffered(served), lambda n: n == 0, what="every reservation given back",
            timeout=5, every=0.01,
        )  # fmt: skip
    finally:
        served.stop()


def test_oversized_direct_bodies_get_413_unread_and_chunked_bodies_still_arrive() -> None:
    served = Served(max_body_bytes=MIB)
    try:
        s = served.connect()
        s.sendall(_post_head(MIB + 1) + b"x" * 50_000)
        status, headers, body = _read_response(s.makefile("rb"))
        assert (status, headers["connection"]) == (413, "close")
        assert b"%d" % (MIB + 1) in body
        s.close()
        assert served.server.stats().buffered_bytes == 0

        # A chunked body (no declared length) goes through the parser, however big.
        payload = _pattern(150_000, 5)
        chunks = b"".join(
            b"%x\r\n%b\r\n" % (len(payload[i : i + 40_000]), payload[i : i + 40_000])
            for i in range(0, len(payload), 40_000)
        )
        s = served.connect()
        head = b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        _send_in_pieces(s, head + chunks + b"0\r\n\r\n", [30, 5000, 70_000], 0.002)
        assert _read_response(s.makefile("rb")) == (200, _echo_headers(len(payload)), payload)
        s.close()

        # Both a length and chunked framing: refused (the length is not trusted).
        s = served.connect()
        s.sendall(
            b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 20000\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
        )
        assert _read_response(s.makefile("rb"))[0] == 400
        s.close()
    finally:
        served.stop()


def test_a_request_says_when_its_first_byte_arrived() -> None:
    """``HttpRequest.arrived`` is the server's clock when the request's first data
    came, not when the rest of it did."""
    clock = FakeClock()
    served = Served(max_body_bytes=MIB, clock=clock)
    try:
        s = served.connect()
        body = b"y" * 50_000
        data = b"POST /arrived HTTP/1.1\r\nHost: x\r\nContent-Length: 50000\r\n\r\n" + body
        s.sendall(data[:20])
        _wait_arriving(served)
        clock.advance(0.3)
        s.sendall(data[20:])
        status, _, answer = _read_response(s.makefile("rb"))
        arrived, length = answer.split()
        assert (status, float(arrived), int(length)) == (200, 1000.0, len(body))
        s.close()
    finally:
        served.stop()
