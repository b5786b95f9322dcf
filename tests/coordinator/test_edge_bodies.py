"""Request bodies through the coordinator's HTTP server over real loopback sockets: the
buffered-bytes budget (503 with Retry-After, given back on answer and on close), a body
that arrived fast and then stalls (408 on the server's clock), bodies of
DIRECT_BODY_BYTES and more read straight into their own buffer however their bytes are
cut, Content-Length mismatches, and when a request's first byte arrived."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvatlas.coordinator.http.edge.protocol import (
    DIRECT_BODY_BYTES,
    HEAD_READ_BYTES,
    UNRESERVED_BODY_BYTES,
)
from kvatlas.coordinator.http.edge.routing import Router
from kvatlas.coordinator.http.edge.server import HttpServer
from support.wait import wait_until

from .edge_served import (
    MIB,
    FakeClock,
    Served,
    answered_within,
    buffered,
    echo_headers,
    pattern,
    post_head,
    read_response,
    send_in_pieces,
    translate,
    wait_arriving,
)


def test_bodies_reserve_the_buffered_bytes_budget_and_give_it_back() -> None:
    """Two stalled 1 MiB bodies hold a 2 MiB budget: a third large body gets 503 with
    Retry-After before any of it is read, a small one is still served, and a close gives
    the budget back to the next large body."""
    served = Served(max_body_bytes=MIB, max_buffered_bytes=2 * MIB)
    try:
        stalled = []
        for _ in range(2):
            s = served.connect()
            s.sendall(post_head(MIB) + b"x" * 100_000)
            stalled.append(s)
        wait_until(
            lambda: buffered(served), lambda n: n == 2 * MIB, what="two bodies reserved",
            timeout=5, every=0.01,
        )  # fmt: skip
        third = served.connect()
        third.sendall(post_head(UNRESERVED_BODY_BYTES + 1))
        status, headers, body = read_response(third.makefile("rb"))
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
            lambda: buffered(served), lambda n: n == MIB, what="the closed body given back",
            timeout=5, every=0.01,
        )  # fmt: skip
        with httpx.Client(base_url=f"http://127.0.0.1:{served.port}") as c:
            big = b"b" * MIB
            r = c.post("/echo", content=big)
            assert (r.status_code, r.content) == (200, big)
        assert buffered(served) == MIB  # the answered body gave its reservation back
        stalled.pop().close()
        wait_until(
            lambda: buffered(served), lambda n: n == 0, what="every reservation given back",
            timeout=5, every=0.01,
        )  # fmt: skip
        assert served.server.stats().refused["buffered_bytes"] == 2
    finally:
        served.stop()


def test_the_budget_must_hold_the_largest_body() -> None:
    with pytest.raises(ValueError, match="max_buffered_bytes"):
        HttpServer(Router(), translate, max_body_bytes=MIB, max_buffered_bytes=MIB - 1)


def test_a_body_that_arrived_fast_and_then_stalls_gets_408() -> None:
    """The minimum rate holds over every window: 900 KB at once buy no 900 s of silence.
    The clock steps a window at a time until the body has stopped arriving."""
    clock = FakeClock()
    served = Served(max_body_bytes=MIB, body_timeout=0.3, min_body_rate=1000, clock=clock)
    try:
        s = served.connect()
        s.sendall(post_head(MIB) + b"x" * 900_000)
        for _ in range(40):
            clock.advance(0.31)
            if answered_within(s, 0.4):
                break
        status, _, body = read_response(s.makefile("rb"))
        assert status == 408
        assert b"1000 bytes/s" in body
        s.close()
        wait_until(
            lambda: buffered(served), lambda n: n == 0, what="the cut body given back",
            timeout=5, every=0.01,
        )  # fmt: skip
        assert served.server.stats().refused["body_rate"] == 1
    finally:
        served.stop()


# ---- bodies read straight into their own buffer (DIRECT_BODY_BYTES and up) ----------


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
        body = pattern(300_000, 1)
        data = post_head(len(body)) + body
        cuts = [10, 60, 61, 62, 100, 5000, 20_000, 20_001, 80_000, 140_000, 299_000]
        s = served.connect()
        send_in_pieces(s, data, cuts, 0.002)
        f = s.makefile("rb")
        assert read_response(f) == (200, echo_headers(len(body)), body)
        s.sendall(post_head(5) + b"after")
        assert read_response(f)[2] == b"after"
        s.close()
        wait_until(
            lambda: buffered(served), lambda n: n == 0, what="the reservation given back",
            timeout=5, every=0.01,
        )  # fmt: skip
    finally:
        served.stop()


@st.composite
def _pipelined(draw: st.DrawFn) -> tuple[list[bytes], list[int]]:
    """A few requests' bodies (small, around DIRECT_BODY_BYTES, big) and where to cut
    their pipelined bytes into segments."""
    sizes = st.sampled_from(
        [0, 3, DIRECT_BODY_BYTES - 1, DIRECT_BODY_BYTES, DIRECT_BODY_BYTES + 1, 70_000, 200_000]
    )
    bodies = [pattern(n, i) for i, n in enumerate(draw(st.lists(sizes, min_size=1, max_size=4)))]
    total = sum(len(post_head(len(b))) + len(b) for b in bodies)
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
    data = b"".join(post_head(len(b)) + b for b in bodies)
    s = served_big.connect()
    try:
        send_in_pieces(s, data, cuts, 0.0005)
        f = s.makefile("rb")
        for body in bodies:
            assert read_response(f) == (200, echo_headers(len(body)), body)
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
        s.sendall(post_head(200_000) + b"x" * 100_000)
        s.shutdown(socket.SHUT_WR)
        assert s.makefile("rb").read() == b""  # closed, no answer
        s.close()
        wait_until(
            lambda: buffered(served), lambda n: n == 0, what="the short body given back",
            timeout=5, every=0.01,
        )  # fmt: skip

        s = served.connect()
        s.sendall(post_head(200_000) + b"x" * 100_000)
        status, _, body = read_response(s.makefile("rb"))
        assert status == 408 and b"bytes/s" in body
        s.close()

        s = served.connect()
        body = pattern(DIRECT_BODY_BYTES * 2, 3)
        s.sendall(post_head(len(body)) + body + b"garbage that is no request\r\n\r\n")
        f = s.makefile("rb")
        assert read_response(f) == (200, echo_headers(len(body)), body)
        status, headers, _ = read_response(f)
        assert status == 400 and headers["connection"] == "close"
        assert f.read() == b""
        s.close()
        wait_until(
            lambda: buffered(served), lambda n: n == 0, what="every reservation given back",
            timeout=5, every=0.01,
        )  # fmt: skip
    finally:
        served.stop()


def test_oversized_direct_bodies_get_413_unread_and_chunked_bodies_still_arrive() -> None:
    served = Served(max_body_bytes=MIB)
    try:
        s = served.connect()
        s.sendall(post_head(MIB + 1) + b"x" * 50_000)
        status, headers, body = read_response(s.makefile("rb"))
        assert (status, headers["connection"]) == (413, "close")
        assert b"%d" % (MIB + 1) in body
        s.close()
        assert served.server.stats().buffered_bytes == 0

        # A chunked body (no declared length) goes through the parser, however big.
        payload = pattern(150_000, 5)
        chunks = b"".join(
            b"%x\r\n%b\r\n" % (len(payload[i : i + 40_000]), payload[i : i + 40_000])
            for i in range(0, len(payload), 40_000)
        )
        s = served.connect()
        head = b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        send_in_pieces(s, head + chunks + b"0\r\n\r\n", [30, 5000, 70_000], 0.002)
        assert read_response(s.makefile("rb")) == (200, echo_headers(len(payload)), payload)
        s.close()

        # Both a length and chunked framing: refused (the length is not trusted).
        s = served.connect()
        s.sendall(
            b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 20000\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
        )
        assert read_response(s.makefile("rb"))[0] == 400
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
        wait_arriving(served)
        clock.advance(0.3)
        s.sendall(data[20:])
        status, _, answer = read_response(s.makefile("rb"))
        arrived, length = answer.split()
        assert (status, float(arrived), int(length)) == (200, 1000.0, len(body))
        s.close()
    finally:
        served.stop()
