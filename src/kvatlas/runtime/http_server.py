"""kvatlas' HTTP/1.1 server: uvloop and httptools, without an ASGI layer.

Owns connections and their life: parsing (httptools), keep-alive and pipelining (one
request at a time per connection, answered in order), limits (request line, headers,
body: 414 / 431 / 413 before a body over the limit is read), read deadlines (the request
line and headers within ``header_timeout`` of the request's first byte, the body at
``min_body_rate`` over every ``body_timeout`` window: 408), a cap on open connections
(over it, a 503 with ``Retry-After``), a cap on the request bytes buffered at once across
all connections (a body reserves its declared length before it is read; over the cap, a
503 with ``Retry-After``), ``Expect: 100-continue``, idle timeouts, write back-pressure,
graceful shutdown, and dispatch through a ``Router`` by method and path. Must not know
any service's routes, state or error tree: the service hands it handlers, a gate and an
error translator.

Why not uvicorn and Starlette: the service's hot requests (an events batch, a lookup)
do 30-300 us of work, so the per-request cost of the server matters. Here a handler is a
plain function called on the loop as soon as its request is complete; the few that must
wait (a membership change through Kafka) are coroutines, and the few that are heavy (a
big body, a scan) are sent to a thread pool by the route's ``offload`` predicate. What
that saves against uvicorn's ASGI cycle (a task, a scope dict, receive/send coroutines
per request) is measured by ``python -m bench.http_edge_bench`` (docs/benchmarks.md).

Deadlines cost nothing per byte or per request: the time of the data that began a
request is kept (the clock is read once per received chunk anyway) and one sweep per
server, every second or less, checks every connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import inspect
import logging
import resource
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, cast
from urllib.parse import parse_qsl

import httptools
import msgspec
import uvloop

log = logging.getLogger(__name__)

MAX_URL_BYTES = 8 * 1024
MAX_HEADER_BYTES = 64 * 1024

MAX_CONNECTIONS = 4096
"""The default cap on open connections when the open-file limit allows it."""
FD_HEADROOM = 256
"""Descriptors left to everything else a process opens (files, threads' pipes, clients)."""
MAX_REFUSING = 64
"""Refused connections kept open at once to deliver their 503; beyond, reset at once.
Open descriptors thus never exceed the cap plus this."""
UNRESERVED_BODY_BYTES = 64 * 1024
"""A body up to this size is read without a reservation from the buffered-bytes budget,
so that the small requests of normal clients (heartbeats, event batches, lookups) are
still taken while large bodies hold the budget. What such bodies hold at once is bounded
by the connection cap, as their headers (MAX_HEADER_BYTES each) are."""
TRIM_AFTER_BYTES = 32 * 1024 * 1024
"""Once bodies of this many bytes have been given back, the next sweep asks the C
allocator to return its free pages to the system (see ``_trim_heap``)."""
LINGER_S = 1.0
"""How long a closed connection may take to flush its answer (a client that does not
read) and a refused one may keep sending, before it is reset."""
READ_BUFFER_BYTES = 256 * 1024
"""The one buffer per server that every connection's request lines and headers (and
small bodies) are read into; httptools copies out what it keeps before the next read."""
HEAD_READ_BYTES = 16 * 1024
"""The most one read takes while no body is arriving through the parser: a request's
head and a small body (or a few pipelined small requests) come in one read, and of a
big body only what shares that read passes through httptools (which copies it)."""
DIRECT_BODY_BYTES = 16 * 1024
"""A body that declares at least this many bytes (``Content-Length``, no
``Transfer-Encoding``) is read by the kernel straight into one buffer of its length,
which the handler gets as it is: no copy per chunk, no join (see ``HttpProtocol``)."""


REFUSALS = ("header_deadline", "body_rate", "connections", "buffered_bytes")
"""The causes the server refuses for on its own: 408 (headers late, body too slow) and
503 (the connection cap, the buffered-bytes budget)."""


@dataclass(slots=True, frozen=True)
class EdgeStats:
    """A sample of the server's edge, for metrics."""

    connections: int
    buffered_bytes: int
    max_buffered_bytes: int
    refused: dict[str, int]


def _load_malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``; None under another C library (musl has none)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    trim: Callable[[int], int] | None = getattr(ctypes.CDLL(name), "malloc_trim", None)
    return trim


_MALLOC_TRIM = _load_malloc_trim()


def _trim_heap() -> None:
    """Give the allocator's free pages back to the system. Bodies arrive as many chunks
    of up to 256 KiB, allocated between other objects' memory; freed, they leave holes
    inside the heap that glibc keeps (it trims only the heap's top), so a burst of big
    bodies would keep its resident memory for good (480 MB in issue #14). One call costs
    a walk over the heap (milliseconds), made at most once per sweep after a release."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def default_max_connections() -> int:
    """MAX_CONNECTIONS, or fewer when RLIMIT_NOFILE leaves no room for them plus
    FD_HEADROOM and MAX_REFUSING (a quarter of the limit at the least)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS
    return max(1, soft // 4, min(MAX_CONNECTIONS, soft - FD_HEADROOM - MAX_REFUSING))


@dataclass(slots=True)
class HttpRequest:
    """One complete request. Header names are lower-case; the body is whole: a
    ``bytearray`` when it was read straight into its own buffer (``DIRECT_BODY_BYTES``),
    which nothing changes once the request is handed over."""

    method: str
    path: str
    query_string: str
    headers: dict[str, str]
    body: bytes | bytearray
    path_params: dict[str, str] = field(default_factory=dict)
    arrived: float = 0.0
    """``time.monotonic()`` when the data holding the request's first byte arrived: a
    handler reports the time before it from it (reading, parsing, waiting in line)."""

    @property
    def query(self) -> dict[str, str]:
        """Query parameters; the last one wins when a name repeats."""
        return dict(parse_qsl(self.query_string, keep_blank_values=True))


@dataclass(slots=True, frozen=True)
class HttpResponse:
    status: int
    body: bytes = b""
    content_type: str = "application/json"
    headers: tuple[tuple[str, str], ...] = ()


SyncHandler = Callable[[HttpRequest], HttpResponse]
AsyncHandler = Callable[[HttpRequest], Awaitable[HttpResponse]]
Offload = Callable[[HttpRequest], bool]


def always(request: HttpRequest) -> bool:
    """An `offload` predicate: every request of the route goes to the thread pool."""
    return True


@dataclass(slots=True, frozen=True)
class Route:
    method: str
    path: str
    """Literal segments and ``{name}`` placeholders, each matching one segment."""
    handler: SyncHandler | AsyncHandler
    offload: Offload | None = None
    """For a plain function: when true for a request, run it in the thread pool."""
    is_async: bool = False


class Router:
    """Method and path to a route; exact paths by one dict lookup, patterns by segments."""

    def __init__(self) -> None:
        self._exact: dict[str, dict[str, Route]] = {}
        self._patterns: list[tuple[list[str], dict[str, Route]]] = []

    def add(
        self,
        method: str,
        path: str,
        handler: SyncHandler | AsyncHandler,
        *,
        offload: Offload | None = None,
    ) -> None:
        is_async = inspect.iscoroutinefunction(handler)
        if is_async and offload is not None:
            raise ValueError(f"{method} {path}: a coroutine handler cannot be offloaded")
        route = Route(method, path, handler, offload, is_async)
        if "{" not in path:
            self._exact.setdefault(path, {})[method] = route
            return
        parts = path.strip("/").split("/")
        for known, methods in self._patterns:
            if known == parts:
                methods[method] = route
                return
        self._patterns.append((parts, {method: route}))

    def routes(self) -> list[Route]:
        every = [r for methods in self._exact.values() for r in methods.values()]
        return every + [r for _, methods in self._patterns for r in methods.values()]

    def match(self, method: str, path: str) -> tuple[Route | None, dict[str, str], list[str]]:
        """The route, its path parameters, and (when no route) the methods the path has."""
        methods = self._exact.get(path)
        params: dict[str, str] = {}
        if methods is None:
            segments = path.strip("/").split("/")
            for parts, candidate in self._patterns:
                if len(parts) == len(segments):
                    got = _bind(parts, segments)
                    if got is not None:
                        methods, params = candidate, got
                        break
        if methods is None:
            return None, {}, []
        route = methods.get("GET" if method == "HEAD" else method)
        if route is None:
            return None, {}, sorted(methods)
        return route, params, []


def _bind(parts: list[str], segments: list[str]) -> dict[str, str] | None:
    params: dict[str, str] = {}
    for part, seg in zip(parts, segments, strict=True):
        if part.startswith("{"):
            if not seg:
                return None
            params[part[1:-1]] = seg
        elif part != seg:
            return None
    return params


ErrorTranslator = Callable[[Exception], HttpResponse | None]
"""Maps an exception a handler raised to its answer; None means a bug (500)."""
Gate = Callable[[HttpRequest], HttpResponse | None]
"""Runs before routing (authentication); an answer stops the request there."""


_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}


def _head(status: int, content_type: str, length: int, extra: bytes, close: bool) -> bytes:
    return b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n%s%s\r\n" % (
        status,
        _REASONS.get(status, b"Unknown"),
        content_type.encode(),
        length,
        extra,
        b"connection: close\r\n" if close else b"",
    )


def _error_body(reason: str) -> bytes:
    """``{"error": reason}``, the shape of every kvatlas service's error answer."""
    return msgspec.json.encode({"error": reason})


def _head_and_body(status: int, reason: str, extra: bytes) -> bytes:
    """A whole error answer that closes the connection."""
    body = _error_body(reason)
    return _head(status, "application/json", len(body), extra, True) + body


class _Pending:
    """A request that is arriving: its line and headers, then its body."""

    __slots__ = (
        "body",
        "body_since",
        "buf",
        "expect",
        "headers",
        "keep_alive",
        "mark_at",
        "mark_size",
        "method",
        "reserved",
        "size",
        "started",
        "url",
        "view",
    )

    def __init__(self, started: float) -> None:
        self.url = b""
        self.headers: dict[str, str] = {}
        self.body: list[bytes] = []
        self.size = 0
        self.method = ""
        # When the data holding the request's first byte arrived, and the data that
        # completed its headers (0 while they are arriving): the deadlines count from them.
        self.started = started
        self.body_since = 0.0
        # The start of the body's current rate window and its size then.
        self.mark_at = 0.0
        self.mark_size = 0
        self.reserved = 0
        """Bytes of the server's buffered-bytes budget this body holds."""
        # A body read straight into its own buffer (DIRECT_BODY_BYTES): the buffer, a
        # view of it, its declared length, and whether the connection stays open after.
        self.buf: bytearray | None = None
        self.view: memoryview | None = None
        self.expect = 0
        self.keep_alive = True


class _Refuse(Exception):
    """The request cannot be taken; answer with this status and close the connection."""

    def __init__(self, status: int, reason: str, extra: bytes = b"") -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.extra = extra
        """Header lines of the answer (``Retry-After``)."""


class HttpProtocol(asyncio.BufferedProtocol):
    """One client connection.

    Reads are buffered (``get_buffer``): request lines and headers go into the server's
    one read buffer and through httptools, which copies out what it keeps. A body that
    declares ``DIRECT_BODY_BYTES`` or more gets a buffer of its length when its headers
    are complete; what of it came with the headers httptools hands over, and once that
    read is parsed the connection reads the rest of the body straight into that buffer
    (``_direct``) without the parser: each read is offered exactly the span still
    missing, so it never takes the next request's bytes. The body complete, a fresh
    parser takes the connection's next request. A 218 KB lookup body used to arrive as
    a few bytes objects that httptools copied again and the server joined (~8% of the
    coordinator's CPU on the token-ids lookup)."""

    def __init__(self, server: HttpServer) -> None:
        self._server = server
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._pending: _Pending | None = None
        self._direct: _Pending | None = None
        """The request whose body the connection reads without the parser."""
        self._header_bytes = 0
        # A complete request, whether the connection stays open after it, and the bytes
        # of the buffered-bytes budget its body holds until it is answered.
        self._queue: deque[tuple[HttpRequest, bool, int]] = deque()
        self._busy = False
        self._closing = False
        self._write_paused = False
        self._read_paused = False
        self._eof = False
        self.last_active = time.monotonic()
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
        # The parser refers back to this protocol: without these references dropped here,
        # a stalled body would stay in memory until the cycle collector happens to run.
        self._server.connections.discard(self)
        self._server.refusing.discard(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        p = self._direct
        if p is not None and p.view is not None and not self._closing:
            return p.view[p.size :]
        p = self._pending
        if p is not None and p.body_since:
            return self._server.read_view  # a chunked or small body: the parser's
        return self._server.head_view

    def buffer_updated(self, nbytes: int) -> None:
        self.last_active = time.monotonic()
        if self._closing:
            return
        p = self._direct
        if p is not None:
            p.size += nbytes
            if p.size == p.expect:
                self._direct = None
                self._parser = httptools.HttpRequestParser(self)
                try:
                    self._complete(p, p.keep_alive)
                except _Refuse as exc:
                    self._refuse(exc.status, exc.reason, exc.extra)
            return
        try:
            self._parser.feed_data(self._server.read_view[:nbytes])
        except httptools.HttpParserUpgrade:
            self._refuse(400, "protocol upgrades are not supported")
            return
        except httptools.HttpParserError as exc:
            # httptools wraps what a callback raised; a _Refuse carries its own answer.
            cause = exc.__context__
            if isinstance(cause, _Refuse):
                self._refuse(cause.status, cause.reason, cause.extra)
            else:
                self._refuse(400, f"malformed HTTP request: {exc}")
            return
        p = self._pending
        if p is not None and p.view is not None and not self._closing:
            self._direct = p  # its body's rest goes straight into its buffer

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

    # ---- httptools callbacks ---------------------------------------------------------

    def on_message_begin(self) -> None:
        self._pending = _Pending(self.last_active)
        self._header_bytes = 0

    def on_url(self, url: bytes) -> None:
        p = self._pending
        assert p is not None
        p.url += url
        if len(p.url) > MAX_URL_BYTES:
            raise _Refuse(414, f"request target longer than {MAX_URL_BYTES} bytes")

    def on_header(self, name: bytes, value: bytes) -> None:
        p = self._pending
        assert p is not None
        self._header_bytes += len(name) + len(value)
        if self._header_bytes > MAX_HEADER_BYTES:
            raise _Refuse(431, f"request headers exceed {MAX_HEADER_BYTES} bytes")
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        p.headers[key] = f"{p.headers[key]}, {text}" if key in p.headers else text

    def on_headers_complete(self) -> None:
        p = self._pending
        assert p is not None
        p.method = self._parser.get_method().decode("ascii", "replace")
        p.body_since = p.mark_at = self.last_active
        limit = self._server.max_body_bytes
        declared = p.headers.get("content-length")
        if declared is not None and declared.isdigit():
            if int(declared) > limit:
                raise _Refuse(413, f"body of {declared} bytes exceeds the limit of {limit}")
            if int(declared) > UNRESERVED_BODY_BYTES:
                self._reserve(p, int(declared))
            if int(declared) >= DIRECT_BODY_BYTES and "transfer-encoding" not in p.headers:
                p.expect = int(declared)
                p.buf = bytearray(p.expect)
                p.view = memoryview(p.buf)
                p.keep_alive = self._parser.should_keep_alive()
        if p.headers.get("expect", "").lower() == "100-continue" and self._transport:
            self._transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        p = self._pending
        assert p is not None
        p.size += len(body)
        if p.size > self._server.max_body_bytes:
            raise _Refuse(413, f"body exceeds the limit of {self._server.max_body_bytes} bytes")
        if p.view is not None:
            # The parser frames the body by its Content-Length: it never hands more.
            p.view[p.size - len(body) : p.size] = body
            return
        if p.size > p.reserved and p.size > UNRESERVED_BODY_BYTES:
            self._reserve(p, p.size - p.reserved)  # a chunked body: no declared length
        p.body.append(body)

    def _reserve(self, p: _Pending, nbytes: int) -> None:
        """Take ``nbytes`` of the buffered-bytes budget for ``p``'s body, or refuse it."""
        server = self._server
        if server.buffered + nbytes > server.max_buffered_bytes:
            server.refused["buffered_bytes"] += 1
            raise _Refuse(
                503,
                f"request bodies buffered at once reached the limit of"
                f" {server.max_buffered_bytes} bytes; retry later",
                b"retry-after: 1\r\n",
            )
        server.buffered += nbytes
        p.reserved += nbytes

    def _drop_buffered(self) -> None:
        """Forget the arriving and the queued requests and give back what they held."""
        p, self._pending = self._pending, None
        self._direct = None
        held = (p.reserved if p is not None else 0) + sum(r for _, _, r in self._queue)
        self._queue.clear()
        self._server.give_back(held)

    def on_message_complete(self) -> None:
        p = self._pending
        assert p is not None
        self._complete(p, self._parser.should_keep_alive())

    def _complete(self, p: _Pending, keep_alive: bool) -> None:
        """``p`` has arrived whole: queue it, and answer it unless one is in progress."""
        try:
            parsed = httptools.parse_url(p.url)
        except httptools.HttpParserInvalidURLError as exc:
            # Still pending: the refusal gives back what its body holds.
            raise _Refuse(400, f"malformed request target: {p.url[:64]!r}") from exc
        self._pending = None
        body: bytes | bytearray
        if p.buf is not None:
            assert p.view is not None
            p.view.release()
            body = p.buf
        else:
            body = p.body[0] if len(p.body) == 1 else b"".join(p.body)
        request = HttpRequest(
            p.method,
            parsed.path.decode("utf-8", "replace"),
            parsed.query.decode("latin-1") if parsed.query else "",
            p.headers,
            body,
            arrived=p.started,
        )
        self._queue.append((request, keep_alive, p.reserved))
        if not self._busy:
            self._run_queue()
        else:
            self._update_reading()

    # ---- dispatch --------------------------------------------------------------------

    def _run_queue(self) -> None:
        """Answer queued requests in order until one must wait (a task or the pool)."""
        while self._queue and not self._closing:
            request, keep_alive, reserved = self._queue.popleft()
            gate = self._server.gate
            refused = gate(request) if gate is not None else None
            if refused is not None:
                self._server.give_back(reserved)
                self._respond(refused, keep_alive, request.method)
                continue
            route, params, allowed = self._server.router.match(request.method, request.path)
            if route is None:
                self._server.give_back(reserved)
                self._respond(_not_routed(request, allowed), keep_alive, request.method)
                continue
            request.path_params = params
            if route.is_async:
                work = route.handler(request)
                self._wait_for(work, request, keep_alive, reserved)  # type: ignore[arg-type]
                return
            handler: SyncHandler = route.handler  # type: ignore[assignment]
            if route.offload is not None and route.offload(request):
                loop = asyncio.get_running_loop()
                fut = loop.run_in_executor(self._server.executor, handler, request)
                self._wait_for(fut, request, keep_alive, reserved)
                return
            try:
                response = handler(request)
            except Exception as exc:
                response = self._server.translate(exc, request)
            self._server.give_back(reserved)
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
        self._server.tasks.add(task)

        def done(t: asyncio.Future[HttpResponse]) -> None:
            self._server.tasks.discard(t)
            self._server.give_back(reserved)
            self._busy = False
            if t.cancelled():
                self._abort()
                return
            exc = t.exception()
            if exc is None:
                response = t.result()
            elif isinstance(exc, Exception):
                response = self._server.translate(exc, request)
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
        extra = b"".join(b"%s: %s\r\n" % (k.encode(), v.encode()) for k, v in response.headers)
        head = _head(response.status, response.content_type, len(response.body), extra, close)
        if method == "HEAD" or not response.body:
            t.write(head)
        else:
            t.writelines((head, response.body))
        self.last_active = time.monotonic()
        if close:
            self._abort()

    def _refuse(self, status: int, reason: str, extra: bytes = b"") -> None:
        """Answer a request that cannot be taken, then close: the stream is lost."""
        self._drop_buffered()
        if self._closing:
            return
        self._linger(_head_and_body(status, reason, extra))

    def _refuse_connection(self) -> None:
        """Over the cap: answer 503 at once and close."""
        server, t = self._server, self._transport
        assert t is not None
        if len(server.refusing) >= MAX_REFUSING:
            self._closing = True
            t.abort()  # a flood: descriptors matter more than the courtesy
            return
        server.refusing.add(self)
        server.refused["connections"] += 1
        reason = f"too many open connections (the limit is {server.max_connections}); retry later"
        self._linger(_head_and_body(503, reason, b"retry-after: 1\r\n"))

    def _linger(self, answer: bytes) -> None:
        """Send the last answer and close our side, then read and drop what the client
        still sends until it closes or LINGER_S passes: closing with its bytes unread
        would reset the connection, and the client could lose the answer."""
        t = self._transport
        self._closing = True
        self.closed_at = time.monotonic()
        if t is None:
            return
        t.write(answer)
        if t.can_write_eof():
            t.write_eof()
        else:
            t.close()

    def _abort(self) -> None:
        if not self._closing:
            self.closed_at = time.monotonic()
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

    def close(self) -> None:
        self._abort()

    def sweep(self, now: float) -> None:
        """Enforce the deadlines at ``now``: a closed connection that has not gone within
        LINGER_S is reset; a request arriving too slowly gets 408; an idle connection is
        closed. A request that arrives behind one being answered waits with its deadline:
        its answer must not overtake the earlier one."""
        server = self._server
        if self._closing:
            if now - self.closed_at > LINGER_S and self._transport is not None:
                self._transport.abort()
            return
        p = self._pending
        if p is not None and not self.idle:
            # It waits behind an answer (reading may be paused): its window starts again.
            p.mark_at, p.mark_size = now, p.size
        elif p is not None:
            if not p.body_since:
                if now - p.started > server.header_timeout:
                    server.refused["header_deadline"] += 1
                    self._refuse(
                        408, f"request line and headers not received in {server.header_timeout} s"
                    )
                    return
            elif now - p.mark_at >= server.body_timeout:
                # The rate over the last window, not since the body began: a body that
                # arrived fast and then stalls cannot live on its early bytes' credit.
                if p.size - p.mark_size < (now - p.mark_at) * server.min_body_rate:
                    server.refused["body_rate"] += 1
                    self._refuse(
                        408,
                        f"request body arriving slower than {server.min_body_rate:.0f} bytes/s",
                    )
                    return
                p.mark_at, p.mark_size = now, p.size
        if self.idle and now - self.last_active > server.idle_timeout:
            self._abort()


def _not_routed(request: HttpRequest, allowed: list[str]) -> HttpResponse:
    if allowed:
        return HttpResponse(
            405,
            _error_body(f"{request.method} is not allowed on {request.path}"),
            headers=(("allow", ", ".join(allowed)),),
        )
    return HttpResponse(404, _error_body(f"no such endpoint: {request.path}"))


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
    ) -> None:
        self.router = router
        self._translate = translate
        self.gate = gate
        self.max_body_bytes = max_body_bytes
        self.idle_timeout = idle_timeout
        self.header_timeout = header_timeout
        self.body_timeout = body_timeout
        self.min_body_rate = min_body_rate
        self.max_connections = (
            default_max_connections() if max_connections is None else max_connections
        )
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")
        self.max_buffered_bytes = (
            4 * max_body_bytes if max_buffered_bytes is None else max_buffered_bytes
        )
        if self.max_buffered_bytes < max_body_bytes:
            raise ValueError(
                f"max_buffered_bytes ({self.max_buffered_bytes}) must be >= max_body_bytes"
                f" ({max_body_bytes}), or the largest body could never be taken"
            )
        self.buffered = 0
        """Bytes of the budget that bodies hold now (changed on the loop only)."""
        self.given_back = 0
        """Bytes of the budget given back since the last heap trim."""
        self.refused: dict[str, int] = dict.fromkeys(REFUSALS, 0)
        """Requests and connections refused, by cause (REFUSALS), since the start."""
        self.shutdown_grace = shutdown_grace
        self.executor = ThreadPoolExecutor(offload_threads, thread_name_prefix="http-offload")
        self.connections: set[HttpProtocol] = set()
        """Connections being served (at most max_connections)."""
        self.refusing: set[HttpProtocol] = set()
        """Connections over the cap whose 503 is on its way (at most MAX_REFUSING)."""
        self.tasks: set[asyncio.Future[Any]] = set()
        self.read_view = memoryview(bytearray(READ_BUFFER_BYTES))
        self.head_view = self.read_view[:HEAD_READ_BYTES]
        """Every connection's reads outside a direct body (see ``HttpProtocol``): the
        loop is one thread, and a read is parsed before the next is taken."""
        self.stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._stop_asked = threading.Event()
        self.serving = threading.Event()
        """Set once the socket is being served."""
        self.closers: list[Callable[[], Awaitable[None]]] = []
        """Awaited on the loop once serving stopped (clients of the handlers' own)."""

    def give_back(self, nbytes: int) -> None:
        """A body's reservation ends (on the loop)."""
        self.buffered -= nbytes
        self.given_back += nbytes

    def stats(self) -> EdgeStats:
        """What the edge holds and has refused now; safe from any thread (a snapshot of
        values the loop changes, each read once)."""
        return EdgeStats(
            connections=len(self.connections),
            buffered_bytes=self.buffered,
            max_buffered_bytes=self.max_buffered_bytes,
            refused=dict(self.refused),
        )

    def translate(self, exc: Exception, request: HttpRequest) -> HttpResponse:
        response = self._translate(exc)
        if response is not None:
            return response
        log.exception("Unexpected error in %s %s", request.method, request.path, exc_info=exc)
        return HttpResponse(500, _error_body(f"internal error: {type(exc).__name__}"))

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
        period = min(1.0, self.idle_timeout, self.header_timeout, self.body_timeout)
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for conn in list(self.connections):
                conn.sweep(now)
            for conn in list(self.refusing):
                conn.sweep(now)
            if self.given_back >= TRIM_AFTER_BYTES:
                self.given_back = 0
                _trim_heap()

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
