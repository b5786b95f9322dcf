"""The P2P control channel over ZeroMQ: the owner's ROUTER and the requester's DEALERs.

Owns the sockets and the request/answer matching of ``kvatlas.wire.p2p_proto``:

- ``ChannelServer`` binds a ROUTER on the listen URL (``--p2p-listen-url``) and answers
  each request with ``handler(body)`` in one thread that polls with a timeout (it never
  spins, and stops within one poll interval). Handlers are short: they take the engine
  lock only to lock or release chunks.
- ``ChannelClient`` talks to one peer through a small pool of DEALER sockets (one request
  in flight per socket). A call waits at most its timeout (derived from the lookup
  deadline by the caller); a socket whose answer did not come in time is closed, never
  reused, so a late answer cannot be mistaken for the next one.

Must not: know what the messages mean (the P2P service does) or touch the chunk store.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
from collections.abc import Callable
from typing import Final

import msgspec
import zmq

from kvatlas.core.errors import PortInUse
from kvatlas.server.errors import ServerError
from kvatlas.wire import p2p_proto
from kvatlas.wire.engine_proto import PeerFallback

log = logging.getLogger(__name__)

POLL_MS: Final = 200
"""How often the owner's loop looks at its stop flag while idle."""
MAX_IDLE_SOCKETS: Final = 4


class ChannelError(ServerError):
    """A control request to a peer failed; ``cause`` is timeout, peer_dead or refused."""

    def __init__(self, message: str, cause: PeerFallback) -> None:
        super().__init__(message)
        self.cause = cause


Handler = Callable[[p2p_proto.P2PRequestBody], p2p_proto.P2PResponseBody]


class ChannelServer:
    """The owner's ROUTER; ``start()`` binds (PortInUse when taken), ``stop()`` joins."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], host: str, port: int) -> None:
        self._sock: zmq.Socket[bytes] = ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            self._sock.bind(f"tcp://{host}:{port}")
        except zmq.ZMQError as exc:
            self._sock.close(0)
            if exc.errno == zmq.EADDRINUSE:
                raise PortInUse("P2P control", host, port, "--p2p-listen-url") from exc
            raise ServerError(
                f"cannot bind the P2P control channel on {host}:{port}: {exc}"
            ) from exc
        self.host = host
        self.port = port
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.requests = 0
        self.errors = 0

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
            env = p2p_proto.decode_envelope(payload)
            code: p2p_proto.P2PErrorCode = (
                "version" if env.v != p2p_proto.P2P_PROTOCOL_VERSION else "invalid_input"
            )
            return p2p_proto.P2PResponse(
                p2p_proto.P2P_PROTOCOL_VERSION,
                env.id,
                p2p_proto.P2PError(code, f"bad request: {exc}"),
            )
        if req.v != p2p_proto.P2P_PROTOCOL_VERSION:
            self.errors += 1
            return p2p_proto.P2PResponse(
                p2p_proto.P2P_PROTOCOL_VERSION,
                req.id,
                p2p_proto.P2PError(
                    "version", f"protocol version {req.v} is not {p2p_proto.P2P_PROTOCOL_VERSION}"
                ),
            )
        try:
            body = handler(req.body)
        except Exception as exc:
            self.errors += 1
            log.exception("P2P request %s failed", type(req.body).__name__)
            body = p2p_proto.P2PError("internal", f"{type(exc).__name__}: {exc}")
        return p2p_proto.P2PResponse(p2p_proto.P2P_PROTOCOL_VERSION, req.id, body)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None
        self._sock.close(0)


class ChannelClient:
    """Requests to one peer's control channel; thread-safe (a socket per call)."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], url: str) -> None:
        self._ctx = ctx
        self.url = url
        self._ids = itertools.count(1)
        self._idle: list[zmq.Socket[bytes]] = []
        self._lock = threading.Lock()
        self._closed = False

    def _take(self) -> zmq.Socket[bytes]:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.url)
        return sock

    def _give_back(self, sock: zmq.Socket[bytes]) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < MAX_IDLE_SOCKETS:
                self._idle.append(sock)
                return
        sock.close(0)

    def call(self, body: p2p_proto.P2PRequestBody, timeout_s: float) -> p2p_proto.P2PResponseBody:
        """The peer's answer within ``timeout_s``; ChannelError otherwise (P2PError
        answers are raised too, as ``refused``)."""
        if timeout_s <= 0:
            raise ChannelError(f"no time left to ask {self.url}", PeerFallback.TIMEOUT)
        rid = next(self._ids)
        sock = self._take()
        try:
            sock.send_multipart(
                [
                    b"",
                    p2p_proto.encode(
                        p2p_proto.P2PRequest(p2p_proto.P2P_PROTOCOL_VERSION, rid, body)
                    ),
                ],
                flags=zmq.NOBLOCK,
            )
            if not sock.poll(max(1, int(timeout_s * 1000)), zmq.POLLIN):
                raise ChannelError(
                    f"{self.url} did not answer {type(body).__name__} within {timeout_s:.3f}s",
                    PeerFallback.TIMEOUT,
                )
            resp = p2p_proto.decode_response(sock.recv_multipart(copy=True)[-1])
        except zmq.ZMQError as exc:
            sock.close(0)
            raise ChannelError(
                f"control channel to {self.url} failed: {exc}", PeerFallback.PEER_DEAD
            ) from exc
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            sock.close(0)
            raise ChannelError(f"{self.url} answered garbage: {exc}", PeerFallback.REFUSED) from exc
        except ChannelError:
            sock.close(0)
            raise
        if resp.id != rid:  # cannot happen with one request per socket; stay safe
            sock.close(0)
            raise ChannelError(
                f"{self.url} answered request {resp.id}, not {rid}", PeerFallback.REFUSED
            )
        self._give_back(sock)
        if isinstance(resp.body, p2p_proto.P2PError):
            raise ChannelError(
                f"{self.url} refused: {resp.body.code}: {resp.body.message}",
                PeerFallback.REFUSED,
            )
        return resp.body

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for sock in idle:
            with contextlib.suppress(zmq.ZMQError):
                sock.close(0)
