"""The built-in ``tcp`` transport: a threaded TCP server on the owner, pooled connections on
the requester, no copy through Python bytes on either side.

Wire, per request (the requester pipelines up to ``PIPELINE`` of them on a connection):

    request  = u32 length (big endian) + msgpack [peer_id, token, lease_id, offset, size, v]
    response = ">BIQ" status, message length, data length + message + data

Versions (`wire.versions`): ``v`` is left out at 1, so a version 1 request is the first
release's five-element array to the byte, and msgspec skips trailing elements a newer requester
adds. The owner advertises the versions it reads in its endpoint's ``extra``
(``WIRE_VERSIONS_KEY``; none: the first release, 1) and a requester asks in the highest
common one, so there is no round trip to negotiate; a request of a version the owner does
not read is refused with a reason, never read as something it is not. There is one
operation (read a range), so there is no unknown one to skip.

The owner checks the token, the region bounds and ``authorize(peer, lease, offset, size)``
for every request (``enforces_leases``) and sends header and data with one ``sendmsg``
of a memoryview of the region. The requester ``recv_into``s a memoryview slice of its
own region slot directly and verifies the checksum. Socket timeouts follow the remaining
deadline; a connection that timed out or failed is closed, never pooled again.

The owner gives a connection a thread only once its first request has arrived and
carried the token: until then the accept thread holds it in a selector, for at most
``TcpConfig.first_request_s``, and it counts against ``TcpConfig.max_connections``
(one more is closed at accept). A served connection idle for
``TcpConfig.idle_timeout_s`` is closed.

Must not: bind anything the config does not name, or read outside the owner's region.
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import msgspec

from kvatlas.core.checksum import checksum_stream
from kvatlas.runtime.auth import TokenGate
from kvatlas.runtime.net import tcp_family
from kvatlas.transfer.base import (
    Authorizer,
    ConfiguredClient,
    Deadline,
    Endpoint,
    FaultCounter,
    FaultPlan,
    LocalMemory,
    PeerConnection,
    ReadOp,
    ReadResult,
    ReadStatus,
    TransferServer,
    flip_first_byte,
)
from kvatlas.transfer.config import TcpConfig
from kvatlas.transfer.errors import EndpointMismatch, TransportUnavailable
from kvatlas.wire.versions import FIRST_RELEASE, VersionRange, highest_common

log = logging.getLogger(__name__)

TRANSPORT = "tcp"
PIPELINE = 32
"""Requests in flight per connection: enough to hide the round trip, small enough that
the request bytes never fill the socket buffers while the owner is blocked sending."""
MAX_IDLE = 4
"""Idle connections kept per peer."""
_RESP = struct.Struct(">BIQ")
_LEN = struct.Struct(">I")
_MAX_REQUEST = 64 * 1024
_ST_OK, _ST_REFUSED = 0, 1
TCP_WIRE_VERSION = 1
"""The newest data plane version; the owner reads ``TCP_VERSIONS``."""
TCP_VERSIONS = VersionRange.upto(TCP_WIRE_VERSION)
WIRE_VERSIONS_KEY = "wire_versions"
"""The endpoint ``extra`` key of the versions an owner reads, as ``"lo-hi"``."""


def advertised_versions(endpoint: Endpoint) -> VersionRange:
    """What an owner's endpoint says it reads; `FIRST_RELEASE` when it says nothing."""
    text = endpoint.extra.get(WIRE_VERSIONS_KEY, "")
    lo, _, hi = text.partition("-")
    if not (lo.isdigit() and hi.isdigit()):
        return FIRST_RELEASE
    return VersionRange(int(lo), int(hi))


class _Request(msgspec.Struct, array_like=True, frozen=True):
    peer_id: str
    token: str
    lease_id: str
    offset: int
    size: int
    v: int = 1


_encode = msgspec.msgpack.Encoder().encode


def _request(peer_id: str, token: str, lease_id: str, offset: int, size: int, *, v: int) -> bytes:
    """A request's msgpack: at version 1 the first release's five elements exactly."""
    if v == 1:
        return _encode((peer_id, token, lease_id, offset, size))
    return _encode((peer_id, token, lease_id, offset, size, v))


_decode = msgspec.msgpack.Decoder(_Request).decode


@dataclass
class _Pending:
    """A connection accepted but not yet given a thread: its bytes so far."""

    deadline: float
    buf: bytearray


def _recv_exact(sock: socket.socket, view: memoryview, deadline: Deadline) -> None:
    """Fill ``view`` from ``sock``; socket.timeout at the deadline, EOFError on close."""
    got, n = 0, len(view)
    while got < n:
        remaining = deadline.remaining()
        if remaining <= 0:
            raise TimeoutError("deadline passed")
        sock.settimeout(remaining)
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise EOFError("peer closed the connection")
        got += k


def _recv_hashing(sock: socket.socket, view: memoryview, deadline: Deadline) -> int:
    """``_recv_exact`` that hashes each piece right after it lands (still in cache)."""
    hasher = checksum_stream()
    got, n = 0, len(view)
    while got < n:
        remaining = deadline.remaining()
        if remaining <= 0:
            raise TimeoutError("deadline passed")
        sock.settimeout(remaining)
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise EOFError("peer closed the connection")
        hasher.update(view[got : got + k])
        got += k
    return hasher.intdigest()


def _sendmsg_all(sock: socket.socket, parts: list[memoryview]) -> None:
    while parts:
        sent = sock.sendmsg(parts)
        while parts and sent >= len(parts[0]):
            sent -= len(parts[0])
            parts.pop(0)
        if parts and sent:
            parts[0] = parts[0][sent:]


# ------------------------------------------------------------------------------ server


class TcpServer(TransferServer):
    transport: ClassVar[str] = TRANSPORT
    enforces_leases: ClassVar[bool] = True

    def __init__(
        self,
        region: LocalMemory,
        authorize: Authorizer,
        *,
        token: str | None = None,
        faults: FaultPlan | None = None,
        config: TcpConfig | None = None,
    ) -> None:
        self._region = region
        self._authorize = authorize
        self._gate = TokenGate(token)
        self._faults = FaultCounter(faults)
        self._config = config or TcpConfig()
        self._listener: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._stopping = threading.Event()

    def start(self) -> Endpoint:
        if self._listener is not None:
            raise TransportUnavailable("tcp transfer server already started")
        cfg = self._config
        try:
            listener = socket.create_server(
                (cfg.host.strip("[]"), cfg.port), family=tcp_family(cfg.host), backlog=64
            )
        except OSError as exc:
            raise TransportUnavailable(f"cannot listen on {cfg.host}:{cfg.port}: {exc}") from exc
        self._listener = listener
        port = listener.getsockname()[1]
        thread = threading.Thread(target=self._accept_loop, name="kvatlas-tcp-accept", daemon=True)
        thread.start()
        self._threads.append(thread)
        host = (cfg.advertise_host or cfg.host).strip("[]")
        host = f"[{host}]" if ":" in host else host
        return Endpoint(
            transport=TRANSPORT,
            url=f"tcp://{host}:{port}",
            region_size=self._region.size,
            extra={WIRE_VERSIONS_KEY: f"{TCP_VERSIONS.lo}-{TCP_VERSIONS.hi}"},
        )

    def stop(self) -> None:
        self._stopping.set()
        listener, self._listener = self._listener, None
        if listener is not None:
            # shutdown() wakes a thread blocked in accept(); close() alone does not.
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        for thread in self._threads:
            thread.join(timeout=5)
        self._threads.clear()

    def _accept_loop(self) -> None:
        listener = self._listener
        assert listener is not None
        cfg = self._config
        pending: dict[socket.socket, _Pending] = {}
        with selectors.DefaultSelector() as sel:
            try:
                # Inside the try: a stop() right after start() may close it first.
                sel.register(listener, selectors.EVENT_READ)
                while not self._stopping.is_set():
                    for key, _ in sel.select(timeout=min(0.5, cfg.first_request_s)):
                        if key.fileobj is listener:
                            conn = self._accept(listener)
                            if conn is None:
                                continue
                            with self._lock:
                                full = len(self._conns) + len(pending) >= cfg.max_connections
                            if full:
                                log.warning(
                                    "tcp transfer: %d connections open, closing a new one",
                                    cfg.max_connections,
                                )
                                conn.close()
                                continue
                            conn.setblocking(False)
                            deadline = time.monotonic() + cfg.first_request_s
                            pending[conn] = _Pending(deadline, bytearray())
                            sel.register(conn, selectors.EVENT_READ)
                        else:
                            assert isinstance(key.fileobj, socket.socket)
                            conn = key.fileobj
                            if self._first_bytes(conn, pending[conn]) is not None:
                                sel.unregister(conn)
                                del pending[conn]
                    now = time.monotonic()
                    for conn in [c for c, p in pending.items() if p.deadline <= now]:
                        sel.unregister(conn)
                        del pending[conn]
                        conn.close()
            except (OSError, ValueError):
                return  # stop() closed the listener
            finally:
                for conn in pending:
                    conn.close()

    def _accept(self, listener: socket.socket) -> socket.socket | None:
        try:
            conn, _ = listener.accept()
        except BlockingIOError:
            return None
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn

    def _first_bytes(self, conn: socket.socket, p: _Pending) -> bool | None:
        """Read what a pending connection sent; None while its first request is still
        incomplete, else done with it: True when it got a thread, False when closed."""
        try:
            chunk = conn.recv(_LEN.size + _MAX_REQUEST - len(p.buf))
        except BlockingIOError:
            return None
        except OSError:
            chunk = b""
        p.buf += chunk
        n = _LEN.unpack_from(p.buf)[0] if len(p.buf) >= _LEN.size else 0
        incomplete = len(p.buf) < _LEN.size or (n <= _MAX_REQUEST and len(p.buf) < _LEN.size + n)
        if chunk and incomplete:
            return None
        req = None
        if chunk and n <= _MAX_REQUEST:
            with contextlib.suppress(msgspec.DecodeError):
                req = _decode(memoryview(p.buf)[_LEN.size : _LEN.size + n])
        if req is None or not self._gate.check(req.token):
            if req is not None:
                msg = b"bad auth token"
                with contextlib.suppress(OSError):
                    conn.sendall(_RESP.pack(_ST_REFUSED, len(msg), 0) + msg)
            conn.close()
            return False
        conn.setblocking(True)
        rest = bytes(p.buf[_LEN.size + n :])
        with self._lock:
            self._conns.add(conn)
            # Finished handlers are pruned here so the list stays as long as the pool.
            self._threads = [t for t in self._threads if t.is_alive()]
            thread = threading.Thread(
                target=self._serve, args=(conn, req, rest), name="kvatlas-tcp-conn", daemon=True
            )
            self._threads.append(thread)
        thread.start()
        return True

    def _serve(self, conn: socket.socket, first: _Request, rest: bytes) -> None:
        region = self._region.buffer
        head = bytearray(_LEN.size)
        body = bytearray(_MAX_REQUEST)
        reader = _Reader(conn, rest)
        req: _Request | None = first
        try:
            conn.settimeout(self._config.idle_timeout_s)
            while True:
                if req is None:
                    if not reader.fill(memoryview(head)):
                        return
                    (n,) = _LEN.unpack(head)
                    if n > _MAX_REQUEST or not reader.fill(memoryview(body)[:n]):
                        return
                    try:
                        req = _decode(memoryview(body)[:n])
                    except msgspec.DecodeError:
                        log.warning("tcp transfer: undecodable request, closing connection")
                        return
                reason = self._refusal(req)
                if reason:
                    req = None
                    msg = reason.encode()
                    conn.sendall(_RESP.pack(_ST_REFUSED, len(msg), 0) + msg)
                    continue
                offset, size, req = req.offset, req.size, None
                with region[offset : offset + size] as data:
                    parts = [memoryview(_RESP.pack(_ST_OK, 0, size)), data]
                    if self._faults.corrupt_next():
                        parts[1] = bad = memoryview(bytearray(data))
                        flip_first_byte(bad)
                    _sendmsg_all(conn, parts)
        except OSError:
            return  # the requester went away, was idle too long, or stop() shut it down
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _refusal(self, req: _Request) -> str:
        if not self._gate.check(req.token):
            return "bad auth token"
        if not TCP_VERSIONS.supports(req.v):
            return f"data plane version {req.v} is not one of {TCP_VERSIONS}"
        if req.size <= 0 or req.offset < 0 or req.offset + req.size > self._region.size:
            return f"range [{req.offset}, {req.offset + req.size}) is outside the region"
        if not self._authorize(req.peer_id, req.lease_id, req.offset, req.size):
            return f"no live lease {req.lease_id!r} of {req.peer_id!r} covers the range"
        return ""


class _Reader:
    """Reads a served connection: first what arrived with its first request."""

    def __init__(self, conn: socket.socket, rest: bytes) -> None:
        self._conn = conn
        self._rest = memoryview(rest)

    def fill(self, view: memoryview) -> bool:
        """Fill ``view``; False on a clean close before any byte."""
        got = min(len(view), len(self._rest))
        view[:got] = self._rest[:got]
        self._rest = self._rest[got:]
        while got < len(view):
            k = self._conn.recv_into(view[got:])
            if k == 0:
                return False
            got += k
        return True


# ------------------------------------------------------------------------------ client


class TcpClient(ConfiguredClient[TcpConfig]):
    transport: ClassVar[str] = TRANSPORT

    @classmethod
    def default_config(cls) -> TcpConfig:
        return TcpConfig()

    def connect(self, endpoint: Endpoint) -> TcpPeer:
        endpoint.expect(TRANSPORT)
        host, _, port = endpoint.url.removeprefix("tcp://").rpartition(":")
        if not host or not port.isdigit():
            raise EndpointMismatch(f"bad tcp endpoint url {endpoint.url!r}")
        theirs = advertised_versions(endpoint)
        version = highest_common(TCP_VERSIONS, theirs)
        if version is None:
            raise EndpointMismatch(
                f"tcp endpoint {endpoint.url!r} reads data plane versions {theirs},"
                f" this node speaks {TCP_VERSIONS}"
            )
        return self._track(TcpPeer(self, endpoint, host.strip("[]"), int(port), version))


class TcpPeer(PeerConnection):
    client: TcpClient

    def __init__(
        self, client: TcpClient, endpoint: Endpoint, host: str, port: int, version: int = 1
    ) -> None:
        super().__init__(client, endpoint)
        self._addr = (host, port)
        self.version = version
        """The data plane version this peer is asked in (the highest both read)."""
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False

    def _read(
        self,
        ops: Sequence[ReadOp],
        todo: list[int],
        results: dict[int, ReadResult],
        deadline: Deadline,
    ) -> None:
        for attempt in (0, 1):
            pooled, sock = self._take(deadline)
            if sock is None:
                status = ReadStatus.TIMEOUT if deadline.expired() else ReadStatus.PEER_DEAD
                detail = f"cannot connect to {self._addr[0]}:{self._addr[1]}"
                for i in todo:
                    results[i] = ReadResult(ops[i], status, detail)
                return
            done_before = len(results)
            failure = self._pipeline(sock, ops, todo, results, deadline)
            if failure is None:
                self._give_back(sock)
                return
            sock.close()
            status, detail = failure
            todo = [i for i in todo if i not in results]
            # A pooled connection the peer closed while idle fails before any answer:
            # retry once on a fresh one instead of calling a live peer dead.
            if attempt == 0 and pooled and len(results) == done_before and not deadline.expired():
                continue
            for i in todo:
                results[i] = ReadResult(ops[i], status, detail)
            return

    def _pipeline(
        self,
        sock: socket.socket,
        ops: Sequence[ReadOp],
        todo: list[int],
        results: dict[int, ReadResult],
        deadline: Deadline,
    ) -> tuple[ReadStatus, str] | None:
        client = self.client
        peer_id, token, v = client.peer_id, client.token or "", self.version
        local = client.local.buffer
        head = bytearray(_RESP.size)
        sent = 0

        def send_upto(k: int) -> None:
            nonlocal sent
            frames = []
            for i in todo[sent:k]:
                op = ops[i]
                msg = _request(peer_id, token, op.lease_id, op.remote_offset, op.size, v=v)
                frames.append(_LEN.pack(len(msg)) + msg)
            remaining = deadline.remaining()
            if remaining <= 0:
                raise TimeoutError("deadline passed")
            sock.settimeout(remaining)
            sock.sendall(b"".join(frames))
            sent = k

        try:
            send_upto(min(len(todo), 2 * PIPELINE))
            for j, i in enumerate(todo):
                op = ops[i]
                _recv_exact(sock, memoryview(head), deadline)
                status, msg_len, data_len = _RESP.unpack(head)
                msg = bytearray(msg_len)
                _recv_exact(sock, memoryview(msg), deadline)
                if status != _ST_OK:
                    results[i] = ReadResult(op, ReadStatus.REFUSED, msg.decode(errors="replace"))
                elif data_len != op.size:
                    return ReadStatus.PEER_DEAD, f"peer sent {data_len} bytes for {op.size}"
                else:
                    with local[op.local_offset : op.local_offset + op.size] as slot:
                        digest = _recv_hashing(sock, slot, deadline)
                    results[i] = client.verify_digest(op, digest)
                if sent < len(todo) and sent - (j + 1) < PIPELINE:
                    send_upto(min(len(todo), sent + PIPELINE))
        except TimeoutError:
            return ReadStatus.TIMEOUT, "deadline passed while reading from the peer"
        except (OSError, EOFError) as exc:
            return ReadStatus.PEER_DEAD, f"connection to the peer failed: {exc!r}"
        return None

    def _take(self, deadline: Deadline) -> tuple[bool, socket.socket | None]:
        with self._lock:
            if self._idle:
                return True, self._idle.pop()
        timeout = min(deadline.remaining(), self.client.config.connect_timeout_s)
        if timeout <= 0:
            return False, None
        try:
            sock = socket.create_connection(self._addr, timeout=timeout)
        except OSError:
            return False, None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return False, sock

    def _give_back(self, sock: socket.socket) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < MAX_IDLE:
                self._idle.append(sock)
                return
        sock.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for sock in idle:
            sock.close()


__all__ = ["TcpClient", "TcpConfig", "TcpPeer", "TcpServer"]
