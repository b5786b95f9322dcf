"""The engine API transport: a ZeroMQ ROUTER on ``--host:--port`` and worker threads.

Owns the sockets and threads that move engine API messages (``kvatlas.wire.engine_proto``)
between engines and the EngineService. Layout: a ROUTER bound to tcp://host:port, a DEALER
on an inproc endpoint, ``zmq.proxy_steerable`` between them on its own thread, and
``workers`` threads with REP sockets on the inproc endpoint, each decoding a request,
calling the service and answering. Requests are thus served concurrently (a slow L2
promotion does not stall every engine); the service serializes store access with its
lock. Must not: interpret requests beyond decoding, or touch the chunk store.
"""

from __future__ import annotations

import errno
import logging
import secrets
import threading

import msgspec
import zmq

from kvatlas.core.errors import PortInUse
from kvatlas.runtime.auth import TokenGate
from kvatlas.server.engine_service import EngineService
from kvatlas.server.errors import ServerError
from kvatlas.wire.engine_proto import (
    PROTOCOL_VERSION,
    ErrorCode,
    ErrorReply,
    Response,
    ResponseBody,
    decode_envelope,
    decode_request,
    encode,
)

log = logging.getLogger(__name__)

_POLL_MS = 200


class EngineApi:
    """Bind, serve, stop. ``port`` 0 picks a free port (see ``bound_port``)."""

    def __init__(
        self,
        service: EngineService,
        host: str,
        port: int,
        *,
        workers: int = 4,
        auth_token: str | None = None,
    ) -> None:
        self._service = service
        self._gate = TokenGate(auth_token)
        self._host = host
        self._port = port
        self._workers_n = workers
        self._ctx = zmq.Context()
        self._backend_addr = f"inproc://kvatlas-engine-{secrets.token_hex(4)}"
        self._control_addr = self._backend_addr + "-control"
        self._frontend: zmq.Socket[bytes] | None = None
        self._backend: zmq.Socket[bytes] | None = None
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()
        self.bound_port = port

    def start(self) -> None:
        """Bind (PortInUse when taken) and start the proxy and worker threads."""
        frontend = self._ctx.socket(zmq.ROUTER)
        frontend.setsockopt(zmq.LINGER, 0)
        try:
            if self._port == 0:
                self.bound_port = frontend.bind_to_random_port(f"tcp://{self._host}")
            else:
                frontend.bind(f"tcp://{self._host}:{self._port}")
        except zmq.ZMQError as exc:
            frontend.close()
            if exc.errno == errno.EADDRINUSE:
                raise PortInUse("engine API", self._host, self._port, "--port") from exc
            raise ServerError(
                f"cannot bind the engine API on {self._host}:{self._port} (--host/--port): {exc}"
            ) from exc
        backend = self._ctx.socket(zmq.DEALER)
        backend.setsockopt(zmq.LINGER, 0)
        backend.bind(self._backend_addr)
        self._frontend, self._backend = frontend, backend
        ready = threading.Barrier(self._workers_n + 1)
        for i in range(self._workers_n):
            t = threading.Thread(
                target=self._work, args=(ready,), name=f"kvatlas-engine-{i}", daemon=True
            )
            t.start()
            self._threads.append(t)
        ready.wait()
        proxy = threading.Thread(target=self._proxy, name="kvatlas-engine-proxy", daemon=True)
        proxy.start()
        self._threads.append(proxy)
        log.info(
            "engine API on tcp://%s:%d with %d workers (instance %s incarnation %d)",
            self._host,
            self.bound_port,
            self._workers_n,
            self._service.identity.instance_id,
            self._service.identity.incarnation,
        )

    def _proxy(self) -> None:
        control = self._ctx.socket(zmq.PAIR)
        control.bind(self._control_addr)
        assert self._frontend is not None and self._backend is not None
        try:
            zmq.proxy_steerable(self._frontend, self._backend, None, control)
        except zmq.ContextTerminated:
            pass
        finally:
            control.close(0)

    def _work(self, ready: threading.Barrier) -> None:
        sock = self._ctx.socket(zmq.REP)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self._backend_addr)
        ready.wait()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not poller.poll(_POLL_MS):
                    continue
                frame = sock.recv(copy=False)
                sock.send(self._answer(frame.buffer))
        finally:
            sock.close(0)

    def _answer(self, data: memoryview) -> bytes:
        try:
            req = decode_request(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            env = decode_envelope(data)
            code: ErrorCode = "invalid_input"
            msg = f"malformed engine request: {exc}"
            if env.v and env.v != PROTOCOL_VERSION:
                code = "version"
                msg = (
                    f"engine protocol version {env.v} is not supported; this server speaks"
                    f" {PROTOCOL_VERSION}"
                )
            return encode(Response(PROTOCOL_VERSION, env.id, ErrorReply(code, msg)))
        if req.v != PROTOCOL_VERSION:
            body: ResponseBody = ErrorReply(
                "version",
                f"engine protocol version {req.v} is not supported; this server speaks"
                f" {PROTOCOL_VERSION}",
            )
        elif not self._gate.check(req.token):
            body = ErrorReply(
                "unauthorized", "this cache server requires its --auth-token on engine requests"
            )
        else:
            body = self._service.handle(req.body)
        return encode(Response(PROTOCOL_VERSION, req.id, body))

    def stop(self) -> None:
        """Stop the workers and the proxy, close the sockets (idempotent)."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._frontend is not None:
            control = self._ctx.socket(zmq.PAIR)
            control.connect(self._control_addr)
            control.send(b"TERMINATE")
            control.close(0)
        for t in self._threads:
            t.join(5)
        for sock in (self._frontend, self._backend):
            if sock is not None:
                sock.close(0)
        self._ctx.term()
