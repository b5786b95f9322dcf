"""The coordinator's client of a cache server's control endpoints (kvatlas' and LMCache's).

Owns every call the coordinator makes to a server: ``DELETE /cache/objects`` (split at
``MAX_DELETE_BATCH`` keys per request, as LMCache's eviction controller does),
``POST /cache/prefetches``, ``GET /cache/prefetches/{request_id}`` and
``GET /cache/objects``, on the HTTP address the server registered (``ip`` and
``http_port`` of ``POST /instances``: LMCache's coordinator builds
``http://{ip}:{http_port}`` the same way). The bodies and answers are LMCache 0.5.6's
(`wire.cache_api`), so one client drives a real ``lmcache server`` and ``kvatlas
server`` alike; the shared bearer token goes along when one is set (LMCache's server
ignores it, kvatlas' checks it).

Errors leave only as this branch of kvatlas' tree, raised ``from`` the httpx error:

    ServiceError (core)
     +-- ServerControlError           the server did not do what was asked
          +-- ServerUnreachable           no answer: refused, reset, timed out
          +-- ServerRefused               an answer other than 2xx: ``status``, ``reason``
          +-- BadServerAnswer             a 2xx whose body is not the expected shape

Async (``httpx.AsyncClient``, from `runtime.http_clients`: no proxy from the
environment, no redirects): an instance belongs to the event loop it is first used
on; ``aclose()`` it there. Every call reports (operation, outcome, seconds) to
``observe`` when given, for the caller's metrics. Must not: hold fleet state, decide
what to delete or prefetch (the routes and the eviction loop do), or retry a refused
call (every call here is safe to repeat, and its caller decides).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import quote

import httpx
import msgspec

from kvatlas.core.coordinator.membership import InstanceInfo
from kvatlas.core.errors import ServiceError
from kvatlas.core.keys import ObjectKey
from kvatlas.runtime.http_clients import async_fleet_client
from kvatlas.wire.cache_api import (
    MAX_DELETE_BATCH,
    CacheTier,
    DeleteObjectsRequest,
    DeleteObjectsResponse,
    NodePrefetchRequest,
    NodePrefetchResponse,
    NodePrefetchStatus,
    ObjectsPage,
    keys_wire,
)

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 10.0
"""Per request; a delete of 10,000 keys on a disk L2 takes well under it."""

_T = TypeVar("_T")
Observe = Callable[[str, str, float], None]
"""(operation, outcome, seconds): ``outcome`` is ``ok``, ``unreachable``, ``refused`` or
``bad_answer``."""


class ServerControlError(ServiceError):
    """A server did not do what the coordinator asked. ``status``: the HTTP status, 0
    when there was no answer."""

    def __init__(self, message: str, *, status: int = 0, instance_id: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.instance_id = instance_id


class ServerUnreachable(ServerControlError):
    """No answer: the connection was refused or reset, or the call timed out."""


class ServerRefused(ServerControlError):
    """An answer other than 2xx; ``reason`` is the server's (``detail`` from LMCache,
    ``error`` from kvatlas)."""

    def __init__(self, message: str, *, status: int, reason: str, instance_id: str = "") -> None:
        super().__init__(message, status=status, instance_id=instance_id)
        self.reason = reason


class BadServerAnswer(ServerControlError):
    """A 2xx whose body is not the shape LMCache's server answers."""


@dataclass(frozen=True, slots=True)
class ServerTarget:
    """Where a server's HTTP control endpoints are: its registration's ``ip`` and
    ``http_port``."""

    instance_id: str
    ip: str
    http_port: int

    @classmethod
    def of(cls, info: InstanceInfo) -> ServerTarget:
        return cls(info.instance_id, info.ip, info.http_port)

    @property
    def base_url(self) -> str:
        host = f"[{self.ip}]" if ":" in self.ip and not self.ip.startswith("[") else self.ip
        return f"http://{host}:{self.http_port}"


@dataclass(frozen=True, slots=True)
class DeleteOutcome:
    """What a server did with a delete, summed over its requests."""

    deleted: int
    """Keys removed across the tiers acted on (LMCache counts an L2 batch whole)."""
    skipped: int
    """L1 keys refused because they were locked (non-force only)."""
    requests: int
    """``DELETE /cache/objects`` requests sent (``MAX_DELETE_BATCH`` keys each at most)."""
    errors: tuple[str, ...] = ()
    """L2 failures the server reported (``ok: false``), one per failed request."""

    @property
    def ok(self) -> bool:
        return not self.errors


_delete_response = msgspec.json.Decoder(DeleteObjectsResponse)
_prefetch_response = msgspec.json.Decoder(NodePrefetchResponse)
_prefetch_status = msgspec.json.Decoder(NodePrefetchStatus)
_objects_page = msgspec.json.Decoder(ObjectsPage)
_encoder = msgspec.json.Encoder()
_reason_decoder = msgspec.json.Decoder(dict[str, Any])


class ServerControl:
    """Calls cache servers' control endpoints; one per event loop, shared by every user
    there (routes and the eviction loop): one keep-alive pool."""

    def __init__(
        self,
        *,
        auth_token: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        client: httpx.AsyncClient | None = None,
        observe: Observe | None = None,
    ) -> None:
        """``client``: a caller's own (tests: a transport); closed by its owner, not
        here. ``auth_token``: the fleet's shared token, sent as a bearer token."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        headers = {"content-type": "application/json"}
        if auth_token:
            headers["authorization"] = f"Bearer {auth_token}"
        self._headers = headers
        self._own_client = client is None
        self._client = client if client is not None else async_fleet_client(timeout=timeout_s)
        self._timeout = timeout_s
        self._observe = observe

    async def aclose(self) -> None:
        if self._own_client:
            await self._client.aclose()

    # ---- operations ------------------------------------------------------------------

    async def delete_objects(
        self,
        target: ServerTarget,
        keys: Sequence[ObjectKey],
        *,
        tier: CacheTier = "l2",
        force: bool = False,
        adapter: str | None = None,
    ) -> DeleteOutcome:
        """Delete ``keys`` on ``target`` from ``tier`` (``l1``, ``l2`` or ``all``), in
        requests of ``MAX_DELETE_BATCH`` keys. ``force`` deletes locked L1 keys too.
        Idempotent: an absent key is no error. A batch the server refuses raises (the
        batches before it stay deleted); an L2 failure it reports (``ok: false``) is in
        ``errors``."""
        deleted = skipped = requests = 0
        errors: list[str] = []
        for start in range(0, len(keys), MAX_DELETE_BATCH):
            batch = list(keys[start : start + MAX_DELETE_BATCH])
            body = DeleteObjectsRequest(keys_wire(batch), tier, force, adapter)
            got = await self._request(
                _delete_response,
                "delete",
                target,
                "DELETE /cache/objects",
                body=_encoder.encode(body),
            )
            requests += 1
            deleted += got.deleted
            skipped += got.skipped
            if not got.ok:
                errors.append(got.error or "L2 delete failed")
        outcome = DeleteOutcome(deleted, skipped, requests, tuple(errors))
        log.info(
            "Delete on %s (tier %s%s): %d keys asked, %d deleted, %d skipped in %d requests%s",
            target.instance_id,
            tier,
            ", forced" if force else "",
            len(keys),
            deleted,
            skipped,
            requests,
            f"; L2 failed: {errors[0]}" if errors else "",
        )
        return outcome

    async def submit_prefetch(
        self,
        target: ServerTarget,
        model_name: str,
        world_size: int,
        token_ids: Sequence[int],
        cache_salt: str = "",
    ) -> NodePrefetchResponse:
        """Ask ``target`` to warm its L1 with the complete chunks of ``token_ids`` (from
        L2, and on a kvatlas server from peers); returns its job id to poll (none when
        the tokens hold no complete chunk: ``status`` ``noop``)."""
        body = NodePrefetchRequest(model_name, world_size, list(token_ids), cache_salt)
        got = await self._request(
            _prefetch_response,
            "prefetch",
            target,
            "POST /cache/prefetches",
            body=_encoder.encode(body),
        )
        log.info(
            "Prefetch submitted to %s: %d tokens, %d chunks, %s %s",
            target.instance_id,
            len(token_ids),
            got.chunks,
            got.status,
            got.request_id,
        )
        return got

    async def prefetch_status(self, target: ServerTarget, request_id: str) -> NodePrefetchStatus:
        """Poll a prefetch job; the first poll that sees it completed drops it on the
        server, so a later one raises ServerRefused with status 404."""
        path = f"/cache/prefetches/{quote(request_id, safe='')}"
        return await self._request(_prefetch_status, "prefetch_status", target, f"GET {path}")

    async def list_objects(
        self,
        target: ServerTarget,
        *,
        model_name: str | None = None,
        page_size: int = 500,
        page_token: str | None = None,
        adapter: str | None = None,
    ) -> ObjectsPage:
        """One page of the keys ``target``'s L2 holds (``GET /cache/objects``)."""
        params: dict[str, str | int] = {"tier": "l2", "page_size": page_size}
        if model_name is not None:
            params["model_name"] = model_name
        if page_token is not None:
            params["page_token"] = page_token
        if adapter is not None:
            params["adapter"] = adapter
        return await self._request(
            _objects_page, "list_objects", target, "GET /cache/objects", params=params
        )

    # ---- plumbing --------------------------------------------------------------------

    async def _request(
        self,
        decoder: msgspec.json.Decoder[_T],
        op: str,
        target: ServerTarget,
        route: str,
        *,
        body: bytes | None = None,
        params: dict[str, str | int] | None = None,
    ) -> _T:
        """One call (``route``: method and path), its answer decoded; reports one
        outcome to ``observe``."""
        method, path = route.split(" ", 1)
        url = target.base_url + path
        t0 = time.perf_counter()
        try:
            resp = await self._client.request(
                method, url, content=body, headers=self._headers, params=params
            )
        except httpx.HTTPError as exc:
            self._done(op, "unreachable", t0)
            raise ServerUnreachable(
                f"{method} {url} on {target.instance_id}: {type(exc).__name__}: {exc}",
                instance_id=target.instance_id,
            ) from exc
        if not 200 <= resp.status_code < 300:
            self._done(op, "refused", t0)
            reason = _reason(resp)
            raise ServerRefused(
                f"{method} {url} on {target.instance_id}: {resp.status_code} {reason}",
                status=resp.status_code,
                reason=reason,
                instance_id=target.instance_id,
            )
        try:
            got = decoder.decode(resp.content)
        except msgspec.DecodeError as exc:  # ValidationError included
            self._done(op, "bad_answer", t0)
            raise BadServerAnswer(
                f"{method} {url} on {target.instance_id}: unexpected answer ({exc}):"
                f" {resp.text[:200]!r}",
                status=resp.status_code,
                instance_id=target.instance_id,
            ) from exc
        self._done(op, "ok", t0)
        return got

    def _done(self, op: str, outcome: str, t0: float) -> None:
        if self._observe is not None:
            self._observe(op, outcome, time.perf_counter() - t0)


def _reason(resp: httpx.Response) -> str:
    """The server's reason: ``detail`` (LMCache, FastAPI), ``error`` (kvatlas), else the
    body's start."""
    try:
        body = _reason_decoder.decode(resp.content)
    except msgspec.DecodeError:
        return resp.text[:200]
    for field in ("detail", "error"):
        value = body.get(field)
        if value is not None:
            return value if isinstance(value, str) else _encoder.encode(value).decode()
    return resp.text[:200]
