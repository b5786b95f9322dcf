"""The one client of the coordinator's HTTP API: every coordinator URL is built here.

Owns one keep-alive ``httpx.Client`` per instance, the coordinator's base URL, the
bearer token header, the timeouts, the request bodies (the Structs of `wire.http_api`,
encoded as the coordinator decodes them) and the answers, decoded into the same
Structs the coordinator encodes (`wire.http_api`, `wire.coordinator_views`). httpx
errors and answers other than 2xx leave it only as this branch of kvatlas' tree,
raised ``from`` the httpx error:

    ServiceError (core)
     +-- CoordinatorError           the coordinator did not do what was asked
          +-- CoordinatorUnreachable    no answer: refused connection, timeout, reset
          +-- CoordinatorRefused        an answer other than 2xx: ``status``, ``reason``
          |    +-- UnknownInstance      404 to a heartbeat: register again
          +-- BadAnswer                 a 2xx whose body is not the expected shape

``CoordinatorError.status`` is the HTTP status, 0 when there was no answer.

Thread-safe (httpx.Client is; the replica state has its own lock): a process may share
one instance among its parts. It also keeps the instance secret of its owner
(`set_instance_secret`) and presents it (header ``INSTANCE_SECRET_HEADER``) on
the requests that speak for that instance: registration, heartbeat, deregistration,
events.

Replicas: the client is given an ordered list of coordinator URLs (one is the common
case, and then it behaves exactly as a one-URL client: every call goes there). It sticks
to the replica that last answered. A call that gets no answer (refused, reset, timed
out) or a 5xx from it goes on to the next replica in the list, within the call's own
deadline, and the failed replica is skipped for a while (a breaker: ``skip_s``, doubled
per consecutive failure up to ``MAX_SKIP_S``); once that time is over it may be tried
again (half-open), and a success closes its breaker. When every replica is being
skipped, a call tries the one whose skip ends first, so a call never waits on more than
one replica that is known to be down. A 4xx is an answer (the replica works, the request
was refused) and never fails over. Each change of the replica in use is a failover:
counted in ``stats()``, logged with ``name`` (the caller's instance and incarnation)
and the two URLs, and reported to ``on_failover``.

Failing over re-sends a request the first replica may have applied before it stopped
answering; every call is safe to repeat: registration and deregistration are
idempotent for one incarnation, heartbeats and lookups change nothing twice, and an
event batch carries its seq, which the coordinator's gate applies once.

Lookups from an event loop (the router's one lookup per request) go through
``AsyncLookups`` (``CoordinatorClient.async_lookups()``): the same replicas, order,
breakers and failovers as the client that made it, but no thread hop and no httpx: the
request is ``POST /directory/lookup`` as msgpack (the tokens as the raw little-endian
uint32 bytes, which the coordinator decodes without a base64 or JSON pass), written
over keep-alive HTTP/1.1 connections of the loop's own (``asyncio.Protocol``), the
answer parsed by httptools, and only its ``prefix_holders`` decoded. A reused
connection that the replica closed while idle is retried once on a new one before it
counts as the replica's failure.

Must not: retry a replica within one call (but for that stale connection), or schedule
anything (callers own their schedules: the registrar's heartbeat loop, the publisher's
resend buffer), keep state about the fleet, or know who calls it.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Final, Self, TypeVar, cast
from urllib.parse import urlsplit

import httptools
import httpx
import msgspec

from kvatlas.core.credentials import credential_digest
from kvatlas.core.errors import ServiceError
from kvatlas.core.events import EventBatch
from kvatlas.wire.coordinator_views import ReadyResponse, StatsResponse
from kvatlas.wire.directory_api import HolderWire, LookupRequest, LookupResponse
from kvatlas.wire.events_api import (
    EventFormat,
    EventsResponse,
    compact_batch,
    encode_events_json,
    encode_events_msgpack,
)
from kvatlas.wire.http_api import MSGPACK_CONTENT_TYPE, ErrorResponse
from kvatlas.wire.instances_api import (
    INSTANCE_SECRET_HEADER,
    InstancesResponse,
    InstanceWire,
    RegisterRequest,
    RegisterResponse,
)

log = logging.getLogger(__name__)

JSON_CONTENT_TYPE = "application/json"
SKIP_S = 2.0
"""How long a replica that failed is skipped at first (doubled per consecutive failure)."""
MAX_SKIP_S = 30.0
"""The longest a failing replica is skipped before it is tried again."""
_REASON_CHARS = 300
"""How much of a body that is not an `ErrorResponse` a refusal quotes."""


class CoordinatorError(ServiceError):
    """The coordinator did not do what was asked; ``status`` 0 means no answer came."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class CoordinatorUnreachable(CoordinatorError):
    """No answer: the connection was refused, timed out or broke."""


class CoordinatorRefused(CoordinatorError):
    """An answer other than 2xx; ``reason`` is the coordinator's error text."""

    def __init__(self, message: str, status: int, reason: str) -> None:
        super().__init__(message, status)
        self.reason = reason


class UnknownInstance(CoordinatorRefused):
    """A heartbeat answered 404: the coordinator lost the instance (a restart without
    snapshot, or an expiry); the instance must register again."""


class BadAnswer(CoordinatorError):
    """A 2xx answer whose body does not decode into the expected shape."""


@dataclass(frozen=True, slots=True)
class Failover:
    """The client moved from one replica to another."""

    from_url: str
    to_url: str
    reason: str
    """Why the replica left behind failed (its error)."""


@dataclass(frozen=True, slots=True)
class ReplicaStats:
    url: str
    failures: int
    """Requests to this replica that got no answer or a 5xx."""
    skipped_for_s: float
    """Seconds this replica is still skipped (its breaker is open); 0 when it is not."""


@dataclass(frozen=True, slots=True)
class ClientStats:
    """A snapshot for /status and metrics."""

    url: str
    """The replica in use."""
    failovers: int
    replicas: tuple[ReplicaStats, ...]


class _Replica:
    """One coordinator URL and its breaker; guarded by the client's lock."""

    __slots__ = ("base", "failures", "run", "skip_until")

    def __init__(self, base: str) -> None:
        self.base = base
        self.failures = 0
        self.run = 0
        """Consecutive failures (0 once it answers)."""
        self.skip_until = 0.0
        """``time.monotonic()`` before which it is skipped."""


T = TypeVar("T")

_register_answer = msgspec.json.Decoder(RegisterResponse)
_instances_answer = msgspec.json.Decoder(InstancesResponse)
_lookup_answer = msgspec.json.Decoder(LookupResponse)
_events_answer = msgspec.json.Decoder(EventsResponse)
_stats_answer = msgspec.json.Decoder(StatsResponse)
_ready_answer = msgspec.json.Decoder(ReadyResponse)
_error_answer = msgspec.json.Decoder(ErrorResponse)
_json = msgspec.json.Encoder()


class CoordinatorClient:
    """Typed calls to a coordinator (one of its replicas); ``close()`` (or ``with``)
    releases its connections."""

    def __init__(
        self,
        url: str | Sequence[str],
        *,
        auth_token: str | None = None,
        timeout_s: float = 5.0,
        skip_s: float = SKIP_S,
        name: str = "",
        on_failover: Callable[[Failover], None] | None = None,
    ) -> None:
        """``url``: one base URL, or the replicas' in order of preference.
        ``timeout_s`` bounds each request to one replica (connect, read, write, pool)
        unless a call passes its own, which bounds the whole call; ``auth_token`` goes
        out as ``Authorization: Bearer``. ``name`` says whose client this is in its log
        lines; ``on_failover`` is called (in the calling thread) after each failover."""
        urls = [url] if isinstance(url, str) else list(url)
        if not urls:
            raise ValueError("a coordinator client needs at least one URL")
        self._replicas = [_Replica(u.rstrip("/")) for u in urls]
        self._timeout = timeout_s
        self._skip_s = skip_s
        self._name = name
        self._on_failover = on_failover
        self._lock = threading.Lock()
        self._active = 0
        self._failovers = 0
        headers = {"Authorization": f"Bearer {auth_token}"} if auth_token else {}
        self._auth_token = auth_token
        self._http = httpx.Client(timeout=timeout_s, headers=headers)
        self._secret = ""

    def set_instance_secret(self, secret: str) -> None:
        """Present ``secret`` from now on when speaking for the instance ("" : none)."""
        self._secret = secret

    @property
    def instance_secret(self) -> str:
        """The secret presented now ("" : none)."""
        return self._secret

    def instance_proof(self) -> str:
        """The hex digest of the instance secret (what a Kafka record carries), or ""."""
        return credential_digest(self._secret).hex() if self._secret else ""

    def _instance_headers(self) -> dict[str, str] | None:
        secret = self._secret
        return {INSTANCE_SECRET_HEADER: secret} if secret else None

    @property
    def url(self) -> str:
        """The base URL of the replica in use."""
        return self._replicas[self._active].base

    @property
    def urls(self) -> tuple[str, ...]:
        """Every replica's base URL, in order of preference."""
        return tuple(r.base for r in self._replicas)

    def stats(self) -> ClientStats:
        now = time.monotonic()
        with self._lock:
            return ClientStats(
                self._replicas[self._active].base,
                self._failovers,
                tuple(
                    ReplicaStats(r.base, r.failures, max(0.0, r.skip_until - now))
                    for r in self._replicas
                ),
            )

    def _url(self, path: str) -> str:
        return self.url + path

    # ---- replica choice --------------------------------------------------------------

    def _order(self) -> list[int]:
        """The replicas this call may try: from the one in use on, those not skipped;
        when all are skipped, only the one whose skip ends first (half-open)."""
        n = len(self._replicas)
        if n == 1:
            return [0]
        now = time.monotonic()
        with self._lock:
            ring = [(self._active + k) % n for k in range(n)]
            usable = [i for i in ring if self._replicas[i].skip_until <= now]
            if usable:
                return usable
            return [min(ring, key=lambda i: self._replicas[i].skip_until)]

    def _failed(self, index: int) -> None:
        with self._lock:
            r = self._replicas[index]
            r.failures += 1
            r.run += 1
            if len(self._replicas) > 1:  # the only replica is never skipped: no other to ask
                skip = min(self._skip_s * 2 ** (r.run - 1), MAX_SKIP_S)
                r.skip_until = time.monotonic() + skip

    def _answered(self, index: int, reason: str) -> None:
        """Replica ``index`` answered: it becomes the one in use."""
        with self._lock:
            r = self._replicas[index]
            r.run = 0
            r.skip_until = 0.0
            if index == self._active:
                return
            left = self._replicas[self._active]
            event = Failover(left.base, r.base, reason or f"{left.base} is skipped after failing")
            self._active = index
            self._failovers += 1
        log.warning(
            "coordinator failover%s: from %s to %s (%s)",
            f" of {self._name}" if self._name else "",
            event.from_url,
            event.to_url,
            event.reason,
        )
        if self._on_failover is not None:
            self._on_failover(event)

    def _send(
        self,
        method: str,
        path: str,
        *,
        body: bytes | None = None,
        content_type: str = JSON_CONTENT_TYPE,
        params: dict[str, str] | None = None,
        timeout_s: float | None = None,
        accept: frozenset[int] = frozenset(),
        headers: dict[str, str] | None = None,
    ) -> httpx.Response:
        """One request, to the replica in use or, failing that, the next ones (within
        ``timeout_s`` in all when given); a 2xx answer (or a status in ``accept``) is
        returned, anything else raised as the tree above: a 4xx at once, and when no
        replica answered, the last replica's error, naming the others'."""
        sent = dict(headers or {})
        if body is not None:
            sent["content-type"] = content_type
        walk = _Walk(self, method, path, timeout_s)
        for index, url, timeout in walk.attempts():
            try:
                resp = self._http.request(
                    method,
                    url,
                    content=body,
                    headers=sent or None,
                    params=params,
                    timeout=timeout,
                )
            except httpx.HTTPError as exc:
                walk.no_answer(index, url, exc)
                continue
            reason = "" if resp.is_success else _reason(resp)
            if not walk.answered(index, url, resp.status_code, reason, accept):
                continue
            if resp.is_success or resp.status_code in accept:
                return resp
            raise walk.refused(url, resp.status_code, reason)
        error, cause = walk.failure()
        raise error from cause

    # ---- membership ----------------------------------------------------------------

    def register(self, request: RegisterRequest) -> RegisterResponse:
        """``POST /instances``; a contract contradicting the fleet's is refused (409)."""
        resp = self._send(
            "POST", "/instances", body=_json.encode(request), headers=self._instance_headers()
        )
        return _decode(_register_answer, resp)

    def heartbeat(self, instance_id: str) -> None:
        """``PUT /instances/{id}/heartbeat``; UnknownInstance when the coordinator
        answers 404 (it does not know the instance: register again)."""
        path = f"/instances/{instance_id}/heartbeat"
        resp = self._send("PUT", path, accept=frozenset({404}), headers=self._instance_headers())
        if resp.status_code == 404:
            reason = _reason(resp)
            raise UnknownInstance(
                f"PUT {self._url(path)} answered 404: {reason}", resp.status_code, reason
            )

    def deregister(self, instance_id: str, *, timeout_s: float | None = None) -> None:
        """``DELETE /instances/{id}``; ``timeout_s`` bounds the whole call."""
        self._send(
            "DELETE",
            f"/instances/{instance_id}",
            headers=self._instance_headers(),
            timeout_s=timeout_s,
        )

    def instances(self) -> list[InstanceWire]:
        """``GET /instances``: the live instances as the coordinator lists them."""
        return _decode(_instances_answer, self._send("GET", "/instances")).instances

    # ---- events and the directory --------------------------------------------------

    def post_events(
        self, batches: Sequence[EventBatch], fmt: EventFormat = "msgpack"
    ) -> EventsResponse:
        """``POST /events``: msgpack with each batch as a key block where
        `compact_batch` can make one, or LMCache's JSON form."""
        if fmt == "msgpack":
            body = encode_events_msgpack([compact_batch(b) for b in batches])
            ctype = MSGPACK_CONTENT_TYPE
        else:
            body = encode_events_json(list(batches))
            ctype = JSON_CONTENT_TYPE
        resp = self._send(
            "POST", "/events", body=body, content_type=ctype, headers=self._instance_headers()
        )
        return _decode(_events_answer, resp)

    def lookup(self, request: LookupRequest, *, timeout_s: float | None = None) -> LookupResponse:
        """``POST /directory/lookup`` as JSON: by keys, or by tokens with a namespace."""
        resp = self._send(
            "POST", "/directory/lookup", body=_json.encode(request), timeout_s=timeout_s
        )
        return _decode(_lookup_answer, resp)

    def directory_stats(self, *, digest: bool = False) -> StatsResponse:
        """``GET /directory/stats`` (with the directory's digest when asked)."""
        params = {"digest": "1"} if digest else None
        return _decode(_stats_answer, self._send("GET", "/directory/stats", params=params))

    def ready(self, *, timeout_s: float | None = None) -> ReadyResponse:
        """``GET /readyz``: ready, or not ready with the reason (a 503 is an answer)."""
        resp = self._send("GET", "/readyz", timeout_s=timeout_s, accept=frozenset({503}))
        return _decode(_ready_answer, resp)

    def async_lookups(self) -> AsyncLookups:
        """Prefix lookups for an event loop, sharing this client's replica state (see
        the module doc); the caller closes it (``aclose``) on that loop."""
        return AsyncLookups(self, self._auth_token)

    # ---- lifecycle -----------------------------------------------------------------

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class _Walk:
    """One call's way over the replicas: the failover rule, in one place for the
    blocking calls (`CoordinatorClient._send`, over httpx) and the loop's lookups
    (`AsyncLookups.holders`, over its own connections). The replicas come in the
    client's order (`CoordinatorClient._order`: the one in use first, skipped ones
    left out); each attempt gets the client's per-request timeout, or with a call
    deadline what is left of it (at most the per-request timeout when there are
    several replicas, so one cannot take the whole call's time). No answer, or a 5xx
    not in ``accept``, fails over and opens that replica's breaker
    (`CoordinatorClient._failed`); any other answer is final and makes its replica the
    one in use (`CoordinatorClient._answered`, which counts and reports a failover).
    When no replica answered, the error to raise is the last one's, naming the
    others'."""

    __slots__ = (
        "_client",
        "_deadline",
        "_method",
        "_path",
        "_timeout_s",
        "cause",
        "errors",
        "last",
    )

    def __init__(
        self, client: CoordinatorClient, method: str, path: str, timeout_s: float | None
    ) -> None:
        self._client = client
        self._method = method
        self._path = path
        self._timeout_s = timeout_s
        self._deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self.errors: list[str] = []
        """What each replica asked so far answered, or how it failed."""
        self.last: CoordinatorError | None = None
        self.cause: BaseException | None = None

    def attempts(self) -> Iterator[tuple[int, str, float]]:
        """Each replica to ask, as its index, the request's URL and its timeout; stops
        early once the call's deadline has passed."""
        client = self._client
        several = len(client._replicas) > 1
        for index in client._order():
            timeout = client._timeout
            if self._deadline is not None:
                timeout = self._deadline - time.monotonic()
                if timeout <= 0:
                    return
                if several:  # one replica may not take the whole call's time
                    timeout = min(timeout, client._timeout)
            yield index, client._replicas[index].base + self._path, timeout

    def no_answer(self, index: int, url: str, exc: BaseException) -> None:
        """Replica ``index`` gave no answer (refused, reset, timed out): fail over."""
        self._client._failed(index)
        self.last = CoordinatorUnreachable(
            _with_others(f"{self._method} {url} failed: {exc!r}", self.errors)
        )
        self.cause = exc
        self.errors.append(f"{url}: {exc!r}")

    def answered(
        self,
        index: int,
        url: str,
        status: int,
        reason: str,
        accept: frozenset[int] = frozenset(),
    ) -> bool:
        """Replica ``index`` answered ``status`` (``reason``: its error text, "" for a
        2xx). False: a 5xx not in ``accept``, which fails over; True: the answer is
        final (a 4xx is too: the replica works, the request was refused)."""
        if status >= 500 and status not in accept:
            self._client._failed(index)
            self.last = CoordinatorRefused(
                _with_others(f"{self._method} {url} answered {status}: {reason}", self.errors),
                status,
                reason,
            )
            self.cause = None
            self.errors.append(f"{url}: {status} {reason}")
            return False
        self._client._answered(index, "; ".join(self.errors))
        return True

    def refused(self, url: str, status: int, reason: str) -> CoordinatorRefused:
        """The error for a final answer other than 2xx (and not accepted)."""
        return CoordinatorRefused(
            f"{self._method} {url} answered {status}: {reason}", status, reason
        )

    def failure(self) -> tuple[CoordinatorError, BaseException | None]:
        """What to raise when no replica answered, and its cause."""
        if self.last is None:  # the call's deadline ran out before any replica was asked
            return CoordinatorUnreachable(
                f"{self._method} {self._path}: no coordinator replica could be asked"
                f" within {self._timeout_s} s"
            ), None
        return self.last, self.cause


def _with_others(message: str, others: list[str]) -> str:
    """``message``, and what the replicas asked before in this call answered."""
    return f"{message} (after {'; '.join(others)})" if others else message


def _decode(decoder: msgspec.json.Decoder[T], resp: httpx.Response) -> T:
    try:
        return decoder.decode(resp.content)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        url = resp.request.url
        raise BadAnswer(
            f"{resp.request.method} {url} answered {resp.status_code} with a body that is not"
            f" {_shape(decoder)}: {exc}",
            resp.status_code,
        ) from exc


def _shape(decoder: msgspec.json.Decoder[Any]) -> str:
    return getattr(decoder.type, "__name__", str(decoder.type))


def _reason(resp: httpx.Response) -> str:
    """The coordinator's error text, or the start of whatever else the body is."""
    try:
        return _error_answer.decode(resp.content).error
    except (msgspec.DecodeError, msgspec.ValidationError):
        return resp.text[:_REASON_CHARS]


# ---- lookups from an event loop ----------------------------------------------------------

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
    Made by ``CoordinatorClient.async_lookups()``; used on one loop only."""

    def __init__(self, owner: CoordinatorClient, auth_token: str | None) -> None:
        self._owner = owner
        self._targets = [_Target(r.base, auth_token) for r in owner._replicas]
        self._tls: ssl.SSLContext | None = None

    async def holders(self, tokens: bytes, model_name: str, *, timeout_s: float) -> LookupAnswer:
        """Every holder of a prefix of ``tokens`` (little-endian uint32) under
        ``model_name``, within ``timeout_s`` over all the replicas asked; the same
        errors as ``CoordinatorClient.lookup``."""
        body = _msgpack.encode(LookupRequest(tokens_b64=tokens, model_name=model_name))
        walk = _Walk(self._owner, "POST", LOOKUP_PATH, timeout_s)
        for index, url, timeout in walk.attempts():
            try:
                answer = await asyncio.wait_for(self._exchange(self._targets[index], body), timeout)
            except (OSError, TimeoutError) as exc:
                walk.no_answer(index, url, exc)
                continue
            success = 200 <= answer.status < 300
            reason = "" if success else _reason_of(answer.body)
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


def _reason_of(body: bytes) -> str:
    try:
        return _error_answer.decode(body).error
    except (msgspec.DecodeError, msgspec.ValidationError):
        return body[:_REASON_CHARS].decode("utf-8", "replace")


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
