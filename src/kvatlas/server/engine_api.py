"""The engine API transport: a ZeroMQ ROUTER on ``--host:--port`` and worker threads.

Owns the sockets and threads that move engine API messages (``kvatlas.wire.engine_proto``)
between engines and the EngineService. Layout: a ROUTER bound to tcp://host:port read and
written by one I/O thread, a queue of requests, and worker threads that decode a request,
call the service and hand the answer back to the I/O thread through an inproc PULL socket
(ZeroMQ sockets are not thread-safe, so only the I/O thread touches the ROUTER). Requests
are thus served concurrently, and by whichever worker is free: a REP-per-worker proxy
would deal requests round-robin, so a local hit could queue behind a worker busy waiting
on a peer. There are ``workers`` threads for local work plus ``p2p_workers`` more, as many
as the service lends to peer fetches at once (``EngineService`` refuses a fetch beyond
them), so that with every P2P slot busy, local hits, stores, reserves and releases still
find a free worker at once. The service serializes store access with its lock. A
message over ``MAX_MESSAGE_BYTES`` is refused by ZeroMQ from its size header (the sender
is disconnected) before anything of it is buffered or its token checked.

Requests held in process (queued or being served) are bounded: at most ``max_queued`` in
all and ``max_queued_per_client`` per ROUTER identity (one engine socket). The I/O thread
answers one beyond either bound at once with ``ErrorReply(code="overloaded")``, before
any worker sees it (so it changed nothing), counts it and logs at most once per
``_LOG_EVERY_S``. Only the I/O thread admits and releases, so the counts need no lock: a
request counts from its admission until its answer passes back through the I/O thread.
The per-client bound keeps one flooding socket from filling the whole queue, so other
engines' local hits still wait behind at most ``max_queued_per_client`` of its requests.
ZeroMQ's own buffer of messages not yet taken is as deep per socket (its receive
high-water mark), so a socket sending faster than the I/O thread reads is slowed by TCP.
A second protocol may share the ROUTER (``second``: LMCache's MP protocol, see
``kvatlas.server.lmcache_mp.transport``): the I/O thread asks it whether it ``claims`` a
request by its framing; claimed requests are admitted under the same bounds, and a
worker has it ``answer`` them (exactly one reply each, so the held counts balance).

Versions (`wire.versions`): a worker answers a request of a version in
``ENGINE_VERSIONS`` in that version and any other with a ``version`` error naming the
range; an operation it does not know (a newer engine's) is answered ``unknown_operation``
at once. Both are counted (``EngineApiStats.unknown``) and the first of each name logged.

Must not: interpret requests beyond decoding, or touch the chunk store.
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import msgspec
import zmq

from kvatlas.runtime.auth import TokenGate
from kvatlas.runtime.zmq_sockets import bind_router
from kvatlas.server.engine_service import ServiceIdentity
from kvatlas.wire.decoding import decode_head
from kvatlas.wire.engine_proto import (
    ENGINE_VERSIONS,
    OPERATIONS,
    PROTOCOL_VERSION,
    ErrorCode,
    ErrorReply,
    RequestBody,
    Response,
    ResponseBody,
    decode_envelope,
    decode_request,
    encode,
)

log = logging.getLogger(__name__)

_POLL_MS = 200
_POLL_S = _POLL_MS / 1000

MAX_MESSAGE_BYTES = 16 * 2**20
"""The largest engine request read: a `Lookup` of a few million token ids (the largest
legitimate ones are a few MB; KV bytes never travel here)."""

_MAX_LOGGED_NAMES = 32
"""Unknown operations and versions logged by name (once each); later ones only counted."""

_LOG_EVERY_S = 10.0
"""At most one overload warning per this many seconds (a flood must not flood the log)."""


class EngineHandler(Protocol):
    """What the API asks of its service (an ``EngineService``): whose answers they are,
    and the answer to one decoded request (on a worker thread)."""

    @property
    def identity(self) -> ServiceIdentity: ...

    def handle(self, body: RequestBody) -> ResponseBody: ...


class SecondProtocol(Protocol):
    """Another protocol on the engine API's ROUTER, told apart by its framing."""

    def claims(self, frames: Sequence[zmq.Frame]) -> bool:
        """Whether ``[identity, ...]`` is this protocol's (I/O thread; no decoding)."""
        ...

    def expects_reply(self, frames: Sequence[zmq.Frame]) -> bool:
        """False for a claimed message that wants no answer (it is dropped)."""
        ...

    def drop(self, frames: Sequence[zmq.Frame]) -> None:
        """Count a claimed message that wants no answer (I/O thread)."""
        ...

    def answer(self, frames: Sequence[zmq.Frame]) -> list[bytes]:
        """The reply frames, identity first (worker thread); never raises."""
        ...

    def overloaded(self, frames: Sequence[zmq.Frame], reason: str) -> list[bytes]:
        """The at-once reply to a request the queue bounds refuse (I/O thread)."""
        ...


@dataclass(frozen=True, slots=True)
class EngineApiStats:
    """What the engine API's I/O thread counted (a snapshot)."""

    queued: int
    """Requests held now: admitted and not yet answered."""
    clients_queued: int
    """Engine sockets (ROUTER identities) with requests held now."""
    overloaded: int
    """Requests answered ``overloaded`` since start: a bound was full."""
    unknown: tuple[tuple[str, int], ...] = ()
    """Requests not read since start, by what: ``version`` (one outside
    ``ENGINE_VERSIONS``), ``operation`` (an operation this server does not know)."""


class EngineApi:
    """Bind, serve, stop. ``port`` 0 picks a free port (see ``bound_port``)."""

    def __init__(
        self,
        service: EngineHandler,
        host: str,
        port: int,
        *,
        workers: int = 4,
        p2p_workers: int = 0,
        max_queued: int = 1024,
        max_queued_per_client: int = 64,
        auth_token: str | None = None,
        second: SecondProtocol | None = None,
    ) -> None:
        """``p2p_workers``: extra threads for lookups that wait on peers (the service's
        P2P slots); ``workers`` stay for local work. ``max_queued`` and
        ``max_queued_per_client``: the bounds on requests held at once, in all and per
        engine socket."""
        self._service = service
        self._second = second
        self._gate = TokenGate(auth_token)
        self._host = host
        self._port = port
        self._workers_n = workers + p2p_workers
        self._ctx = zmq.Context()
        self._replies_addr = f"inproc://kvatlas-engine-{secrets.token_hex(4)}"
        self._frontend: zmq.Socket[bytes] | None = None
        self._replies: zmq.Socket[bytes] | None = None
        self._jobs: queue.SimpleQueue[list[zmq.Frame]] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()
        self.closed = threading.Event()
        """Set once the sockets are closed (by stop, or after it when a thread was busy)."""
        self._max_queued = max_queued
        self._max_per_client = max_queued_per_client
        # Written by the I/O thread only; stats() reads them without a lock (ints).
        self._held: Counter[bytes] = Counter()
        self._queued = 0
        self._clients = 0
        self._overloaded = 0
        self._overloaded_logged = 0
        self._next_log = 0.0
        # Written by the workers under _unknown_lock; the keys exist up front, so that
        # stats() copies the dict while a worker counts.
        self._unknown: Counter[str] = Counter(version=0, operation=0)
        self._unknown_lock = threading.Lock()
        self._logged: set[str] = set()
        self.bound_port = port
        self.endpoint = ""
        """What the socket bound, as ZeroMQ reports it (``tcp://127.0.0.1:6555``), once
        started."""

    def start(self) -> None:
        """Bind (PortInUse when taken) and start the I/O and worker threads."""
        bound = bind_router(
            self._ctx,
            self._host,
            self._port,
            what="engine API",
            flag="--port",
            max_message_bytes=MAX_MESSAGE_BYTES,
            # ZeroMQ's own buffer of messages read but not yet taken, per engine socket:
            # no deeper than what that socket may hold in the queue (TCP pushes back
            # beyond it).
            recv_hwm=self._max_per_client,
        )
        frontend, self.bound_port, self.endpoint = bound.socket, bound.port, bound.endpoint
        replies = self._ctx.socket(zmq.PULL)
        replies.setsockopt(zmq.LINGER, 0)
        replies.bind(self._replies_addr)  # before the workers connect their PUSH sockets
        self._frontend, self._replies = frontend, replies
        for i in range(self._workers_n):
            t = threading.Thread(target=self._work, name=f"kvatlas-engine-{i}", daemon=True)
            t.start()
            self._threads.append(t)
        io = threading.Thread(target=self._io, name="kvatlas-engine-io", daemon=True)
        io.start()
        self._threads.append(io)
        log.info(
            "engine API on %s with %d workers (instance %s incarnation %d)",
            self.endpoint,
            self._workers_n,
            self._service.identity.instance_id,
            self._service.identity.incarnation,
        )

    def _io(self) -> None:
        """The one thread on the ROUTER: requests into the queue, answers out."""
        frontend, replies = self._frontend, self._replies
        assert frontend is not None and replies is not None
        poller = zmq.Poller()
        poller.register(frontend, zmq.POLLIN)
        poller.register(replies, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(_POLL_MS))
                if frontend in ready:
                    while True:
                        try:
                            frames = frontend.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        second = self._second
                        if (
                            second is not None
                            and second.claims(frames)
                            and not second.expects_reply(frames)
                        ):
                            second.drop(frames)
                        elif self._admit(frames[0].bytes):
                            self._jobs.put(frames)
                        elif second is not None and second.claims(frames):
                            frontend.send_multipart(self._overload_refusal(frames))
                        else:
                            frontend.send_multipart(self._overload_answer(frames))
                if replies in ready:
                    while True:
                        try:
                            answer = replies.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._done(answer[0])
                        frontend.send_multipart(answer)
        except zmq.ContextTerminated:
            pass

    def _admit(self, client: bytes) -> bool:
        """Count one more request of ``client`` held, unless a bound is full (I/O thread)."""
        held = self._held[client]
        if self._queued >= self._max_queued or held >= self._max_per_client:
            return False
        self._held[client] = held + 1
        self._queued += 1
        self._clients = len(self._held)
        return True

    def _done(self, client: bytes) -> None:
        """``client``'s request was answered (I/O thread)."""
        self._queued -= 1
        left = self._held[client] - 1
        if left > 0:
            self._held[client] = left
        else:
            del self._held[client]  # identities come and go: keep only those holding some
        self._clients = len(self._held)

    def _overload_refusal(self, frames: list[zmq.Frame]) -> list[bytes]:
        """The second protocol's at-once answer to a request that does not fit."""
        assert self._second is not None
        self._overloaded += 1
        reason = (
            f"the cache server holds {self._queued} requests (--engine-max-queued"
            f" {self._max_queued}, --engine-max-queued-per-client {self._max_per_client})"
        )
        return self._second.overloaded(frames, reason)

    def _overload_answer(self, frames: list[zmq.Frame]) -> list[bytes]:
        """The at-once answer to a request that does not fit (I/O thread): count, log
        now and then, and answer with the request's id so the engine can match it."""
        self._overloaded += 1
        now = time.monotonic()
        if now >= self._next_log:
            self._next_log = now + _LOG_EVERY_S
            log.warning(
                "engine API overloaded: %d requests refused (%d since the last warning),"
                " %d held of --engine-max-queued %d, engine socket %s holds %d of"
                " --engine-max-queued-per-client %d (instance %s incarnation %d)",
                self._overloaded,
                self._overloaded - self._overloaded_logged,
                self._queued,
                self._max_queued,
                frames[0].bytes.hex(),
                self._held[frames[0].bytes],
                self._max_per_client,
                self._service.identity.instance_id,
                self._service.identity.incarnation,
            )
            self._overloaded_logged = self._overloaded
        env = decode_envelope(frames[-1].buffer)
        body = ErrorReply(
            "overloaded",
            f"the cache server holds {self._queued} engine requests"
            f" (--engine-max-queued {self._max_queued}, --engine-max-queued-per-client"
            f" {self._max_per_client}); recompute, or retry later",
        )
        envelope = [f.bytes for f in frames[:-1]]
        return [*envelope, encode(Response(PROTOCOL_VERSION, env.id, body))]

    def stats(self) -> EngineApiStats:
        return EngineApiStats(
            self._queued, self._clients, self._overloaded, tuple(sorted(self._unknown.items()))
        )

    def _work(self) -> None:
        push = self._ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(self._replies_addr)
        try:
            while not self._stop.is_set():
                try:
                    frames = self._jobs.get(timeout=_POLL_S)
                except queue.Empty:
                    continue
                if self._second is not None and self._second.claims(frames):
                    push.send_multipart(self._second.answer(frames))
                    continue
                envelope = [f.bytes for f in frames[:-1]]  # the engine's identity, b""
                push.send_multipart([*envelope, self._answer(frames[-1].buffer)])
        finally:
            push.close(0)

    def _answer(self, data: memoryview) -> bytes:
        try:
            req = decode_request(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            head = decode_head(data)
            if head.v and not ENGINE_VERSIONS.supports(head.v):
                return encode(self._version_error(head.v, head.id))
            code: ErrorCode = "invalid_input"
            msg = f"malformed engine request: {exc}"
            if head.op and head.op not in OPERATIONS:
                self._count("operation", head.op, "an unknown operation %r (a newer engine's?)")
                # 1's decoder knows no unknown_operation code
                code = "unknown_operation" if head.v >= 2 else "invalid_input"
                msg = f"unknown operation {head.op[:64]!r}"
            v = head.v if head.v else PROTOCOL_VERSION
            return encode(Response(v, head.id, ErrorReply(code, msg)))
        if not ENGINE_VERSIONS.supports(req.v):
            return encode(self._version_error(req.v, req.id))
        if not self._gate.check(req.token):
            body: ResponseBody = ErrorReply(
                "unauthorized", "this cache server requires its --auth-token on engine requests"
            )
        else:
            body = self._service.handle(req.body)
        return encode(Response(req.v, req.id, body))

    def _version_error(self, v: int, rid: int) -> Response:
        self._count("version", f"v{v}", "a request of version %s", v)
        return Response(
            PROTOCOL_VERSION,
            rid,
            ErrorReply(
                "version",
                f"engine protocol version {v} is not supported; this server speaks"
                f" {ENGINE_VERSIONS}",
                ENGINE_VERSIONS.lo,
                ENGINE_VERSIONS.hi,
            ),
        )

    def _count(self, what: str, name: str, msg: str, arg: object = None) -> None:
        """Count a request not read (a worker); log the first of each ``name``."""
        with self._unknown_lock:
            self._unknown[what] += 1
            if name in self._logged or len(self._logged) >= _MAX_LOGGED_NAMES:
                return
            self._logged.add(name)
        log.warning(
            "engine API of instance %s answered " + msg + " (it answers versions %s)",
            self._service.identity.instance_id,
            name[:64] if arg is None else arg,
            ENGINE_VERSIONS,
        )

    def stop(self) -> None:
        """Stop the workers and the I/O thread, close the sockets (idempotent). Returns
        within ~5 s a thread: a thread still busy then (a request that does not return)
        leaves the sockets to be closed when it is done."""
        if self._stop.is_set():
            return
        self._stop.set()
        for t in self._threads:
            t.join(5)
        stuck = [t.name for t in self._threads if t.is_alive()]
        if stuck:
            # Terminating the context waits for every socket, the stuck threads' too:
            # stop returns now, and the sockets are closed once those threads are done.
            log.warning(
                "engine API of instance %s incarnation %d: %s still busy after 5 s at"
                " shutdown; its sockets close when they finish",
                self._service.identity.instance_id,
                self._service.identity.incarnation,
                ", ".join(stuck),
            )
            threading.Thread(target=self._close_after_threads, daemon=True).start()
            return
        self._close()

    def _close_after_threads(self) -> None:
        for t in self._threads:
            t.join()
        self._close()

    def _close(self) -> None:
        for sock in (self._frontend, self._replies):
            if sock is not None:
                sock.close(0)
        self._ctx.term()
        self.closed.set()
