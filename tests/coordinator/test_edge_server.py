"""The coordinator's HTTP/1.1 server on its own, over real loopback sockets: routing,
keep-alive and pipelining order (a refusal after the answers owed before it), limits,
`Expect: 100-continue`, coroutine and thread-pool handlers, errors, idle timeouts, read
deadlines (408), the connection cap (503), the linger of a last answer and shutdown.
Deadlines run on a `FakeClock` the test steps: what is checked here is that the shell
reads and sweeps by the injected clock; where each deadline falls to the microsecond is
``test_edge_protocol.py``'s, and the connection's state machine without sockets is
``test_edge_state.py``'s. Bodies (the buffered-bytes budget, bodies read straight into
their buffer): ``test_edge_bodies.py``."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvatlas.coordinator.http.edge.state import LINGER_S
from support.wait import wait_until

from .edge_served import (
    FakeClock,
    Served,
    open_connections,
    read_response,
    slow_started,
    swept,
    untouched,
    wait_arriving,
)


@pytest.fixture
def served() -> Iterator[Served]:
    s = Served()
    yield s
    s.stop()


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
    bodies = [read_response(f)[2] for _ in reqs]
    assert bodies[0] == b"one"
    assert bodies[1] == b"slow"
    assert bodies[2].startswith(b"http-offload")
    assert bodies[3] == b"four"
    s.close()


def test_a_bad_request_is_refused_after_the_answers_owed_before_it(served: Served) -> None:
    """Pipelined behind a coroutine and a pool handler, a malformed request's 400 comes
    after their answers; and nothing after a ``Connection: close`` request is served."""
    s = served.connect()
    s.sendall(
        b"GET /slow?s=0.1 HTTP/1.1\r\nHost: x\r\n\r\nGET /thread HTTP/1.1\r\nHost: x\r\n\r\n"
        b"NOT HTTP AT ALL\r\n\r\n"
    )
    f = s.makefile("rb")
    assert read_response(f)[2] == b"slow"
    assert read_response(f)[2].startswith(b"http-offload")
    status, headers, _ = read_response(f)
    assert (status, headers["connection"]) == (400, "close")
    assert f.read() == b""
    s.close()
    s = served.connect()
    s.sendall(
        b"GET /slow?s=0.05 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        b"GET /items/never HTTP/1.1\r\nHost: x\r\n\r\n"
    )
    f = s.makefile("rb")
    status, headers, body = read_response(f)
    assert (status, headers["connection"], body) == (200, "close", b"slow")
    assert f.read() == b""
    s.close()


def test_chunked_body_and_expect_continue(served: Served) -> None:
    s = served.connect()
    s.sendall(
        b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
    )
    f = s.makefile("rb")
    assert read_response(f)[::2] == (200, b"abcde")
    s.sendall(
        b"POST /echo HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n"
    )
    assert f.readline().startswith(b"HTTP/1.1 100")
    assert f.readline() == b"\r\n"
    s.sendall(b"ok")
    assert read_response(f)[::2] == (200, b"ok")
    s.close()


def test_limits_answer_and_close(served: Served) -> None:
    s = served.connect()
    s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n")
    f = s.makefile("rb")
    status, headers, body = read_response(f)
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
        assert read_response(s.makefile("rb"))[0] == status
        s.close()


def test_malformed_request_gets_400(served: Served) -> None:
    s = served.connect()
    s.sendall(b"NOT HTTP AT ALL\r\n\r\n")
    status, _, body = read_response(s.makefile("rb"))
    assert status == 400
    assert b"malformed" in body
    s.close()


def test_connection_close_and_http10(served: Served) -> None:
    s = served.connect()
    s.sendall(b"GET /items/z HTTP/1.0\r\n\r\n")
    f = s.makefile("rb")
    status, headers, body = read_response(f)
    assert (status, body, headers["connection"]) == (200, b"z?", "close")
    assert f.read() == b""
    s.close()


def test_idle_connections_are_closed_by_the_servers_clock() -> None:
    clock = FakeClock()
    served = Served(idle_timeout=0.3, clock=clock)
    try:
        s = served.connect()
        s.sendall(b"GET /items/a HTTP/1.1\r\nHost: x\r\n\r\n")
        f = s.makefile("rb")
        assert read_response(f)[0] == 200
        assert untouched(s, clock)  # the clock stands still: open
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
        wait_arriving(served)
        assert untouched(s, clock)
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
    assert read_response(f)[2] == b"slow"
    assert read_response(f)[2].startswith(b"http-offload")
    assert f.read() == b""
    s.close()


def test_stop_lets_a_busy_request_finish() -> None:
    served = Served(shutdown_grace=5.0)
    s = served.connect()
    started = len(slow_started)
    s.sendall(b"GET /slow?s=0.3 HTTP/1.1\r\nHost: x\r\n\r\n")
    wait_until(lambda: len(slow_started), lambda n: n > started, what="the request in its handler")
    idle = served.connect()
    stopper = threading.Thread(target=served.stop)
    stopper.start()
    status, headers, body = read_response(s.makefile("rb"))
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


def test_headers_late_get_408_by_the_servers_clock() -> None:
    """Bytes of the headers keep coming, yet past the header timeout of the request's
    first byte on the server's clock, the request gets 408 and the connection closes."""
    clock = FakeClock()
    served = Served(header_timeout=0.5, clock=clock)
    try:
        s = served.connect()
        s.sendall(b"GET /items/a HTTP/1.1\r\n")
        wait_arriving(served)
        s.sendall(b"X-Slow: zzz")
        assert untouched(s, clock)  # the clock stands still: no deadline yet
        clock.advance(0.51)
        s.sendall(b"zzz")
        status, headers, body = read_response(s.makefile("rb"))
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
        wait_arriving(served)
        assert untouched(s, clock)
        clock.advance(0.31)  # 100 bytes in a window of 0.31 s: below 1000 bytes/s
        status, _, body = read_response(s.makefile("rb"))
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
            assert read_response(s.makefile("rb"))[0] == 200
        with httpx.Client(base_url=f"http://127.0.0.1:{served.port}") as c:
            r = c.get("/items/b")
        assert r.status_code == 503
        assert r.headers["retry-after"] == "1"
        assert r.headers["connection"] == "close"
        assert "too many open connections (the limit is 2)" in r.json()["error"]
        silent = served.connect()  # a client that sends nothing still gets the answer
        f = silent.makefile("rb")
        assert read_response(f)[0] == 503
        assert f.read() == b""
        silent.close()
        held.pop().close()
        wait_until(
            lambda: open_connections(served), lambda n: n < 2, what="the closed one let go",
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
            lambda: open_connections(served), lambda n: n == 1, what="the connection open",
            timeout=5, every=0.01,
        )  # fmt: skip
        swept(clock)  # at a standing clock: still lingering
        assert open_connections(served) == 1
        clock.advance(LINGER_S + 0.01)
        wait_until(
            lambda: open_connections(served), lambda n: n == 0, what="the connection reset",
            timeout=5, every=0.01,
        )  # fmt: skip
        s.close()
    finally:
        served.stop()
