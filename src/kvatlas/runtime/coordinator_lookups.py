"""Prefix lookups at the coordinator from an event loop: the router's one per request.

Owns ``AsyncLookups`` (``CoordinatorClient.async_lookups()``): the same replicas,
order, breakers and failovers as the client that made it (`coordinator_replicas`), but
no thread hop and no httpx: the request is ``POST /directory/lookup`` as msgpack (the
tokens as the raw little-endian uint32 bytes, which the coordinator decodes without a
base64 or JSON pass), written over keep-alive HTTP/1.1 connections of the loop's own
(``asyncio.Protocol``), the answer parsed by httptools, and only its
``prefix_holders`` decoded. A reused connection that the replica closed while idle is
retried once on a new one before it counts as the replica's failure. Errors are those
of `coordinator_replicas`.

Why not the fleet's client factory (`http_clients`, httpx), which every other fleet
call goes through: measured side by side on one uvloop loop against a real ``kvatlas
coordinator`` on 127.0.0.1, the same msgpack lookup through both, alternating in blocks
of 50 until each made 2,000 (``python -m bench.lookup_client_bench``; an idle 2-vCPU
Intel Xeon VM, Python 3.11.7, commit 6d842e5): per lookup, this client took a median of
0.17 / 0.23 / 0.48 ms for prompts of 256 / 4,096 / 32,768 tokens, httpx 0.98 / 1.05 /
1.40 ms, with the coordinator's own time 0.06-0.25 ms in both; the router's process spent
0.06-0.18 ms of CPU per lookup here and 0.90-1.03 ms through httpx. That is 0.8-0.9 ms
more per routed request, on the router's one event loop, whose overhead target is a p99
of 5 ms (docs/benchmarks.md, "Router lookup
client").

Must not: retry a replica within one call (but for that stale connection), be used
from two event loops, or block the loop.
"""

from __future__ import annotations

import asyncio
import ssl
from dataclasses import dataclass
from typing import Final, cast
from urllib.parse import urlsplit

import httptools
import msgspec

from kvatlas.runtime.coordinator_replicas import (
    JSON_CONTENT_TYPE,
    BadAnswer,
    Replicas,
    ReplicaWalk,
    reason_of,
)
from kvatlas.wire.directory_api import HolderWire, LookupRequest
from kvatlas.wire.http_api import MSGPACK_CONTENT_TYPE

LOOKUP_PATH: Final = "/directory/lookup"
_MAX_IDLE_CONNECTIONS: Final = 8
"""Keep-alive connections kept per replica (one per concurrent lookup, up to this)."""
_msgpack = msgspec.msgpack.Encoder()


class _Holders(msgspec.Struct):
    """What a router needs of a lookup's answer; its ``results`` are skipped unread."""

    prefix_holders: list[HolderWire] = []


_holders_answer = msgspec.json.Decoder(_Holders)


@dataclass(frozen=True, slots=True)
class LookupAnswer:
    """``AsyncLookups.holders``' answer."""

    holders: list[HolderWire]
    """Per (instance, tier) the leading chunks and tokens of the prompt it holds."""
    server_s: float | None
    """The coordinator's own time for it (its ``Server-Timing`` ``app``), when given."""


@dataclass(frozen=True, slots=True)
class _Answer:
    status: int
    server_timing: bytes
    body: bytes


class _StaleConnection(ConnectionError):
    """A kept-alive connection closed before any byte of the answer came."""


class _Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection to a replica, one exchange at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.gone: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        """Done once the connection is lost (closed, by either side)."""
        self._parser = httptools.HttpResponseParser(self)
        self._waiter: asyncio.Future[_Answer] | None = None
        self._got_bytes = False
        self._timing = b""
        self._body: list[bytes] = []

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass

    def data_received(self, data: bytes) -> None:
        self._got_bytes = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(ConnectionError(f"malformed HTTP answer: {exc}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.gone.done():
            self.gone.set_result(None)
        if self._got_bytes:
            self._fail(exc or ConnectionResetError("the coordinator closed the connection"))
        else:
            self._fail(_StaleConnection("the connection closed before the answer"))

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"server-timing":
            self._timing = value

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        waiter, self._waiter = self._waiter, None
        answer = _Answer(self._parser.get_status_code(), self._timing, b"".join(self._body))
        if not self._parser.should_keep_alive():
            self.close()
        if waiter is not None and not waiter.done():
            waiter.set_result(answer)

    # the exchange
    def send(self, data: bytes) -> asyncio.Future[_Answer]:
        assert self.transport is not None and self._waiter is None
        self._got_bytes = False
        self._timing = b""
        self._body = []
        self._waiter = asyncio.get_running_loop().create_future()
        self.transport.write(data)
        return self._waiter

    def _fail(self, exc: BaseException) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class _Target:
    """A replica's address, the request head built once, and its idle connections."""

    def __init__(self, base: str, auth_token: str | None) -> None:
        parts = urlsplit(base)
        self.tls = parts.scheme == "https"
        self.host = parts.hostname or ""
        self.port = parts.port or (443 if self.tls else 80)
        auth = f"Authorization: Bearer {auth_token}\r\n" if auth_token else ""
        self.head = (
            f"POST {parts.path.rstrip('/')}{LOOKUP_PATH} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
            f"Content-Type: {MSGPACK_CONTENT_TYPE}\r\nAccept: {JSON_CONTENT_TYPE}\r\n{auth}"
            "Content-Length: "
        ).encode("latin-1")
        self.idle: list[_Connection] = []


class AsyncLookups:
    """``POST /directory/lookup`` by tokens, from one event loop (see the module doc).
    Made by ``CoordinatorClient.async_lookups()``, sharing its replicas; used on one
    loop only."""

    def __init__(self, replicas: Replicas, auth_token: str | None) -> None:
        self._replicas = replicas
        self._targets = [_Target(base, auth_token) for base in replicas.urls]
        self._tls: ssl.SSLContext | None = None

    async def holders(
        self, tokens: bytes, model_name: str, *, timeout_s: float, cache_salt: str = ""
    ) -> LookupAnswer:
        """Every holder of a prefix of ``tokens`` (little-endian uint32) under
        ``model_name``, within ``timeout_s`` over all the replicas asked; the same
        errors as ``CoordinatorClient.lookup``."""
        body = _msgpack.encode(
            LookupRequest(tokens_b64=tokens, model_name=model_name, cache_salt=cache_salt)
        )
        walk = ReplicaWalk(self._replicas, "POST", LOOKUP_PATH, timeout_s)
        for index, url, timeout in walk.attempts():
            try:
                answer = await asyncio.wait_for(self._exchange(self._targets[index], body), timeout)
            except (OSError, TimeoutError) as exc:
                walk.no_answer(index, url, exc)
                continue
            success = 200 <= answer.status < 300
            reason = "" if success else reason_of(answer.body)
            if not walk.answered(index, url, answer.status, reason):
                continue
            if not success:
                raise walk.refused(url, answer.status, reason)
            try:
                holders = _holders_answer.decode(answer.body).prefix_holders
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                raise BadAnswer(
                    f"POST {url} answered {answer.status} with a body that is not a"
                    f" LookupResponse: {exc}",
                    answer.status,
                ) from exc
            return LookupAnswer(holders, _app_seconds(answer.server_timing))
        error, cause = walk.failure()
        raise error from cause

    async def _exchange(self, target: _Target, body: bytes) -> _Answer:
        """One request and its answer, on an idle connection or a new one; a cancelled
        or failed exchange closes its connection (an answer may still be coming)."""
        data = b"%b%d\r\n\r\n%b" % (target.head, len(body), body)
        while target.idle:
            conn = target.idle.pop()
            if conn.closed:
                continue
            try:
                return await self._on(target, conn, data)
            except _StaleConnection:
                continue  # closed by the replica while idle: never sent, try a new one
        conn = await self._connect(target)
        return await self._on(target, conn, data)

    async def _on(self, target: _Target, conn: _Connection, data: bytes) -> _Answer:
        done = False
        try:
            answer = await conn.send(data)
            done = True
            return answer
        finally:
            if done and not conn.closed and len(target.idle) < _MAX_IDLE_CONNECTIONS:
                target.idle.append(conn)
            elif not conn.closed:
                conn.close()

    async def _connect(self, target: _Target) -> _Connection:
        loop = asyncio.get_running_loop()
        tls: ssl.SSLContext | None = None
        if target.tls:
            if self._tls is None:
                self._tls = ssl.create_default_context()
            tls = self._tls
        _, conn = await loop.create_connection(
            _Connection,
            target.host,
            target.port,
            ssl=tls,
            server_hostname=target.host if tls else None,
        )
        return conn

    async def aclose(self) -> None:
        """Close the idle connections (on the loop that used them), waiting a moment
        for them to be gone."""
        closing: list[asyncio.Future[None]] = []
        for target in self._targets:
            for conn in target.idle:
                conn.close()
                closing.append(conn.gone)
            target.idle.clear()
        if closing:
            await asyncio.wait(closing, timeout=1.0)


def _app_seconds(server_timing: bytes) -> float | None:
    """The ``app;dur=`` (milliseconds) of a ``Server-Timing`` header, in seconds."""
    for metric in server_timing.split(b","):
        name, _, params = metric.strip().partition(b";")
        if name == b"app" and params.startswith(b"dur="):
            try:
                return float(params[4:]) / 1000
            except ValueError:
                return None
    return None
