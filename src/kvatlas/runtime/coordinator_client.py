"""The one blocking client of the coordinator's HTTP API: every coordinator URL is
built here.

Owns one keep-alive ``httpx.Client`` per instance (from `http_clients`: no proxy from
the environment), the bearer token header, the timeouts, the request bodies (the
Structs of `wire.events_api`, `wire.instances_api` and `wire.directory_api`, encoded as
the coordinator decodes them) and the answers, decoded into the same Structs the
coordinator encodes (those and `wire.coordinator_views`). httpx errors and answers other
than 2xx leave it only as the `CoordinatorError` tree of `coordinator_replicas`
(re-exported here), raised ``from`` the httpx error.

Thread-safe (httpx.Client is; the replicas' state has its own lock): a process may share
one instance among its parts. It also keeps the instance secret of its owner
(`set_instance_secret`) and presents it (header ``INSTANCE_SECRET_HEADER``) on
the requests that speak for that instance: registration, heartbeat, deregistration,
events.

Replicas: the client is given an ordered list of coordinator URLs and fails over
between them as `coordinator_replicas` describes (sticky to the one that answers, a
breaker per replica, within the call's deadline). Failing over re-sends a request the
first replica may have applied before it stopped answering; every call is safe to
repeat: registration and deregistration are idempotent for one incarnation, heartbeats
and lookups change nothing twice, and an event batch carries its seq, which the
coordinator's gate applies once.

Lookups from an event loop (the router's one lookup per request) go through
`coordinator_lookups.AsyncLookups` (``async_lookups()``), on the same replicas, as do
other calls of the client's owner that send their own requests (``replicas``: the
router's device lookups).

Must not: retry a replica within one call, or schedule anything (callers own their
schedules: the registrar's heartbeat loop, the publisher's resend buffer), keep state
about the fleet, or know who calls it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, Self, TypeVar

import httpx
import msgspec

from kvatlas.core.credentials import credential_digest
from kvatlas.core.events import EventBatch
from kvatlas.runtime.coordinator_lookups import AsyncLookups, LookupAnswer
from kvatlas.runtime.coordinator_replicas import (
    JSON_CONTENT_TYPE,
    MAX_SKIP_S,
    REASON_CHARS,
    SKIP_S,
    BadAnswer,
    ClientStats,
    CoordinatorError,
    CoordinatorRefused,
    CoordinatorUnreachable,
    Failover,
    Replicas,
    ReplicaStats,
    ReplicaWalk,
    UnknownInstance,
    error_text,
)
from kvatlas.runtime.http_clients import fleet_client
from kvatlas.wire.coordinator_views import ReadyResponse, StatsResponse
from kvatlas.wire.directory_api import LookupRequest, LookupResponse
from kvatlas.wire.events_api import (
    EventFormat,
    EventsResponse,
    compact_batch,
    encode_events_json,
    encode_events_msgpack,
)
from kvatlas.wire.http_api import MSGPACK_CONTENT_TYPE
from kvatlas.wire.instances_api import (
    INSTANCE_SECRET_HEADER,
    InstancesResponse,
    InstanceWire,
    RegisterRequest,
    RegisterResponse,
)

__all__ = [
    "JSON_CONTENT_TYPE",
    "MAX_SKIP_S",
    "SKIP_S",
    "AsyncLookups",
    "BadAnswer",
    "ClientStats",
    "CoordinatorClient",
    "CoordinatorError",
    "CoordinatorRefused",
    "CoordinatorUnreachable",
    "Failover",
    "LookupAnswer",
    "ReplicaStats",
    "UnknownInstance",
]

T = TypeVar("T")

_register_answer = msgspec.json.Decoder(RegisterResponse)
_instances_answer = msgspec.json.Decoder(InstancesResponse)
_lookup_answer = msgspec.json.Decoder(LookupResponse)
_events_answer = msgspec.json.Decoder(EventsResponse)
_stats_answer = msgspec.json.Decoder(StatsResponse)
_ready_answer = msgspec.json.Decoder(ReadyResponse)
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
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``url``: one base URL, or the replicas' in order of preference.
        ``timeout_s`` bounds each request to one replica (connect, read, write, pool)
        unless a call passes its own, which bounds the whole call; ``auth_token`` goes
        out as ``Authorization: Bearer``. ``name`` says whose client this is in its log
        lines; ``on_failover`` is called (in the calling thread) after each failover;
        ``clock`` times the replicas' skips and the calls' deadlines."""
        urls = [url] if isinstance(url, str) else list(url)
        self._replicas = Replicas(
            urls,
            timeout_s=timeout_s,
            skip_s=skip_s,
            name=name,
            on_failover=on_failover,
            clock=clock,
        )
        self._auth_token = auth_token
        self._http = fleet_client(timeout=timeout_s, token=auth_token)
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
        return self._replicas.url

    @property
    def urls(self) -> tuple[str, ...]:
        """Every replica's base URL, in order of preference."""
        return self._replicas.urls

    @property
    def replicas(self) -> Replicas:
        """The replicas' state (the one in use, their breakers): for a caller that sends
        its own requests over them, as the router's device lookups do, so that all of a
        process's calls agree on which replica answers."""
        return self._replicas

    def stats(self) -> ClientStats:
        return self._replicas.stats()

    def _url(self, path: str) -> str:
        return self.url + path

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
        returned, anything else raised as a `CoordinatorError`: a 4xx at once, and when
        no replica answered, the last replica's error, naming the others'."""
        sent = dict(headers or {})
        if body is not None:
            sent["content-type"] = content_type
        walk = ReplicaWalk(self._replicas, method, path, timeout_s)
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
        return AsyncLookups(self._replicas, self._auth_token)

    # ---- lifecycle -----------------------------------------------------------------

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


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
    text = error_text(resp.content)
    return resp.text[:REASON_CHARS] if text is None else text
