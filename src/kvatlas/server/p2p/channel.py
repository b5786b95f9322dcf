"""The P2P control channel over ZeroMQ: the owner's ROUTER and the requester's DEALERs.

Owns the sockets and the request/answer matching of ``kvatlas.wire.p2p_proto``:

- ``ChannelServer`` binds a ROUTER on the listen URL (``--p2p-listen-url``) and answers
  each request with ``handler(body)`` in one thread that polls with a timeout (it never
  spins, and stops within one poll interval). Handlers are short: they take the engine
  lock only to lock or release chunks. A message over ``MAX_MESSAGE_BYTES`` is refused
  by ZeroMQ from its size header (the sender is disconnected), before anything of it is
  buffered or its token checked.
- ``ChannelClient`` talks to one peer through a small pool of DEALER sockets (one request
  in flight per socket). A call waits at most its timeout (derived from the lookup
  deadline by the caller); a socket whose answer did not come in time is closed, never
  reused, so a late answer cannot be mistaken for the next one. Each DEALER has a socket
  monitor: a refused connection, a closed one or a disconnect seen while a call waits
  fails the call at once as ``peer_dead`` (a dead peer costs milliseconds, not the
  deadline), and an idle socket that saw one is replaced before it is used. A call given
  an ``abandon`` event ends as ``timeout`` within ``ABANDON_CHECK_MS`` of it being set:
  the controller sets a peer's when its breaker opens, so lookups already waiting on a
  frozen peer end with the first one that hit its deadline, not each at its own.

Versions (`wire.versions`): the server answers a request of a version in
``P2P_VERSIONS`` in that version and any other with a ``version`` error naming its range;
an operation it does not know (a newer peer's) gets ``unknown_operation`` at once. Both
are counted in ``unknown`` and the first of each name is logged. A client starts at
``P2P_PROTOCOL_VERSION``; answered ``version`` (with a range, or bare from a first-release
peer: 1), it moves to the highest common version, asks again once within the same
timeout, and keeps that version for the peer.

Must not: know what the messages mean (the P2P service does) or touch the chunk store.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Final

import msgspec
import zmq
import zmq.utils.monitor

from kvatlas.runtime.zmq_sockets import bind_router
from kvatlas.server.errors import ServerError
from kvatlas.wire import p2p_proto
from kvatlas.wire.decoding import decode_head
from kvatlas.wire.engine_proto import PeerFallback
from kvatlas.wire.versions import highest_common, peer_range

log = logging.getLogger(__name__)

POLL_MS: Final = 200
"""How often the owner's loop looks at its stop flag while idle."""
MAX_IDLE_SOCKETS: Final = 4
MAX_MESSAGE_BYTES: Final = 16 * 2**20
"""The largest request the owner reads: a `LookupAndLock` of ~490k chunk hashes."""
MAX_LOGGED_NAMES: Final = 32
"""Unknown operations and versions logged by name (once each); later ones only counted."""
ABANDON_CHECK_MS: Final = 5
"""How often a call with an ``abandon`` event looks at it while waiting."""
PEER_GONE_EVENTS: Final = zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_CLOSED
"""Socket monitor events that mean the peer cannot answer (refused, closed, gone)."""


class ChannelError(ServerError):
    """A control request to a peer failed; ``cause`` is timeout, peer_dead or refused."""

    def __init__(self, message: str, cause: PeerFallback) -> None:
        super().__init__(message)
        self.cause = cause


Handler = Callable[[p2p_proto.P2PRequestBody], p2p_proto.P2PResponseBody]


class ChannelServer:
    """The owner's ROUTER; ``start()`` binds (PortInUse when taken), ``stop()`` joins."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], host: str, port: int) -> None:
        bound = bind_router(
            ctx,
            host,
            port,
            what="P2P control",
            flag="--p2p-listen-url",
            max_message_bytes=MAX_MESSAGE_BYTES,
        )
        self._sock = bound.socket
        self.host = host
        self.port = bound.port
        self.endpoint = bound.endpoint
        """What the socket bound, as ZeroMQ reports it."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.requests = 0
        self.errors = 0
        self.unknown: Counter[str] = Counter(version=0, operation=0)
        """Requests this node could not read, by what: ``version``, ``operation`` (keys
        made up front: another thread reads the counter without a lock)."""
        self._logged: set[str] = set()

    def start(self, handler: Handler) -> None:
        self._thread = threading.Thread(
            target=self._run, args=(handler,), name="kvatlas-p2p-channel", daemon=True
        )
        self._thread.start()

    def _run(self, handler: Handler) -> None:
        sock = self._sock
        while not self._stop.is_set():
            try:
                if not sock.poll(POLL_MS, zmq.POLLIN):
                    continue
                frames = sock.recv_multipart(copy=True)
            except zmq.ZMQError:
                return
            if len(frames) < 2:
                continue
            ident, payload = frames[0], frames[-1]
            self.requests += 1
            answer = self._answer(handler, payload)
            try:
                sock.send_multipart([ident, b"", p2p_proto.encode(answer)])
            except zmq.ZMQError:
                return

    def _answer(self, handler: Handler, payload: bytes) -> p2p_proto.P2PResponse:
        try:
            req = p2p_proto.decode_request(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self.errors += 1
            head = decode_head(payload)
            if head.v and not p2p_proto.P2P_VERSIONS.supports(head.v):
                return self._version_error(head.v, head.id)
            if head.op and head.op not in p2p_proto.P2P_OPERATIONS:
                return self._unknown_operation(head.v, head.id, head.op)
            # no readable version (0): malformed, answered in ours
            return p2p_proto.P2PResponse(
                head.v or p2p_proto.P2P_PROTOCOL_VERSION,
                head.id,
                p2p_proto.P2PError("invalid_input", f"bad request: {exc}"),
            )
        if not p2p_proto.P2P_VERSIONS.supports(req.v):
            self.errors += 1
            return self._version_error(req.v, req.id)
        try:
            body = handler(req.body)
        except Exception as exc:
            self.errors += 1
            log.exception("P2P request %s failed", type(req.body).__name__)
            body = p2p_proto.P2PError("internal", f"{type(exc).__name__}: {exc}")
        return p2p_proto.P2PResponse(req.v, req.id, body)

    def _version_error(self, v: int, rid: int) -> p2p_proto.P2PResponse:
        self.unknown["version"] += 1
        versions = p2p_proto.P2P_VERSIONS
        self._log_once(f"v{v}", "a request of version %d (this node answers %s)", v, versions)
        return p2p_proto.P2PResponse(
            p2p_proto.P2P_PROTOCOL_VERSION,
            rid,
            p2p_proto.P2PError(
                "version",
                f"protocol version {v} is not one of {versions}",
                versions.lo,
                versions.hi,
            ),
        )

    def _unknown_operation(self, v: int, rid: int, op: str) -> p2p_proto.P2PResponse:
        """Answered in the request's version: 1 knows no ``unknown_operation`` code."""
        self.unknown["operation"] += 1
        self._log_once(op, "an unknown operation %r (a newer peer's?)", op[:64])
        code: p2p_proto.P2PErrorCode = "unknown_operation" if v >= 2 else "invalid_input"
        return p2p_proto.P2PResponse(
            v, rid, p2p_proto.P2PError(code, f"unknown operation {op[:64]!r}")
        )

    def _log_once(self, name: str, msg: str, *args: object) -> None:
        if name in self._logged or len(self._logged) >= MAX_LOGGED_NAMES:
            return
        self._logged.add(name)
        log.warning("P2P channel %s answered " + msg, self.endpoint, *args)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None
        self._sock.close(0)


class _Conn:
    """One DEALER to the peer and the PAIR its monitor reports on."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], url: str) -> None:
        self.sock: zmq.Socket[bytes] = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IPV6, "[" in url)  # a peer advertising an IPv6 address
        self.monitor: zmq.Socket[bytes] = self.sock.get_monitor_socket(PEER_GONE_EVENTS)
        self.sock.connect(url)

    def gone(self) -> str:
        """The first peer-gone event the monitor holds ("" when none), without waiting."""
        while self.monitor.poll(0, zmq.POLLIN):
            event = zmq.utils.monitor.recv_monitor_message(self.monitor)
            if event["event"] & PEER_GONE_EVENTS:
                return str(zmq.Event(event["event"]).name)
        return ""

    def close(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self.sock.disable_monitor()
        self.monitor.close(0)
        self.sock.close(0)


class ChannelClient:
    """Requests to one peer's control channel; thread-safe (a socket per call)."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], url: str) -> None:
        self._ctx = ctx
        self.url = url
        self._ids = itertools.count(1)
        self._idle: list[_Conn] = []
        self._lock = threading.Lock()
        self._closed = False
        self.version = p2p_proto.P2P_PROTOCOL_VERSION
        """The version this peer is asked in: ours until it answers ``version``."""
        self.version_moves = 0

    def _take(self) -> _Conn:
        while True:
            with self._lock:
                conn = self._idle.pop() if self._idle else None
            if conn is None:
                return _Conn(self._ctx, self.url)
            if not conn.gone():
                return conn
            conn.close()  # it lost its connection while idle: a fresh one reconnects

    def _give_back(self, conn: _Conn) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < MAX_IDLE_SOCKETS:
                self._idle.append(conn)
                return
        conn.close()

    def call(
        self,
        body: p2p_proto.P2PRequestBody,
        timeout_s: float,
        abandon: threading.Event | None = None,
    ) -> p2p_proto.P2PResponseBody:
        """The peer's answer within ``timeout_s``; ChannelError otherwise (P2PError
        answers are raised too, as ``refused``; ``abandon`` set while waiting: as
        ``timeout``). A ``version`` answer moves this peer's version and asks again once."""
        deadline = time.monotonic() + timeout_s
        version = self.version
        answer = self._call(body, version, timeout_s, abandon)
        if isinstance(answer, p2p_proto.P2PError) and answer.code == "version":
            theirs = peer_range(answer.min_v, answer.max_v)
            common = highest_common(p2p_proto.P2P_VERSIONS, theirs)
            if common is not None and common != version:
                log.info(
                    "P2P peer %s answers versions %s: talking to it in %d (was %d)",
                    self.url,
                    theirs,
                    common,
                    version,
                )
                self.version = common
                self.version_moves += 1
                answer = self._call(body, common, deadline - time.monotonic(), abandon)
        if isinstance(answer, p2p_proto.P2PError):
            raise ChannelError(
                f"{self.url} refused: {answer.code}: {answer.message}", PeerFallback.REFUSED
            )
        return answer

    def _call(
        self,
        body: p2p_proto.P2PRequestBody,
        version: int,
        timeout_s: float,
        abandon: threading.Event | None,
    ) -> p2p_proto.P2PResponseBody:
        """One request in ``version`` and its answer (a P2PError too), or ChannelError."""
        if timeout_s <= 0:
            raise ChannelError(f"no time left to ask {self.url}", PeerFallback.TIMEOUT)
        rid = next(self._ids)
        conn = self._take()
        try:
            conn.sock.send_multipart(
                [b"", p2p_proto.encode(p2p_proto.P2PRequest(version, rid, body))],
                flags=zmq.NOBLOCK,
            )
            resp = p2p_proto.decode_response(self._wait(conn, body, timeout_s, abandon))
        except zmq.ZMQError as exc:
            conn.close()
            raise ChannelError(
                f"control channel to {self.url} failed: {exc}", PeerFallback.PEER_DEAD
            ) from exc
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            conn.close()
            raise ChannelError(f"{self.url} answered garbage: {exc}", PeerFallback.REFUSED) from exc
        except ChannelError:
            conn.close()
            raise
        if resp.id != rid:  # cannot happen with one request per socket; stay safe
            conn.close()
            raise ChannelError(
                f"{self.url} answered request {resp.id}, not {rid}", PeerFallback.REFUSED
            )
        self._give_back(conn)
        return resp.body

    def _wait(
        self,
        conn: _Conn,
        body: p2p_proto.P2PRequestBody,
        timeout_s: float,
        abandon: threading.Event | None,
    ) -> bytes:
        """The answer's payload, or ChannelError: ``timeout`` when ``timeout_s`` passes
        or ``abandon`` is set, ``peer_dead`` as soon as the monitor sees the connection
        refused or lost."""
        poller = zmq.Poller()
        poller.register(conn.sock, zmq.POLLIN)
        poller.register(conn.monitor, zmq.POLLIN)
        deadline = time.monotonic() + timeout_s
        while True:
            if abandon is not None and abandon.is_set():
                raise ChannelError(
                    f"{self.url} is down (its breaker opened while {type(body).__name__} waited)",
                    PeerFallback.TIMEOUT,
                )
            left_ms = int((deadline - time.monotonic()) * 1000)
            if abandon is not None:
                left_ms = min(left_ms, ABANDON_CHECK_MS)
            ready = dict(poller.poll(max(1, left_ms))) if left_ms > 0 else {}
            if conn.sock in ready:
                return conn.sock.recv_multipart(copy=True)[-1]
            if conn.monitor in ready:
                gone = conn.gone()
                if gone:
                    raise ChannelError(f"{self.url} is gone ({gone})", PeerFallback.PEER_DEAD)
                continue
            if time.monotonic() >= deadline:
                raise ChannelError(
                    f"{self.url} did not answer {type(body).__name__} within {timeout_s:.3f}s",
                    PeerFallback.TIMEOUT,
                )

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            with contextlib.suppress(zmq.ZMQError):
                conn.close()
