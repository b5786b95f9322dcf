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

Thread-safe (httpx.Client is): a process may share one instance among its parts.
Every coordinator URL is made by ``_url``: that is where a choice among several replica
URLs would go.

Must not: retry (callers own their schedules: the registrar's heartbeat loop, the
publisher's resend buffer), keep state about the fleet, or know who calls it.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import TracebackType
from typing import Any, Self, TypeVar

import httpx
import msgspec

from kvatlas.core.errors import ServiceError
from kvatlas.core.events import EventBatch
from kvatlas.wire.coordinator_views import ReadyResponse, StatsResponse
from kvatlas.wire.http_api import (
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

JSON_CONTENT_TYPE = "application/json"
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
    """Typed calls to one coordinator; ``close()`` (or ``with``) releases its connections."""

    def __init__(self, url: str, *, auth_token: str | None = None, timeout_s: float = 5.0) -> None:
        """``timeout_s`` bounds each request (connect, read, write, pool) unless a call
        passes its own; ``auth_token`` goes out as ``Authorization: Bearer``."""
        self._base = url.rstrip("/")
        headers = {"Authorization": f"Bearer {auth_token}"} if auth_token else {}
        self._http = httpx.Client(timeout=timeout_s, headers=headers)

    @property
    def url(self) -> str:
        """The coordinator's base URL."""
        return self._base

    def _url(self, path: str) -> str:
        return self._base + path

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
    ) -> httpx.Response:
        """One request; a 2xx answer (or a status in ``accept``) is returned, anything
        else raised as the tree above."""
        url = self._url(path)
        try:
            resp = self._http.request(
                method,
                url,
                content=body,
                headers={"content-type": content_type} if body is not None else None,
                params=params,
                timeout=httpx.USE_CLIENT_DEFAULT if timeout_s is None else timeout_s,
            )
        except httpx.HTTPError as exc:
            raise CoordinatorUnreachable(f"{method} {url} failed: {exc!r}") from exc
        if resp.is_success or resp.status_code in accept:
            return resp
        reason = _reason(resp)
        raise CoordinatorRefused(
            f"{method} {url} answered {resp.status_code}: {reason}", resp.status_code, reason
        )

    # ---- membership ----------------------------------------------------------------

    def register(self, request: RegisterRequest) -> RegisterResponse:
        """``POST /instances``; a contract contradicting the fleet's is refused (409)."""
        resp = self._send("POST", "/instances", body=_json.encode(request))
        return _decode(_register_answer, resp)

    def heartbeat(self, instance_id: str) -> None:
        """``PUT /instances/{id}/heartbeat``; UnknownInstance when the coordinator
        answers 404 (it does not know the instance: register again)."""
        path = f"/instances/{instance_id}/heartbeat"
        resp = self._send("PUT", path, accept=frozenset({404}))
        if resp.status_code == 404:
            reason = _reason(resp)
            raise UnknownInstance(
                f"PUT {self._url(path)} answered 404: {reason}", resp.status_code, reason
            )

    def deregister(self, instance_id: str) -> None:
        """``DELETE /instances/{id}``."""
        self._send("DELETE", f"/instances/{instance_id}")

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
        return _decode(_events_answer, self._send("POST", "/events", body=body, content_type=ctype))

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
