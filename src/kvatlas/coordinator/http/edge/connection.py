"""One client connection of the HTTP edge: the asyncio shell around `edge.state.Connection`.

A thin loop: read (``get_buffer`` into where the connection says) -> `Connection` ->
route and dispatch each request -> `Connection.send` -> write, then do what the
connection's last event says. Owns the transport and the clock reads (one per received
chunk, one per answer, one per sweep), dispatch (the gate, the router, a plain handler on
the loop, a coroutine as a task, an offloaded one in the thread pool), write
back-pressure, and the connection cap's refusing set. Must not parse, decide keep-alive,
pipelining order, a close, a limit, a deadline or a linger (`edge.state` and
`edge.protocol` do), or know any service's routes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from typing import Any, Protocol, cast

from kvatlas.coordinator.http.edge.messages import HttpRequest, HttpResponse
from kvatlas.coordinator.http.edge.protocol import Ledger, Limits
from kvatlas.coordinator.http.edge.routing import Gate, Router, SyncHandler, not_routed
from kvatlas.coordinator.http.edge.state import (
    LINGER_S,
    NEED_DATA_ONLY,
    OPEN,
    Close,
    Connection,
    Continue,
    Event,
    Refused,
    Reset,
)

__all__ = ["LINGER_S", "MAX_REFUSING", "Host", "HttpProtocol"]

MAX_REFUSING = 64
"""Refused connections kept open at once to deliver their 503; beyond, reset at once.
Open descriptors thus never exceed the cap plus this."""


class Host(Protocol):
    """What a connection uses of its server (`HttpServer`)."""

    limits: Limits
    ledger: Ledger
    clock: Callable[[], float]
    router: Router
    gate: Gate | None
    executor: Executor
    tasks: set[asyncio.Future[Any]]
    connections: set[HttpProtocol]
    refusing: set[HttpProtocol]
    read_view: memoryview
    head_view: memoryview
    max_connections: int
    stopping: bool

    def translate(self, exc: Exception, request: HttpRequest) -> HttpResponse: ...


class HttpProtocol(asyncio.BufferedProtocol):
    """One client connection (see the module docstring; the state is `Connection`'s)."""

    def __init__(self, server: Host) -> None:
        self._server = server
        self._conn = Connection(
            server.limits,
            server.ledger,
            read_view=server.read_view,
            head_view=server.head_view,
            now=server.clock(),
        )
        self._transport: asyncio.Transport | None = None
        self._write_paused = False
        self._read_paused = False

    # ---- asyncio.Protocol ------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self._transport = t = cast(asyncio.Transport, transport)
        server = self._server
        if len(server.connections) < server.max_connections:
            server.connections.add(self)
        elif len(server.refusing) >= MAX_REFUSING:
            self._conn.connection_lost()
            t.abort()  # a flood: descriptors matter more than the courtesy
        else:
            server.refusing.add(self)
            refusal = server.ledger.over_connection_cap(server.max_connections)
            self._act(self._conn.refuse(refusal, server.clock()))

    def connection_lost(self, exc: Exception | None) -> None:
        self._conn.connection_lost()
        self._server.connections.discard(self)
        self._server.refusing.discard(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._conn.buffer()

    def buffer_updated(self, nbytes: int) -> None:
        events = self._conn.buffer_filled(nbytes, self._server.clock())
        if events is not NEED_DATA_ONLY:  # most reads of a request's bytes: nothing to do
            self._act(events)

    def eof_received(self) -> bool:
        """The client will send no more: close now, or once what it asked is answered
        (True keeps the transport open for those answers)."""
        self._act(self._conn.receive_eof(self._server.clock()))
        return self._conn.state is OPEN

    def pause_writing(self) -> None:
        self._write_paused = True
        self._update_reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        self._update_reading()

    # ---- the loop --------------------------------------------------------------------

    def _act(self, events: tuple[Event, ...]) -> None:
        """Do what the connection's events say (the first asks, see `edge.state.Event`);
        answer requests in turn until one must wait (a task or the pool) or the
        connection wants bytes."""
        conn = self._conn
        while events:
            event = events[0]
            if type(event) is HttpRequest:
                response = self._dispatch(event)
                if response is None:
                    break  # answered when its work is done (`_wait_for`)
                server = self._server
                chunks = conn.send(response, server.clock(), close=server.stopping)
                t = self._transport
                if t is not None and chunks:
                    if len(chunks) == 1:
                        t.write(chunks[0])
                    else:
                        t.writelines(chunks)
                events = conn.next_events()
                if events is NEED_DATA_ONLY:
                    break  # the usual end of an answer
                continue
            t = self._transport
            if t is not None:
                if type(event) is Continue:
                    t.write(event.data)
                elif type(event) is Refused:
                    self._half_close(t, event.data)
                elif type(event) is Close:
                    t.close()
                elif type(event) is Reset:
                    t.abort()
            break
        self._update_reading()

    def _dispatch(self, request: HttpRequest) -> HttpResponse | None:
        """The answer of a handler run on the loop, or None when its work was handed to
        a task or the pool (`_wait_for` answers then)."""
        server = self._server
        gate = server.gate
        refused = gate(request) if gate is not None else None
        if refused is not None:
            return refused
        route, params, allowed = server.router.match(request.method, request.path)
        if route is None:
            return not_routed(request, allowed)
        request.path_params = params
        if route.is_async:
            work = route.handler(request)
            self._wait_for(work, request)  # type: ignore[arg-type]
            return None
        handler: SyncHandler = route.handler  # type: ignore[assignment]
        if route.offload is not None and route.offload(request):
            loop = asyncio.get_running_loop()
            self._wait_for(loop.run_in_executor(server.executor, handler, request), request)
            return None
        try:
            return handler(request)
        except Exception as exc:
            return server.translate(exc, request)

    def _wait_for(self, work: Awaitable[HttpResponse], request: HttpRequest) -> None:
        """Answer once ``work`` is done, whether or not the client is still there (the
        connection holds the body's budget until then: the handler holds the body)."""
        task = asyncio.ensure_future(work)
        server = self._server
        server.tasks.add(task)

        def done(t: asyncio.Future[HttpResponse]) -> None:
            server.tasks.discard(t)
            conn, now = self._conn, server.clock()
            exc = None if t.cancelled() else t.exception()
            if t.cancelled():
                conn.abandon(now)
            elif exc is None:
                self._write(conn.send(t.result(), now, close=server.stopping))
            elif isinstance(exc, Exception):
                response = server.translate(exc, request)
                self._write(conn.send(response, now, close=server.stopping))
            else:
                conn.abandon(now)  # KeyboardInterrupt, SystemExit: no answer
            self._act(conn.next_events())

        task.add_done_callback(done)

    # ---- the transport ---------------------------------------------------------------

    def _write(self, chunks: list[bytes]) -> None:
        t = self._transport
        if t is None or not chunks:
            return
        if len(chunks) == 1:
            t.write(chunks[0])
        else:
            t.writelines(chunks)

    def _half_close(self, t: asyncio.Transport, answer: bytes) -> None:
        """Send the last answer and close our side, then read and drop what the client
        still sends until it closes or the linger ends: closing with its bytes unread
        would reset the connection, and the client could lose the answer."""
        t.write(answer)
        if t.can_write_eof():
            t.write_eof()
        else:
            t.close()
        if self._read_paused:
            t.resume_reading()
            self._read_paused = False

    def _update_reading(self) -> None:
        """Stop reading while the client does not read, or while requests queue up."""
        t = self._transport
        if t is None or self._conn.state is not OPEN:
            return
        want_pause = self._write_paused or self._conn.backlogged
        if want_pause and not self._read_paused:
            t.pause_reading()
            self._read_paused = True
        elif not want_pause and self._read_paused:
            t.resume_reading()
            self._read_paused = False

    # ---- for the server --------------------------------------------------------------

    @property
    def idle(self) -> bool:
        """No request being answered or waiting to be (see `Connection.idle`)."""
        return self._conn.idle

    @property
    def arriving(self) -> bool:
        """A request has begun to arrive and is not whole yet."""
        return self._conn.arriving

    def close(self) -> None:
        """Close now (shutdown), a lingering connection too."""
        events = self._conn.close(self._server.clock())
        if events:
            self._act(events)
        elif self._transport is not None:
            self._transport.close()

    def sweep(self, now: float) -> None:
        """Enforce the deadlines at ``now`` (`Connection.tick`)."""
        self._act(self._conn.tick(now))
