"""The coordinator's HTTP server served from a thread for the edge's socket tests
(``test_edge_server.py``, ``test_edge_bodies.py``): handlers of every kind, a clock the
test steps, and the helpers that read answers and wait for the server's state."""

from __future__ import annotations

import asyncio
import select
import socket
import threading
import time
from typing import Any, BinaryIO

from kvatlas.coordinator.http.edge.messages import HttpRequest, HttpResponse
from kvatlas.coordinator.http.edge.routing import Router, always
from kvatlas.coordinator.http.edge.server import HttpServer
from support.wait import wait_until


class Boom(Exception):
    pass


def translate(exc: Exception) -> HttpResponse | None:
    if isinstance(exc, ValueError):
        return HttpResponse(400, b'{"error":"bad value"}')
    return None


def _echo(request: HttpRequest) -> HttpResponse:
    return HttpResponse(200, bytes(request.body), "application/octet-stream")


def _item(request: HttpRequest) -> HttpResponse:
    body = f"{request.path_params['name']}?{request.query.get('q', '')}".encode()
    return HttpResponse(200, body, "text/plain")


slow_started: list[float] = []
"""When each /slow request entered its handler (a test waits for one to be in flight)."""


async def _slow(request: HttpRequest) -> HttpResponse:
    slow_started.append(time.monotonic())
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
    """An `HttpServer` of the handlers above on a loopback socket, run in a thread;
    ``limits`` go to the server as they are (``clock=FakeClock()`` among them)."""

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
            translate,
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


def read_response(reader: BinaryIO) -> tuple[int, dict[str, str], bytes]:
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


def answered_within(s: socket.socket, seconds: float) -> bool:
    """Whether ``s`` has data or its end to read within ``seconds``."""
    return bool(select.select([s], [], [], seconds)[0])


def swept(clock: FakeClock) -> None:
    """Wait until a sweep has run to its end since now: two more reads of the clock (at
    most one of them is a connection's, when data arrives; the loop runs one at a time,
    so the first sweep is over when the next read happens)."""
    start = clock.reads
    wait_until(lambda: clock.reads, lambda n: n >= start + 2, what="a sweep", timeout=10)


def untouched(s: socket.socket, clock: FakeClock) -> bool:
    """A sweep ran at the standing clock, and ``s`` got nothing from it."""
    swept(clock)
    return not answered_within(s, 0.05)


def arriving(served: Served) -> bool:
    return any(c.arriving for c in list(served.server.connections))


def wait_arriving(served: Served) -> None:
    wait_until(
        lambda: arriving(served), what="a request arriving", timeout=5, every=0.005,
        ignore=(RuntimeError,),
    )  # fmt: skip


def open_connections(served: Served) -> int:
    return len(served.server.connections)


MIB = 1 << 20


def post_head(length: int) -> bytes:
    return b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % length


def buffered(served: Served) -> int:
    return served.server.stats().buffered_bytes


def pattern(n: int, seed: int) -> bytes:
    """``n`` bytes that differ at every position from a shifted copy (a misplaced chunk
    shows), and from one seed to the next."""
    return bytes((i * 7 + i // 251 + seed) & 0xFF for i in range(n))


def send_in_pieces(s: socket.socket, data: bytes, cuts: list[int], pause_s: float) -> None:
    """Send ``data`` cut at ``cuts`` (sorted offsets), each piece its own segment: the
    client does not coalesce (TCP_NODELAY) and pauses between pieces."""
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    at = 0
    for cut in [*cuts, len(data)]:
        if cut > at:
            s.sendall(data[at:cut])
            at = cut
            time.sleep(pause_s)


def echo_headers(length: int) -> dict[str, str]:
    return {"content-type": "application/octet-stream", "content-length": str(length)}
