"""One client connection of the HTTP edge: the asyncio shell around `RequestReader`.

Owns the transport and what happens in time: reads (``get_buffer`` into where the reader
says), the clock reads (one per received chunk, one per answer), keep-alive and
pipelining (requests answered one at a time, in order), dispatch (the gate, the router, a
plain handler on the loop, a coroutine as a task, an offloaded one in the thread pool),
write back-pressure, ``Expect: 100-continue``, the refusals' answers and the linger that
lets them reach the client, and the sweep's verdicts (`sweep`). Must not parse, decide a
limit or a deadline (`edge.protocol` does), or know any service's routes.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from typing import Any, Protocol, cast

from kvatlas.coordinator.edge.messages import HttpRequest, HttpResponse, response_head
from kvatlas.coordinator.edge.protocol import Ledger, Limits, Refusal, RequestReader
from kvatlas.coordinator.edge.routing import Gate, Router, SyncHandler, not_routed

MAX_REFUSING = 64
"""Refused connections kept open at once to deliver their 503; beyond, reset at once.
Open descriptors thus never exceed the cap plus this."""
LINGER_S = 1.0
"""How long a closed connection may take to flush its answer (a client that does not
read) and a refused one may keep sending, before it is reset."""


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
    """One client connection (see the module docstring; the reading is `RequestReader`'s)."""

    def __init__(self, server: Host) -> None:
        self._server = server
        now = server.clock()
        self._reader = RequestReader(
            server.limits,
            server.ledger,
            self,
            read_view=server.read_view,
            head_view=server.head_view,
            now=now,
        )
        self._transport: asyncio.Transport | None = None
        # A complete request, whether the connection stays open after it, and the bytes
        # of the buffered-bytes budget its body holds until it is answered.
        self._queue: deque[tuple[HttpRequest, bool, int]] = deque()
        self._busy = False
        self._closing = False
        self._write_paused = False
        self._read_paused = False
        self._eof = False
        self.closed_at = 0.0  # when closed: its answer may still be flushing

    # ---- asyncio.Protocol ------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self._transport = cast(asyncio.Transport, transport)
        server = self._server
        if len(server.connections) < server.max_connections:
            server.connections.add(self)
        else:
            self._refuse_connection()

    def connection_lost(self, exc: Exception | None) -> None:
        self._closing = True
        self._drop_buffered()
        # The parser refers back to the reader, the reader to this protocol: without
        # these references dropped here, a stalled body would stay in memory until the
        # cycle collector happens to run.
        self._server.connections.discard(self)
        self._server.refusing.discard(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._closing:
            return self._server.head_view  # what arrives now is dropped
        return self._reader.buffer()

    def buffer_updated(self, nbytes: int) -> None:
        now = self._server.clock()
        if self._closing:
            return
        refusal = self._reader.received(nbytes, now)
        if refusal is not None:
            self._refuse(refusal)

    def eof_received(self) -> bool:
        """The client will send no more: close now, or once what it asked is answered."""
        self._eof = True
        # True keeps the transport open for the answers; a lingering close is over.
        return not self._closing and not self.idle

    def pause_writing(self) -> None:
        self._write_paused = True
        self._update_reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        self._update_reading()

    # ---- the reader's sink -----------------------------------------------------------

    def send_continue(self) -> None:
        if self._transport is not None:
            self._transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def request_ready(self, request: HttpRequest, keep_alive: bool, reserved: int) -> None:
        """Queue it, and answer it unless one is in progress."""
        self._queue.append((request, keep_alive, reserved))
        if not self._busy:
            self._run_queue()
        else:
            self._update_reading()

    # ---- dispatch --------------------------------------------------------------------

    def _run_queue(self) -> None:
        """Answer queued requests in order until one must wait (a task or the pool)."""
        server = self._server
        while self._queue and not self._closing:
            request, keep_alive, reserved = self._queue.popleft()
            gate = server.gate
            refused = gate(request) if gate is not None else None
            if refused is not None:
                server.ledger.give_back(reserved)
                self._respond(refused, keep_alive, request.method)
                continue
            route, params, allowed = server.router.match(request.method, request.path)
            if route is None:
                server.ledger.give_back(reserved)
                self._respond(not_routed(request, allowed), keep_alive, request.method)
                continue
            request.path_params = params
            if route.is_async:
                work = route.handler(request)
                self._wait_for(work, request, keep_alive, reserved)  # type: ignore[arg-type]
                return
            handler: SyncHandler = route.handler  # type: ignore[assignment]
            if route.offload is not None and route.offload(request):
                loop = asyncio.get_running_loop()
                fut = loop.run_in_executor(server.executor, handler, request)
                self._wait_for(fut, request, keep_alive, reserved)
                return
            try:
                response = handler(request)
            except Exception as exc:
                response = server.translate(exc, request)
            server.ledger.give_back(reserved)
            self._respond(response, keep_alive, request.method)
        if self._eof and self.idle:
            self._abort()
            return
        self._update_reading()

    def _wait_for(
        self, work: Awaitable[HttpResponse], request: HttpRequest, keep: bool, reserved: int
    ) -> None:
        """Answer once ``work`` is done; the body's ``reserved`` bytes are held till then
        (the handler holds the body), whether or not the client is still there."""
        self._busy = True
        self._update_reading()
        task = asyncio.ensure_future(work)
        server = self._server
        server.tasks.add(task)

        def done(t: asyncio.Future[HttpResponse]) -> None:
            server.tasks.discard(t)
            server.ledger.give_back(reserved)
            self._busy = False
            if t.cancelled():
                self._abort()
                return
            exc = t.exception()
            if exc is None:
                response = t.result()
            elif isinstance(exc, Exception):
                response = server.translate(exc, request)
            else:
                self._abort()
                return
            self._respond(response, keep, request.method)
            self._run_queue()

        task.add_done_callback(done)

    def _respond(self, response: HttpResponse, keep_alive: bool, method: str) -> None:
        t = self._transport
        if t is None or self._closing:
            return
        close = not keep_alive or self._server.stopping
        head = response_head(response, close)
        if method == "HEAD" or not response.body:
            t.write(head)
        else:
            t.writelines((head, response.body))
        self._reader.touch(self._server.clock())
        if close:
            self._abort()

    def _refuse(self, refusal: Refusal) -> None:
        """Answer a request that cannot be taken, then close: the stream is lost."""
        self._drop_buffered()
        if self._closing:
            return
        self._linger(refusal.answer())

    def _refuse_connection(self) -> None:
        """Over the cap: answer 503 at once and close."""
        server, t = self._server, self._transport
        assert t is not None
        if len(server.refusing) >= MAX_REFUSING:
            self._closing = True
            t.abort()  # a flood: descriptors matter more than the courtesy
            return
        server.refusing.add(self)
        self._linger(server.ledger.over_connection_cap(server.max_connections).answer())

    def _drop_buffered(self) -> None:
        """Forget the arriving and the queued requests and give back what they held."""
        self._reader.drop()
        held = sum(r for _, _, r in self._queue)
        self._queue.clear()
        self._server.ledger.give_back(held)

    def _linger(self, answer: bytes) -> None:
        """Send the last answer and close our side, then read and drop what the client
        still sends until it closes or LINGER_S passes: closing with its bytes unread
        would reset the connection, and the client could lose the answer."""
        t = self._transport
        self._closing = True
        self.closed_at = self._server.clock()
        if t is None:
            return
        t.write(answer)
        if t.can_write_eof():
            t.write_eof()
        else:
            t.close()

    def _abort(self) -> None:
        if not self._closing:
            self.closed_at = self._server.clock()
        self._closing = True
        if self._transport is not None:
            self._transport.close()

    def _update_reading(self) -> None:
        """Stop reading while the client does not read, or while requests queue up."""
        t = self._transport
        if t is None or self._closing:
            return
        want_pause = self._write_paused or len(self._queue) > 0
        if want_pause and not self._read_paused:
            t.pause_reading()
            self._read_paused = True
        elif not want_pause and self._read_paused:
            t.resume_reading()
            self._read_paused = False

    # ---- for the server --------------------------------------------------------------

    @property
    def idle(self) -> bool:
        """No request being answered or waiting to be. A request still arriving counts
        as idle: a client that stalls mid-request is closed like a silent one."""
        return not self._busy and not self._queue

    @property
    def arriving(self) -> bool:
        """A request has begun to arrive and is not whole yet."""
        return self._reader.arriving

    def close(self) -> None:
        self._abort()

    def sweep(self, now: float) -> None:
        """Enforce the deadlines at ``now``: a closed connection that has not gone within
        LINGER_S is reset; a request arriving too slowly gets 408; an idle connection is
        closed. A request that arrives behind one being answered waits with its deadline:
        its answer must not overtake the earlier one."""
        if self._closing:
            if now - self.closed_at > LINGER_S and self._transport is not None:
                self._transport.abort()
            return
        refusal = self._reader.overdue(now, busy=not self.idle)
        if refusal is not None:
            self._refuse(refusal)
            return
        if self.idle and self._reader.idle_expired(now):
            self._abort()
