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

Must not: retry a replica within one call, or schedule anything (callers own their
schedules: the registrar's heartbeat loop, the publisher's resend buffer), keep state
about the fleet, or know who calls it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self, TypeVar

import httpx
import msgspec

from kvatlas.core.credentials import credential_digest
from kvatlas.core.errors import ServiceError
from kvatlas.core.events import EventBatch
from kvatlas.wire.coordinator_views import ReadyResponse, StatsResponse
from kvatlas.wire.http_api import (
    INSTANCE_SECRET_HEADER,
    MSGPACK_CONTENT_TYPE,
    ErrorResponse,
    EventFormat,
    EventsResponse,
    InstancesResponse,
    InstanceWire,
    LookupRequest,
    LookupResponse,
    RegisterRequest,
    RegisterResponse,
    compact_batch,
    encode_events_json,
    encode_events_msgpack,
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
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        sent = dict(headers or {})
        if body is not None:
            sent["content-type"] = content_type
        several = len(self._replicas) > 1
        errors: list[str] = []
        last: CoordinatorError | None = None
        cause: BaseException | None = None
        for index in self._order():
            timeout = self._timeout
            if deadline is not None:
                timeout = deadline - time.monotonic()
                if timeout <= 0:
                    break
                if several:  # one replica may not take the whole call's time
                    timeout = min(timeout, self._timeout)
            url = self._replicas[index].base + path
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
                self._failed(index)
                last = CoordinatorUnreachable(
                    _with_others(f"{method} {url} failed: {exc!r}", errors)
                )
                cause = exc
                errors.append(f"{url}: {exc!r}")
                continue
            reason = "" if resp.is_success else _reason(resp)
            if resp.status_code >= 500 and resp.status_code not in accept:
                self._failed(index)
                last = CoordinatorRefused(
                    _with_others(f"{method} {url} answered {resp.status_code}: {reason}", errors),
                    resp.status_code,
                    reason,
                )
                cause = None
                errors.append(f"{url}: {resp.status_code} {reason}")
                continue
            self._answered(index, "; ".join(errors))
            if resp.is_success or resp.status_code in accept:
                return resp
            raise CoordinatorRefused(
                f"{method} {url} answered {resp.status_code}: {reason}", resp.status_code, reason
            )
        if last is None:  # the call's deadline ran out before any replica was asked
            last = CoordinatorUnreachable(
                f"{method} {path}: no coordinator replica could be asked within {timeout_s} s"
            )
        raise last from cause

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

    # ---- lifecycle -----------------------------------------------------------------

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


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
