"""The coordinator's cache-control routes, answered as LMCache 0.5.6's coordinator does
(lmcache/v1/mp_coordinator/http_apis/cache_api.py and controllers/prefetch_manager.py).

- ``POST /cache/prefetches``: forwards a warm prefetch to the registered server
  ``instance_id`` names (its ``POST /cache/prefetches``) and relays its job id;
- ``GET /cache/prefetches/{instance_id}/{request_id}``: proxies the poll to that server
  and relays its answer and status (200 ``pending`` / ``completed``; its 404 once the
  job was polled done or never existed);
- ``POST /cache/delete``: resolves the token sequence to object keys here (every rank,
  object group 0: LMCache's ``resolve_object_keys``), leaves out the keys the fleet pins
  when the delete touches L2 and is not forced, sends the rest to the server's
  ``DELETE /cache/objects`` (tier and force as asked), and on a forced delete that
  touches L2 drops those keys' pins. ``affected`` is what the server removed,
  ``skipped`` the L1 keys it kept locked plus the L2 keys held back for a pin.

Refusals: a body that does not decode is a 422, a token cap or key field LMCache refuses
a 400, an instance not registered here a 404, a server that does not answer or refuses
a 502 naming it; all as ``{"detail": reason}``. A delete is an operator write: with an
operator token it needs it (403). The calls to servers go through one
`server_control.ServerControl` on the HTTP loop (the handlers are coroutines: the loop
serves other requests while a server answers); hashing a long prompt runs in the pool.
Must not hold state: pins are the quota controller's (`PinGuard`), servers' state theirs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Protocol, TypeVar

import msgspec
from prometheus_client import CollectorRegistry, Counter, Histogram

from kvatlas.coordinator.http.auth import OperatorCheck
from kvatlas.coordinator.http.edge.messages import HttpRequest, HttpResponse
from kvatlas.coordinator.http.edge.routing import Router
from kvatlas.coordinator.http.quota import OperatorLog, Refused
from kvatlas.coordinator.quota.controller import QuotaController
from kvatlas.coordinator.server_control import (
    ServerControl,
    ServerControlError,
    ServerRefused,
    ServerTarget,
)
from kvatlas.coordinator.service import CoordinatorService
from kvatlas.core.coordinator.quotas import DropPins, check_key_fields
from kvatlas.core.errors import InvalidInput
from kvatlas.core.keys import ObjectKey, rank_keys
from kvatlas.core.types import InstanceId
from kvatlas.wire.cache_api import (
    MAX_TOKEN_IDS,
    DeleteRequest,
    DeleteResponse,
    PrefetchRequest,
    PrefetchResponse,
)
from kvatlas.wire.decoding import decode_or_refuse
from kvatlas.wire.quota_api import DetailResponse

log = logging.getLogger(__name__)

_T = TypeVar("_T")
_encoder = msgspec.json.Encoder()
_prefetch_decoder = msgspec.json.Decoder(PrefetchRequest)
_delete_decoder = msgspec.json.Decoder(DeleteRequest)
_INLINE_BODY_BYTES = 512 * 1024


class PinGuard(Protocol):
    """The fleet's L2 pins, as a delete needs them."""

    def unpinned(self, keys: Sequence[ObjectKey]) -> list[ObjectKey]:
        """``keys`` without those pinned, in order."""
        ...

    async def drop_pins(self, keys: Sequence[ObjectKey]) -> None:
        """Clear the pins of ``keys`` (a forced delete's), durably."""
        ...


class ControllerPins:
    """`PinGuard` over the quota controller: reads under its lock, the drop through the
    operator log (so every replica drops them, and the operator file keeps it)."""

    def __init__(self, controller: QuotaController, log: OperatorLog) -> None:
        self._ctl = controller
        self._log = log

    def unpinned(self, keys: Sequence[ObjectKey]) -> list[ObjectKey]:
        return self._ctl.unpinned(keys)

    async def drop_pins(self, keys: Sequence[ObjectKey]) -> None:
        await self._log.submit(DropPins(tuple(keys)))


class CacheMetrics:
    """Counters of the cache-control routes and of every call to a server."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "kvatlas_coordinator_cache_requests",
            "Cache-control requests by route (prefetch, prefetch_status, delete) and"
            " outcome (ok, noop, invalid, unknown_instance, server_error, forbidden)",
            ["route", "outcome"],
            registry=registry,
        )
        self.deleted_keys = Counter(
            "kvatlas_coordinator_cache_delete_keys",
            "Keys of POST /cache/delete by fate: affected (removed by the server),"
            " skipped_locked (kept by the server), skipped_pinned (held back here)",
            ["fate"],
            registry=registry,
        )
        self.server_calls = Counter(
            "kvatlas_coordinator_server_control_calls",
            "Calls to servers' control endpoints by operation and outcome (ok,"
            " unreachable, refused, bad_answer)",
            ["op", "outcome"],
            registry=registry,
        )
        self.server_seconds = Histogram(
            "kvatlas_coordinator_server_control_seconds",
            "Time of calls to servers' control endpoints, by operation",
            ["op"],
            registry=registry,
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0),
        )

    def observe(self, op: str, outcome: str, seconds: float) -> None:
        """`ServerControl`'s ``observe``."""
        self.server_calls.labels(op, outcome).inc()
        self.server_seconds.labels(op).observe(seconds)


def _json(obj: object, status: int = 200) -> HttpResponse:
    return HttpResponse(status, _encoder.encode(obj))


async def _decode_body(decoder: msgspec.json.Decoder[_T], body: bytes | bytearray) -> _T:
    """A big body (a long prompt's token ids) is decoded in the pool, off the loop."""
    if len(body) > _INLINE_BODY_BYTES:
        return await asyncio.to_thread(_decode, decoder, body)
    return _decode(decoder, body)


def _decode(decoder: msgspec.json.Decoder[_T], body: bytes | bytearray) -> _T:
    return decode_or_refuse(decoder, body, Refused, malformed=422)


class CacheRoutes:
    """``control`` must be used on the HTTP server's loop only (where these run)."""

    def __init__(
        self,
        service: CoordinatorService,
        control: ServerControl,
        metrics: CacheMetrics,
        operator: OperatorCheck,
        pins: PinGuard | None = None,
    ) -> None:
        self._svc = service
        self._control = control
        self._metrics = metrics
        self._operator = operator
        self._pins = pins

    def add_routes(self, r: Router) -> None:
        r.add("POST", "/cache/prefetches", self.request_prefetch)
        r.add("GET", "/cache/prefetches/{instance_id}/{request_id}", self.prefetch_status)
        r.add("POST", "/cache/delete", self.request_delete)

    # ---- helpers ---------------------------------------------------------------------

    def _target(self, route: str, instance_id: str) -> ServerTarget:
        with self._svc.state.lock:
            info = self._svc.state.fleet.membership.get(InstanceId(instance_id))
        if info is None:
            self._metrics.requests.labels(route, "unknown_instance").inc()
            raise Refused(404, f"no MP server registered with instance_id={instance_id!r}")
        return ServerTarget.of(info)

    def _server_failed(self, route: str, what: str, exc: ServerControlError) -> Refused:
        self._metrics.requests.labels(route, "server_error").inc()
        log.warning("%s: %s", what, exc)
        return Refused(502, f"{what} failed: {exc}")

    def _resolve(
        self, model_name: str, world_size: int, token_ids: list[int], cache_salt: str
    ) -> tuple[list[ObjectKey], int]:
        """LMCache's ``resolve_object_keys``: every rank's key of each complete chunk."""
        if len(token_ids) > MAX_TOKEN_IDS:
            raise Refused(
                400,
                f"too many token_ids in a single request"
                f" (limit={MAX_TOKEN_IDS}, got={len(token_ids)})",
            )
        try:
            check_key_fields(model_name, cache_salt)
        except InvalidInput as exc:
            raise Refused(400, str(exc)) from exc
        hashes = self._svc.lookups.hash_tokens(token_ids)
        keys = rank_keys(hashes, model_name, world_size, cache_salt)
        return self._across_object_groups(keys), len(hashes)

    def _across_object_groups(self, keys: list[ObjectKey]) -> list[ObjectKey]:
        """Each key followed by its stored copies in other object groups (LMCache's
        ``get_keys_across_object_groups``: servers started with separate object groups
        store a chunk once per group), in ascending group order."""
        if not keys:
            return keys
        first = keys[0]
        ranks = {k.kv_rank for k in keys}
        d = self._svc.state.fleet.directory
        with self._svc.state.lock:
            groups = sorted(
                {
                    ns.object_group_id
                    for ns in d.namespaces()
                    if ns.object_group_id != 0
                    and ns.model_name == first.model_name
                    and ns.cache_salt == first.cache_salt
                    and ns.kv_rank in ranks
                }
            )
        if not groups:
            return keys
        held: set[ObjectKey] = set()
        for g in groups:
            candidates = [msgspec.structs.replace(k, object_group_id=g) for k in keys]
            with self._svc.state.lock:
                results = d.lookup_keys(candidates)
            held.update(r.key for r in results if r.placements)
        out: list[ObjectKey] = []
        for k in keys:
            out.append(k)
            out += [
                other
                for g in groups
                if (other := msgspec.structs.replace(k, object_group_id=g)) in held
            ]
        return out

    # ---- routes ----------------------------------------------------------------------

    async def request_prefetch(self, request: HttpRequest) -> HttpResponse:
        route = "prefetch"
        try:
            body = await _decode_body(_prefetch_decoder, request.body)
        except Refused:
            self._metrics.requests.labels(route, "invalid").inc()
            raise
        target = self._target(route, body.instance_id)
        try:
            got = await self._control.submit_prefetch(
                target, body.model_name, body.world_size, body.token_ids, body.cache_salt
            )
        except ServerControlError as exc:
            raise self._server_failed(
                route, f"prefetch submit to {body.instance_id!r}", exc
            ) from exc
        self._metrics.requests.labels(route, "noop" if got.status == "noop" else "ok").inc()
        return _json(
            PrefetchResponse(
                instance_id=body.instance_id,
                request_id=got.request_id,
                chunks=got.chunks,
                status=got.status,
            )
        )

    async def prefetch_status(self, request: HttpRequest) -> HttpResponse:
        route = "prefetch_status"
        iid = request.path_params["instance_id"]
        request_id = request.path_params["request_id"]
        target = self._target(route, iid)
        try:
            got = await self._control.prefetch_status(target, request_id)
        except ServerRefused as exc:  # relayed with its status, as LMCache's coordinator
            self._metrics.requests.labels(route, "relayed_refusal").inc()
            return _json(DetailResponse(exc.reason), exc.status)
        except ServerControlError as exc:
            raise self._server_failed(route, f"prefetch status from {iid!r}", exc) from exc
        self._metrics.requests.labels(route, "ok").inc()
        return _json(got)

    async def request_delete(self, request: HttpRequest) -> HttpResponse:
        route = "delete"
        if self._operator.enabled and not self._operator(request):
            self._metrics.requests.labels(route, "forbidden").inc()
            raise Refused(403, "deletes need the operator token")
        try:
            body = await _decode_body(_delete_decoder, request.body)
        except Refused:
            self._metrics.requests.labels(route, "invalid").inc()
            raise
        target = self._target(route, body.instance_id)
        t0 = time.perf_counter()
        try:
            keys, chunks = await asyncio.to_thread(
                self._resolve, body.model_name, body.world_size, body.token_ids, body.cache_salt
            )
        except Refused:
            self._metrics.requests.labels(route, "invalid").inc()
            raise
        if not chunks:
            self._metrics.requests.labels(route, "noop").inc()
            return _json(DeleteResponse(instance_id=body.instance_id, status="noop"))
        touches_l2 = body.tier in ("l2", "all")
        send = keys
        if touches_l2 and not body.force and self._pins is not None:
            send = await asyncio.to_thread(self._pins.unpinned, keys)  # under the state lock
        pin_skipped = len(keys) - len(send)
        affected = skipped = 0
        if send:
            try:
                done = await self._control.delete_objects(
                    target, send, tier=body.tier, force=body.force
                )
            except ServerControlError as exc:
                raise self._server_failed(route, f"delete to {body.instance_id!r}", exc) from exc
            affected, skipped = done.deleted, done.skipped
            if not done.ok:
                log.warning(
                    "Delete on %s: the server's L2 failed: %s", body.instance_id, done.errors
                )
        if touches_l2 and body.force and self._pins is not None:
            await self._pins.drop_pins(keys)
        m = self._metrics
        m.requests.labels(route, "ok").inc()
        m.deleted_keys.labels("affected").inc(affected)
        m.deleted_keys.labels("skipped_locked").inc(skipped)
        m.deleted_keys.labels("skipped_pinned").inc(pin_skipped)
        log.info(
            "Delete on %s (tier %s%s, salt %r): %d chunks, %d keys; %d removed, %d kept"
            " locked, %d held back for pins (%.1f ms)",
            body.instance_id,
            body.tier,
            ", forced" if body.force else "",
            body.cache_salt,
            chunks,
            len(keys),
            affected,
            skipped,
            pin_skipped,
            (time.perf_counter() - t0) * 1000,
        )
        return _json(
            DeleteResponse(
                instance_id=body.instance_id,
                requested=chunks,
                affected=affected,
                skipped=skipped + pin_skipped,
                status="deleted",
            )
        )
