"""The HTTP edge's sans-I/O core: one connection's requests as they arrive, their limits
and their deadlines, on a clock the caller passes in.

Owns `RequestReader` (httptools parsing, the limits: request target 414, headers 431,
body 413 before a body over the limit is read; a body of ``DIRECT_BODY_BYTES`` or more
read straight into a buffer of its declared length; ``Expect: 100-continue``; the read
deadlines: the request line and headers within ``header_timeout`` of the request's first
byte, the body at ``min_body_rate`` over every ``body_timeout`` window, else 408; the
idle timeout), `Ledger` (the buffered-bytes budget shared by a server's connections and
the refusals by cause), `Limits`, and `Refusal`, the verdict that ends a connection with
its answer. Like h11's readers, it is fed bytes and the time and queues the requests it
completes (`RequestReader.ready`); `edge.state.Connection`, the pure connection above it,
decides what happens to them (keep-alive, pipelining, close, linger), and the asyncio
shell (`edge.connection`) owns the socket, the dispatch and the clock.
Must not: read a clock, touch a socket or a transport, log, run handlers, or call back
into anything outside the reader (httptools calls back into the reader only).

Deadlines cost nothing per byte or per request: the time of the data that began a
request is kept (the shell reads its clock once per received chunk anyway) and
`RequestReader.overdue` is called by one sweep per server.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import httptools

from kvatlas.coordinator.http.edge.messages import HttpRequest, closing_answer

MAX_URL_BYTES = 8 * 1024
MAX_HEADER_BYTES = 64 * 1024
UNRESERVED_BODY_BYTES = 64 * 1024
"""A body up to this size is read without a reservation from the buffered-bytes budget,
so that the small requests of normal clients (heartbeats, event batches, lookups) are
still taken while large bodies hold the budget. What such bodies hold at once is bounded
by the connection cap, as their headers (MAX_HEADER_BYTES each) are."""
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
which the handler gets as it is: no copy per chunk, no join (see `RequestReader`)."""

REFUSALS = ("header_deadline", "body_rate", "connections", "buffered_bytes")
"""The causes the server refuses for on its own: 408 (headers late, body too slow) and
503 (the connection cap, the buffered-bytes budget)."""
RETRY_AFTER = b"retry-after: 1\r\n"


@dataclass(slots=True, frozen=True)
class Limits:
    """What a connection may send and how slowly (see `HttpServer` for each one's why)."""

    max_body_bytes: int
    header_timeout: float = 10.0
    """Seconds from a request's first byte to the end of its headers."""
    body_timeout: float = 10.0
    """The window over which a body must arrive at ``min_body_rate``."""
    min_body_rate: float = 16 * 1024
    """Bytes/s a body must keep up over every window."""
    idle_timeout: float = 75.0
    """Seconds a connection may stay silent between requests."""


class Refusal(Exception):
    """The request cannot be taken; answer with this status and close the connection."""

    def __init__(self, status: int, reason: str, extra: bytes = b"") -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.extra = extra
        """Header lines of the answer (``Retry-After``)."""

    def answer(self) -> bytes:
        """The whole answer, which closes the connection."""
        return closing_answer(self.status, self.reason, self.extra)


class Ledger:
    """A server's budget of request bytes buffered at once, what has been given back of
    it (for the heap trim), and its refusals by cause (REFUSALS). One thread changes it
    (the event loop); a snapshot reads each value once."""

    __slots__ = ("buffered", "given_back", "max_buffered_bytes", "refused")

    def __init__(self, max_buffered_bytes: int) -> None:
        self.max_buffered_bytes = max_buffered_bytes
        self.buffered = 0
        """Bytes of the budget that bodies hold now."""
        self.given_back = 0
        """Bytes of the budget given back since the server last trimmed its heap."""
        self.refused: dict[str, int] = dict.fromkeys(REFUSALS, 0)

    def reserve(self, nbytes: int) -> None:
        """Take ``nbytes`` of the budget, or refuse (503, ``Retry-After``)."""
        if self.buffered + nbytes > self.max_buffered_bytes:
            self.refused["buffered_bytes"] += 1
            raise Refusal(
                503,
                f"request bodies buffered at once reached the limit of"
                f" {self.max_buffered_bytes} bytes; retry later",
                RETRY_AFTER,
            )
        self.buffered += nbytes

    def give_back(self, nbytes: int) -> None:
        """A body's reservation ends."""
        self.buffered -= nbytes
        self.given_back += nbytes

    def over_connection_cap(self, max_connections: int) -> Refusal:
        """A connection over the cap: counted, and the 503 it gets."""
        self.refused["connections"] += 1
        return Refusal(
            503,
            f"too many open connections (the limit is {max_connections}); retry later",
            RETRY_AFTER,
        )


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


class RequestReader:
    """One connection's requests as they arrive.

    The shell asks `buffer` where the next read goes and reports it with `received`.
    Request lines and headers go into the server's one read buffer (``read_view``; at
    most ``head_view`` of it while no body is arriving through the parser) and through
    httptools, which copies out what it keeps. A body that declares ``DIRECT_BODY_BYTES``
    or more gets a buffer of its length when its headers are complete; what of it came
    with the headers httptools hands over, and once that read is parsed the reader
    offers the rest of that buffer (``_direct``) without the parser: each read is
    offered exactly the span still missing, so it never takes the next request's bytes.
    The body complete, a fresh parser takes the connection's next request. A big lookup
    body thus arrives without copies per chunk nor a join.

    Complete requests wait in `ready` (the request, whether the connection stays open
    after it, the bytes of the budget its body holds) for `edge.state.Connection` to take
    them in order."""

    def __init__(
        self,
        limits: Limits,
        ledger: Ledger,
        *,
        read_view: memoryview,
        head_view: memoryview,
        now: float,
    ) -> None:
        self._limits = limits
        self._ledger = ledger
        self.ready: deque[tuple[HttpRequest, bool, int]] = deque()
        """Complete requests, oldest first: the request, keep-alive, bytes reserved."""
        self._read_view = read_view
        self._head_view = head_view
        self._parser = httptools.HttpRequestParser(self)
        self._pending: _Pending | None = None
        self._direct: _Pending | None = None
        """The request whose body is read without the parser."""
        self._header_bytes = 0
        self.continue_asked = False
        """The arriving request's headers asked for ``100 Continue`` and it has not been
        sent (`continued`); false once the request is whole or dropped."""
        self.last_active = now
        """When data last arrived or an answer was last sent (`touch`)."""

    # ---- for the shell ---------------------------------------------------------------

    @property
    def arriving(self) -> bool:
        """A request has begun and not yet arrived whole."""
        return self._pending is not None

    def continued(self) -> None:
        """``100 Continue`` was sent to the arriving request (it is not asked again)."""
        self.continue_asked = False

    def buffer(self) -> memoryview:
        """Where the next read goes."""
        p = self._direct
        if p is not None and p.view is not None:
            return p.view[p.size :]
        p = self._pending
        if p is not None and p.body_since:
            return self._read_view  # a chunked or small body: the parser's
        return self._head_view

    def received(self, nbytes: int, now: float) -> Refusal | None:
        """``nbytes`` were read into `buffer` at ``now``: parse them, queue each complete
        request in `ready`; a refusal ends the connection (whoever answers it calls
        `drop`; what is in `ready` stays there)."""
        self.last_active = now
        p = self._direct
        if p is not None:
            p.size += nbytes
            if p.size == p.expect:
                self._direct = None
                self._parser = httptools.HttpRequestParser(self)
                try:
                    self._complete(p, p.keep_alive)
                except Refusal as refusal:
                    return refusal
            return None
        try:
            self._parser.feed_data(self._read_view[:nbytes])
        except httptools.HttpParserUpgrade:
            return Refusal(400, "protocol upgrades are not supported")
        except httptools.HttpParserError as exc:
            # httptools wraps what a callback raised; a Refusal carries its own answer.
            cause = exc.__context__
            if isinstance(cause, Refusal):
                return cause
            return Refusal(400, f"malformed HTTP request: {exc}")
        p = self._pending
        if p is not None and p.view is not None:
            self._direct = p  # its body's rest goes straight into its buffer
        return None

    def touch(self, now: float) -> None:
        """An answer was sent at ``now``: the idle timeout counts from it."""
        self.last_active = now

    def overdue(self, now: float, busy: bool) -> Refusal | None:
        """The arriving request's deadlines at ``now`` (408, counted), or None. While
        the connection is ``busy`` answering an earlier request, the arriving one waits
        (reading may be paused): its body's window starts again."""
        p = self._pending
        if p is None:
            return None
        if busy:
            p.mark_at, p.mark_size = now, p.size
            return None
        limits = self._limits
        if not p.body_since:
            if now - p.started > limits.header_timeout:
                self._ledger.refused["header_deadline"] += 1
                return Refusal(
                    408, f"request line and headers not received in {limits.header_timeout} s"
                )
        elif now - p.mark_at >= limits.body_timeout:
            # The rate over the last window, not since the body began: a body that
            # arrived fast and then stalls cannot live on its early bytes' credit.
            if p.size - p.mark_size < (now - p.mark_at) * limits.min_body_rate:
                self._ledger.refused["body_rate"] += 1
                return Refusal(
                    408, f"request body arriving slower than {limits.min_body_rate:.0f} bytes/s"
                )
            p.mark_at, p.mark_size = now, p.size
        return None

    def idle_expired(self, now: float) -> bool:
        """Silent for longer than the idle timeout (the shell asks only while no request
        is being answered: one stalled mid-request is closed like a silent one)."""
        return now - self.last_active > self._limits.idle_timeout

    def drop(self) -> int:
        """Forget the arriving request; the bytes of the budget it held (given back)."""
        p, self._pending = self._pending, None
        self._direct = None
        self.continue_asked = False
        held = p.reserved if p is not None else 0
        self._ledger.give_back(held)
        return held

    # ---- httptools callbacks ---------------------------------------------------------

    def on_message_begin(self) -> None:
        self._pending = _Pending(self.last_active)
        self._header_bytes = 0

    def on_url(self, url: bytes) -> None:
        p = self._pending
        assert p is not None
        p.url += url
        if len(p.url) > MAX_URL_BYTES:
            raise Refusal(414, f"request target longer than {MAX_URL_BYTES} bytes")

    def on_header(self, name: bytes, value: bytes) -> None:
        p = self._pending
        assert p is not None
        self._header_bytes += len(name) + len(value)
        if self._header_bytes > MAX_HEADER_BYTES:
            raise Refusal(431, f"request headers exceed {MAX_HEADER_BYTES} bytes")
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        p.headers[key] = f"{p.headers[key]}, {text}" if key in p.headers else text

    def on_headers_complete(self) -> None:
        p = self._pending
        assert p is not None
        if self._parser.should_upgrade():
            # Before the request is queued: an upgrade is refused, never served.
            raise Refusal(400, "protocol upgrades are not supported")
        p.method = self._parser.get_method().decode("ascii", "replace")
        p.body_since = p.mark_at = self.last_active
        limit = self._limits.max_body_bytes
        declared = p.headers.get("content-length")
        if declared is not None and declared.isdigit():
            if int(declared) > limit:
                raise Refusal(413, f"body of {declared} bytes exceeds the limit of {limit}")
            if int(declared) > UNRESERVED_BODY_BYTES:
                self._reserve(p, int(declared))
            if int(declared) >= DIRECT_BODY_BYTES and "transfer-encoding" not in p.headers:
                p.expect = int(declared)
                p.buf = bytearray(p.expect)
                p.view = memoryview(p.buf)
                p.keep_alive = self._parser.should_keep_alive()
        if p.headers.get("expect", "").lower() == "100-continue":
            self.continue_asked = True

    def on_body(self, body: bytes) -> None:
        p = self._pending
        assert p is not None
        p.size += len(body)
        limit = self._limits.max_body_bytes
        if p.size > limit:
            raise Refusal(413, f"body exceeds the limit of {limit} bytes")
        if p.view is not None:
            # The parser frames the body by its Content-Length: it never hands more.
            p.view[p.size - len(body) : p.size] = body
            return
        if p.size > p.reserved and p.size > UNRESERVED_BODY_BYTES:
            self._reserve(p, p.size - p.reserved)  # a chunked body: no declared length
        p.body.append(body)

    def on_message_complete(self) -> None:
        p = self._pending
        assert p is not None
        self._complete(p, self._parser.should_keep_alive())

    def _reserve(self, p: _Pending, nbytes: int) -> None:
        """Take ``nbytes`` of the buffered-bytes budget for ``p``'s body, or refuse it."""
        self._ledger.reserve(nbytes)
        p.reserved += nbytes

    def _complete(self, p: _Pending, keep_alive: bool) -> None:
        """``p`` has arrived whole: queue it."""
        try:
            parsed = httptools.parse_url(p.url)
        except httptools.HttpParserInvalidURLError as exc:
            # Still pending: the refusal gives back what its body holds.
            raise Refusal(400, f"malformed request target: {p.url[:64]!r}") from exc
        self._pending = None
        self.continue_asked = False
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
        self.ready.append((request, keep_alive, p.reserved))
