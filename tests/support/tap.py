"""A loopback TCP forwarder in front of a real HTTP server that records every request.

Owns ``HttpTap``: it listens on 127.0.0.1, opens one connection to the upstream port per
client connection, copies bytes both ways unchanged, and parses the client's side (h11)
into ``requests`` (method, target, headers, body), so a test can see what a client put on
the wire (say, which form an event sink encoded) while the real server answers. When the
upstream does not accept, the client's connection is closed, as a stopped server's would
be. Must not: change, delay or answer anything itself.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from dataclasses import dataclass

import h11

from kvatlas.launch.procs import HOST


@dataclass(frozen=True)
class TappedRequest:
    method: str
    target: str
    headers: dict[str, str]
    """Lower-case names."""
    body: bytes


class _Requests:
    """The requests in one client's byte stream (h11 as the server side)."""

    def __init__(self) -> None:
        self._h11 = h11.Connection(h11.SERVER)
        self._started: h11.Request | None = None
        self._body = bytearray()

    def feed(self, data: bytes) -> tuple[list[TappedRequest], bool]:
        """The requests ``data`` completed, and whether the stream can still be followed
        (False once it is not HTTP h11 understands, or the client asked to close)."""
        conn = self._h11
        conn.receive_data(data)
        done: list[TappedRequest] = []
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError:
                return done, False
            if event is h11.NEED_DATA or isinstance(event, h11.ConnectionClosed):
                return done, True
            if isinstance(event, h11.Request):
                self._started, self._body = event, bytearray()
            elif isinstance(event, h11.Data):
                self._body += event.data
            elif isinstance(event, h11.EndOfMessage) and self._started is not None:
                req = self._started
                headers = {k.decode().lower(): v.decode() for k, v in req.headers}
                done.append(
                    TappedRequest(
                        req.method.decode(), req.target.decode(), headers, bytes(self._body)
                    )
                )
                # The real server answers; h11 must believe this side did, to read on.
                try:
                    conn.send(h11.Response(status_code=204, headers=[]))
                    conn.send(h11.EndOfMessage())
                    conn.start_next_cycle()
                except h11.LocalProtocolError:
                    return done, False


class HttpTap:
    """``with HttpTap(upstream_port) as tap: ... tap.url ... tap.requests``."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self._listener = socket.create_server((HOST, 0))
        self.port: int = self._listener.getsockname()[1]
        self.url = f"http://{HOST}:{self.port}"
        self._lock = threading.Lock()
        self._requests: list[TappedRequest] = []
        self._open: set[socket.socket] = set()
        self._closed = False
        self._acceptor = threading.Thread(target=self._accept, name="http-tap", daemon=True)
        self._acceptor.start()

    @property
    def requests(self) -> list[TappedRequest]:
        with self._lock:
            return list(self._requests)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            try:
                upstream = socket.create_connection((HOST, self.upstream_port), timeout=5)
            except OSError:
                client.close()  # the server is down: the client sees its connection drop
                continue
            upstream.settimeout(None)
            with self._lock:
                if self._closed:
                    client.close()
                    upstream.close()
                    return
                self._open.update((client, upstream))
            threading.Thread(target=self._requests_of, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client), daemon=True).start()

    def _requests_of(self, client: socket.socket, upstream: socket.socket) -> None:
        parser: _Requests | None = _Requests()
        while True:
            try:
                data = client.recv(65536)
            except OSError:
                data = b""
            if not data:
                self._shut(upstream)
                return
            if parser is not None:
                # parsed, and a whole request recorded, before the server can answer it
                done, following = parser.feed(data)
                with self._lock:
                    self._requests.extend(done)
                parser = parser if following else None
            try:
                upstream.sendall(data)
            except OSError:
                self._shut(client)
                return

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        while True:
            try:
                data = src.recv(65536)
                if data:
                    dst.sendall(data)
            except OSError:
                data = b""
            if not data:
                self._shut(dst)
                return

    @staticmethod
    def _shut_all(sock: socket.socket) -> None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)

    @staticmethod
    def _shut(sock: socket.socket) -> None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            sockets = list(self._open)
        # shutdown wakes the accepting thread (close alone does not, on Linux)
        self._shut_all(self._listener)
        self._listener.close()
        for s in sockets:
            with contextlib.suppress(OSError):
                s.close()
        self._acceptor.join(5)

    def __enter__(self) -> HttpTap:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
