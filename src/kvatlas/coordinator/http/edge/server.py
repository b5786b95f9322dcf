"""kvatlas' HTTP/1.1 server: uvloop and httptools, without an ASGI layer.

Owns the listening socket and the connections' shared state: the event loop, the cap on
open connections (over it, a 503 with ``Retry-After``), the budget of request bytes
buffered at once across all connections (`Ledger`), the thread pool of offloaded
handlers, the one sweep that enforces every connection's deadlines on the server's clock,
the heap trim after big bodies (`host.allocator`), graceful shutdown, and `stats`.
A connection is `edge.connection.HttpProtocol` (the asyncio shell) around
`edge.state.Connection` (keep-alive, pipelining, close and linger, pure) around
`edge.protocol.RequestReader` (the parser, limits and deadlines, pure). Must not know
any service's routes, state or error tree: the service hands it a `Router`, a gate and
an error translator.

Why not uvicorn and Starlette: the coordinator's hot requests (an events batch, a
lookup) do little work each, so the per-request cost of the server matters. Here a
handler is a plain function called on the loop as soon as its request is complete; the
few that must wait (a membership change through Kafka) are coroutines, and the few that
are heavy (a big body, a scan) are sent to a thread pool by the route's ``offload``
predicate. What that saves against uvicorn's ASGI cycle (a task, a scope dict,
receive/send coroutines per request) is measured by ``python -m bench.http_edge_bench``
(docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import uvloop

from kvatlas.coordinator.host.allocator import TRIM_AFTER_BYTES, trim_heap
from kvatlas.coordinator.http.edge.connection import MAX_REFUSING, HttpProtocol
from kvatlas.coordinator.http.edge.messages import HttpRequest, HttpResponse, error_body
from kvatlas.coordinator.http.edge.protocol import (
    HEAD_READ_BYTES,
    READ_BUFFER_BYTES,
    Ledger,
    Limits,
)
from kvatlas.coordinator.http.edge.routing import ErrorTranslator, Gate, Router

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 4096
"""The default cap on open connections when the open-file limit allows it."""
FD_HEADROOM = 256
"""Descriptors left to everything else a process opens (files, threads' pipes, clients)."""


@dataclass(slots=True, frozen=True)
class EdgeStats:
    """A sample of the server's edge, for metrics."""

    connections: int
    buffered_bytes: int
    max_buffered_bytes: int
    refused: dict[str, int]


def default_max_connections() -> int:
    """MAX_CONNECTIONS, or fewer when RLIMIT_NOFILE leaves no room for them plus
    FD_HEADROOM and MAX_REFUSING (a quarter of the limit at the least)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS
    return max(1, soft // 4, min(MAX_CONNECTIONS, soft - FD_HEADROOM - MAX_REFUSING))


class HttpServer:
    """Serves a router on a bound socket, in the calling thread, until `stop()`.

    ``header_timeout``: seconds from a request's first byte to the end of its headers.
    ``body_timeout`` and ``min_body_rate``: in every window of ``body_timeout`` seconds
    from the end of its headers on, a body must arrive at ``min_body_rate`` bytes/s (a
    body that arrived fast and then stalls is cut within two windows). ``idle_timeout``:
    seconds a connection may stay silent between requests. ``max_connections``: open
    connections served at once (default: ``default_max_connections()``); more are
    answered 503. ``max_buffered_bytes``: request body bytes held at once across all
    connections (default: 4 x ``max_body_bytes``): a body over UNRESERVED_BODY_BYTES
    reserves its declared length (a chunked one, what has arrived) before it is read and
    holds it until its request is answered; one that does not fit is answered 503 with
    ``Retry-After``. Why a refusal rather than pausing the connection until the budget
    frees: a paused client learns nothing and still holds a connection, a refused one is
    told to retry (the cache server's event sink does), and the budget needs no queue.
    ``clock``: what every deadline, the linger and ``HttpRequest.arrived`` are read from
    (tests step a fake one); the sweep still runs every second or less of real time, and
    the shutdown grace is real time.
    """

    def __init__(
        self,
        router: Router,
        translate: ErrorTranslator,
        *,
        max_body_bytes: int,
        gate: Gate | None = None,
        idle_timeout: float = 75.0,
        header_timeout: float = 10.0,
        body_timeout: float = 10.0,
        min_body_rate: float = 16 * 1024,
        max_connections: int | None = None,
        max_buffered_bytes: int | None = None,
        shutdown_grace: float = 5.0,
        offload_threads: int = 4,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.router = router
        self._translate = translate
        self.gate = gate
        self.limits = Limits(
            max_body_bytes=max_body_bytes,
            header_timeout=header_timeout,
            body_timeout=body_timeout,
            min_body_rate=min_body_rate,
            idle_timeout=idle_timeout,
        )
        self.clock = clock
        self.max_connections = (
            default_max_connections() if max_connections is None else max_connections
        )
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")
        max_buffered = 4 * max_body_bytes if max_buffered_bytes is None else max_buffered_bytes
        if max_buffered < max_body_bytes:
            raise ValueError(
                f"max_buffered_bytes ({max_buffered}) must be >= max_body_bytes"
                f" ({max_body_bytes}), or the largest body could never be taken"
            )
        self.ledger = Ledger(max_buffered)
        """The buffered-bytes budget and the refusals by cause (changed on the loop only)."""
        self.shutdown_grace = shutdown_grace
        self.executor: Executor = ThreadPoolExecutor(
            offload_threads, thread_name_prefix="http-offload"
        )
        self.connections: set[HttpProtocol] = set()
        """Connections being served (at most max_connections)."""
        self.refusing: set[HttpProtocol] = set()
        """Connections over the cap whose 503 is on its way (at most MAX_REFUSING)."""
        self.tasks: set[asyncio.Future[Any]] = set()
        self.read_view = memoryview(bytearray(READ_BUFFER_BYTES))
        self.head_view = self.read_view[:HEAD_READ_BYTES]
        """Every connection's reads outside a direct body (see ``RequestReader``): the
        loop is one thread, and a read is parsed before the next is taken."""
        self.stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._stop_asked = threading.Event()
        self.serving = threading.Event()
        """Set once the socket is being served."""
        self.closers: list[Callable[[], Awaitable[None]]] = []
        """Awaited on the loop once serving stopped (clients of the handlers' own)."""

    def stats(self) -> EdgeStats:
        """What the edge holds and has refused now; safe from any thread (a snapshot of
        values the loop changes, each read once)."""
        return EdgeStats(
            connections=len(self.connections),
            buffered_bytes=self.ledger.buffered,
            max_buffered_bytes=self.ledger.max_buffered_bytes,
            refused=dict(self.ledger.refused),
        )

    def translate(self, exc: Exception, request: HttpRequest) -> HttpResponse:
        response = self._translate(exc)
        if response is not None:
            return response
        log.exception("Unexpected error in %s %s", request.method, request.path, exc_info=exc)
        return HttpResponse(500, error_body(f"internal error: {type(exc).__name__}"))

    def run(self, sock: Any) -> None:
        """Serve on ``sock`` (bound and listening) until stopped; blocking."""
        uvloop.run(self._serve(sock))

    def stop(self) -> None:
        """Ask the server to stop; safe from any thread and from a signal handler."""
        self._stop_asked.set()
        loop, event = self._loop, self._stop
        if loop is not None and event is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed in between
                loop.call_soon_threadsafe(event.set)

    async def _serve(self, sock: Any) -> None:
        loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._loop = loop
        if self._stop_asked.is_set():
            self._stop.set()
        server = await loop.create_server(lambda: HttpProtocol(self), sock=sock, backlog=2048)
        sweeper = asyncio.ensure_future(self._sweep())
        self.serving.set()
        try:
            await self._stop.wait()
        finally:
            self.stopping = True
            server.close()
            sweeper.cancel()
            await self._drain()
            for close in self.closers:
                try:
                    await close()
                except Exception:
                    log.exception("Closing %r failed", close)
            self.executor.shutdown(wait=False, cancel_futures=True)
            self._loop = None

    async def _sweep(self) -> None:
        """The one timer of the server: deadlines are late by at most one period."""
        limits = self.limits
        period = min(1.0, limits.idle_timeout, limits.header_timeout, limits.body_timeout)
        while True:
            await asyncio.sleep(period)
            now = self.clock()
            for conn in list(self.connections):
                conn.sweep(now)
            for conn in list(self.refusing):
                conn.sweep(now)
            if self.ledger.given_back >= TRIM_AFTER_BYTES:
                self.ledger.given_back = 0
                trim_heap()

    async def _drain(self) -> None:
        """Close idle connections now; give busy ones the grace period to answer."""
        deadline = time.monotonic() + self.shutdown_grace
        while True:
            for conn in list(self.connections):
                if conn.idle:
                    conn.close()
            if not self.connections or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.02)
        for conn in list(self.connections) + list(self.refusing):
            conn.close()
        for task in list(self.tasks):
            task.cancel()
        await asyncio.sleep(0)
