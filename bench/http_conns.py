"""Minimal HTTP/1.1 clients of the coordinator benchmarks: keep-alive, one request in
flight per connection, bodies pre-encoded, so that the client spends as little CPU as
possible (on a 2-core machine client and server compete for the same cores).

Owns `Conn` (asyncio, for ingest), `BlockingConn` (a blocking socket, for sequential
latency, reading the answer's ``Server-Timing``) and `encode_request`. Must not: connect
beyond 127.0.0.1, or retry (a failed request fails the scenario).
"""

from __future__ import annotations

import asyncio
import socket
import time


class Conn:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.r, self.w = reader, writer

    @classmethod
    async def open(cls, port: int) -> Conn:
        r, w = await asyncio.open_connection("127.0.0.1", port, limit=1 << 24)
        return cls(r, w)

    async def post(self, path: str, body: bytes, ctype: str) -> tuple[int, bytes]:
        head = (
            f"POST {path} HTTP/1.1\r\nHost: b\r\nContent-Type: {ctype}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        self.w.write(head + body)
        status_line = await self.r.readline()
        status = int(status_line.split()[1])
        length = 0
        while True:
            line = await self.r.readline()
            if line in (b"\r\n", b""):
                break
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        data = await self.r.readexactly(length) if length else b""
        return status, data

    def close(self) -> None:
        self.w.close()


def encode_request(method: str, path: str, body: bytes, ctype: str) -> bytes:
    """The whole request's bytes, built once per scenario: the client sends the same
    bytes every time and spends nothing per request on building them (``head + body``
    per request would cost the client an allocation and a copy of the whole body)."""
    head = (
        f"{method} {path} HTTP/1.1\r\nHost: b\r\nContent-Type: {ctype}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    return head + body


class BlockingConn:
    """One keep-alive connection with a blocking socket: for sequential latency, the
    client's own overhead stays out of the way (an asyncio client adds its loop's). Its
    own cost per request: one ``sendall`` of pre-built bytes, a buffered read of the
    answer's head line by line and of its body, and three clock reads (``sent_at``,
    ``first_at``: the client's timeline of the last request)."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.f = self.sock.makefile("rb")
        self.timing: dict[str, float] = {}
        """The last answer's `Server-Timing` (name;dur=ms, ...): empty without one."""
        self.sent_at = 0.0
        """When the last request's ``sendall`` returned (the kernel holds all of it)."""
        self.first_at = 0.0
        """When the last answer's status line had arrived."""

    def send(self, request: bytes) -> tuple[int, bytes]:
        """Send one pre-built request (`encode_request`) and read its answer."""
        self.sock.sendall(request)
        self.sent_at = time.perf_counter()
        line = self.f.readline()
        self.first_at = time.perf_counter()
        status = int(line.split()[1])
        length = 0
        while True:
            line = self.f.readline()
            if line in (b"\r\n", b""):
                break
            low = line.lower()
            if low.startswith(b"content-length:"):
                length = int(line.split(b":")[1])
            elif low.startswith(b"server-timing:"):
                self.timing = _server_timing(line.split(b":", 1)[1])
        return status, self.f.read(length) if length else b""

    def close(self) -> None:
        self.f.close()
        self.sock.close()


def _server_timing(value: bytes) -> dict[str, float]:
    """``decode;dur=0.3, app;dur=0.9`` -> {"decode": 0.3, "app": 0.9} (milliseconds)."""
    out = {}
    for metric in value.decode("latin-1").split(","):
        name, _, params = metric.strip().partition(";")
        for param in params.split(";"):
            key, _, v = param.strip().partition("=")
            if key == "dur":
                out[name] = float(v)
    return out
