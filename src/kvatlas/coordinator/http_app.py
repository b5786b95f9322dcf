"""The coordinator's HTTP API (LMCache-compatible, plus kvatlas' additions).

Owns routing, body limits, decoding with msgspec from raw bodies (no pydantic), the
mapping of errors to status codes (InvalidInput 400, contract and incarnation conflicts
409, limits 413, unknown instance 404) and where each handler runs: small requests on
the event loop, large ones (big bodies, long prompts, blend lookups) in the threadpool,
so one heavy request never stalls the loop. Must not hold state beyond its
collaborators, nor touch the fleet state except through the service and the
membership frontend.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kvatlas.coordinator.auth import BearerAuth
from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.frontend import MembershipFrontend, Unavailable
from kvatlas.coordinator.metrics import CoordinatorMetrics
from kvatlas.coordinator.openapi import openapi_document
from kvatlas.coordinator.service import CoordinatorService
from kvatlas.coordinator.views import ReadyResponse, keys_response, prefix_response
from kvatlas.core.errors import ContractMismatch, InvalidInput, StaleIncarnation, TooLarge
from kvatlas.core.keys import Namespace, default_kv_rank
from kvatlas.core.membership import InstanceInfo
from kvatlas.core.types import Tier
from kvatlas.wire.http_api import (
    BlendLookupRequest,
    BlendLookupResponse,
    BlendMatchWire,
    ErrorResponse,
    HeartbeatResponse,
    InstancesResponse,
    LookupRequest,
    RegisterRequest,
    RegisterResponse,
    decode_events,
)

log = logging.getLogger(__name__)

_INLINE_BODY_BYTES = 512 * 1024
"""Bodies larger than this are decoded and applied in the threadpool."""
_INLINE_TOKENS = 65536
"""Token lookups longer than this run in the threadpool."""
_MAX_PAGE = 10000

_register_decoder = msgspec.json.Decoder(RegisterRequest)
_lookup_decoder = msgspec.json.Decoder(LookupRequest)
_blend_decoder = msgspec.json.Decoder(BlendLookupRequest)
_encoder = msgspec.json.Encoder()


class HttpError(Exception):
    """An answer other than 2xx, with the reason the client gets."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


def _json(obj: Any, status: int = 200) -> Response:
    return Response(_encoder.encode(obj), status, media_type="application/json")


def _error(status: int, reason: str) -> Response:
    return _json(ErrorResponse(reason), status)


Handler = Callable[[Request], Awaitable[Response]]


def _guarded(handler: Handler) -> Handler:
    """Translate the error tree into status codes with reasons."""

    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except HttpError as exc:
            return _error(exc.status, exc.reason)
        except Unavailable as exc:
            return _error(503, str(exc))
        except (ContractMismatch, StaleIncarnation) as exc:
            return _error(409, str(exc))
        except TooLarge as exc:
            return _error(413, str(exc))
        except InvalidInput as exc:
            return _error(400, str(exc))
        except msgspec.ValidationError as exc:
            return _error(400, f"invalid body: {exc}")
        except msgspec.DecodeError as exc:
            return _error(400, f"malformed body: {exc}")

    return wrapped


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            if int(declared) > limit:
                raise HttpError(413, f"body of {declared} bytes exceeds the limit of {limit}")
        except ValueError as exc:
            raise HttpError(400, "content-length is not a number") from exc
    parts: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise HttpError(413, f"body exceeds the limit of {limit} bytes")
        parts.append(chunk)
    return b"".join(parts)


class CoordinatorApp:
    """Builds the Starlette app over a service and a membership frontend."""

    def __init__(
        self,
        config: CoordinatorConfig,
        service: CoordinatorService,
        membership: MembershipFrontend,
        metrics: CoordinatorMetrics,
        *,
        clock: Callable[[], float] = time.time,
        events_refusal: str = "",
    ) -> None:
        """``events_refusal``: when set, `POST /events` answers 409 with it (with Kafka,
        events travel through the topic only, so that every replica sees them)."""
        self._cfg = config
        self._svc = service
        self._members = membership
        self._metrics = metrics
        self._clock = clock
        self._events_refusal = events_refusal
        self._openapi = _encoder.encode(openapi_document())

    def build(self) -> Starlette:
        g = _guarded
        routes = [
            Route("/instances", g(self.register), methods=["POST"]),
            Route("/instances", g(self.list_instances), methods=["GET"]),
            Route("/instances/{instance_id}/heartbeat", g(self.heartbeat), methods=["PUT"]),
            Route("/instances/{instance_id}", g(self.deregister), methods=["DELETE"]),
            Route("/events", g(self.events), methods=["POST"]),
            Route("/directory/lookup", g(self.lookup), methods=["POST"]),
            Route("/directory/blend-lookup", g(self.blend_lookup), methods=["POST"]),
            Route("/directory/stats", g(self.stats), methods=["GET"]),
            Route("/directory/keys", g(self.keys), methods=["GET"]),
            Route("/healthz", self.healthz, methods=["GET"]),
            Route("/readyz", self.readyz, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            Route("/openapi.json", self.openapi, methods=["GET"]),
        ]
        middleware = []
        if self._cfg.auth_token:
            middleware.append(Middleware(BearerAuth, token=self._cfg.auth_token))
        return Starlette(routes=routes, middleware=middleware)

    # ---- membership ------------------------------------------------------------------

    async def register(self, request: Request) -> Response:
        body = await _read_body(request, self._cfg.max_body_bytes)
        req = _register_decoder.decode(body)
        iid = req.instance_id or f"instance-{uuid.uuid4().hex[:12]}"
        info = InstanceInfo(
            instance_id=iid,
            ip=req.ip,
            http_port=req.http_port,
            metadata=dict(req.metadata),
            p2p_advertised_url=req.p2p_advertised_url or "",
            mq_port=req.mq_port or 0,
            incarnation=req.incarnation or 0,
            contract=req.contract.to_core() if req.contract is not None else None,
        )
        outcome = await self._members.register(info)
        return _json(RegisterResponse(iid, outcome.re_registered, info.incarnation))

    async def heartbeat(self, request: Request) -> Response:
        iid = request.path_params["instance_id"]
        if not await self._members.heartbeat(iid):
            raise HttpError(404, f"unknown instance {iid}; re-register")
        return _json(HeartbeatResponse(iid))

    async def deregister(self, request: Request) -> Response:
        await self._members.deregister(request.path_params["instance_id"])
        return Response(status_code=204)

    async def list_instances(self, request: Request) -> Response:
        return _json(InstancesResponse(self._svc.instances(self._clock())))

    # ---- events ----------------------------------------------------------------------

    async def events(self, request: Request) -> Response:
        if self._events_refusal:
            raise HttpError(409, self._events_refusal)
        body = await _read_body(request, self._cfg.max_body_bytes)
        ctype = request.headers.get("content-type", "application/json")
        if len(body) > _INLINE_BODY_BYTES:
            return await run_in_threadpool(self._ingest, body, ctype)
        return self._ingest(body, ctype)

    def _ingest(self, body: bytes, content_type: str) -> Response:
        try:
            batches = decode_events(body, content_type, self._cfg.max_batch_entries)
        except InvalidInput:  # TooLarge included: answered 413 by _guarded
            self._metrics.ingest_batches.labels("invalid", "http").inc()
            raise
        return _json(self._svc.ingest(batches, self._clock()))

    # ---- lookups ---------------------------------------------------------------------

    def _namespace(
        self,
        model_name: str,
        world_size: int,
        kv_rank: int | None,
        object_group_id: int,
        cache_salt: str,
    ) -> Namespace:
        if not model_name:
            raise HttpError(400, "model_name is required with token_ids")
        rank = kv_rank if kv_rank is not None else default_kv_rank(world_size)
        return Namespace(model_name, rank, object_group_id, cache_salt)

    async def lookup(self, request: Request) -> Response:
        body = await _read_body(request, self._cfg.max_body_bytes)
        req = _lookup_decoder.decode(body)
        forms = (req.keys is not None) + (req.token_ids is not None) + (req.tokens_b64 is not None)
        if forms != 1:
            raise HttpError(400, "give exactly one of keys, token_ids or tokens_b64")
        if req.keys is not None:
            if len(req.keys) > self._cfg.max_lookup_keys:
                raise HttpError(
                    413, f"{len(req.keys)} keys exceed the limit of {self._cfg.max_lookup_keys}"
                )
            keys = [k.to_core() for k in req.keys]
            t0 = time.perf_counter()
            results = self._svc.lookup_keys(keys)
            self._metrics.lookup_seconds.labels("keys").observe(time.perf_counter() - t0)
            return _json(keys_response(results, req.keys))
        tokens: list[int] | bytes
        if req.tokens_b64 is not None:
            tokens = _b64_tokens(req.tokens_b64)
            n_tokens = len(tokens) // 4
        else:
            assert req.token_ids is not None
            tokens = req.token_ids
            n_tokens = len(tokens)
        if n_tokens > self._cfg.max_lookup_tokens:
            raise HttpError(
                413, f"{n_tokens} tokens exceed the limit of {self._cfg.max_lookup_tokens}"
            )
        ns = self._namespace(
            req.model_name, req.world_size, req.kv_rank, req.object_group_id, req.cache_salt
        )
        if n_tokens > _INLINE_TOKENS:
            return await run_in_threadpool(self._lookup_tokens, tokens, ns)
        return self._lookup_tokens(tokens, ns)

    def _lookup_tokens(self, tokens: list[int] | bytes, ns: Namespace) -> Response:
        t0 = time.perf_counter()
        hashes = self._svc.hash_tokens(tokens)
        res = self._svc.lookup_hashes(hashes, ns)
        self._metrics.lookup_seconds.labels("tokens").observe(time.perf_counter() - t0)
        return _json(prefix_response(res, self._svc.fleet.chunk_size))

    async def blend_lookup(self, request: Request) -> Response:
        if not self._svc.blend_enabled:
            raise HttpError(404, "blend lookup is disabled; start with --enable-blend-lookup")
        body = await _read_body(request, self._cfg.max_body_bytes)
        req = _blend_decoder.decode(body)
        raw = _b64_tokens(req.tokens_b64)
        if len(raw) // 4 > self._cfg.max_lookup_tokens:
            raise HttpError(
                413,
                f"{len(raw) // 4} tokens exceed the limit of {self._cfg.max_lookup_tokens}",
            )
        ns = self._namespace(
            req.model_name, req.world_size, req.kv_rank, req.object_group_id, req.cache_salt
        )
        return await run_in_threadpool(self._blend, raw, ns)

    def _blend(self, raw: bytes, ns: Namespace) -> Response:
        t0 = time.perf_counter()
        matches = self._svc.blend_lookup(raw, ns)
        self._metrics.lookup_seconds.labels("blend").observe(time.perf_counter() - t0)
        return _json(
            BlendLookupResponse(
                [BlendMatchWire(m.chunk_hash.hex(), m.old_st, m.cur_st) for m in matches]
            )
        )

    # ---- views -----------------------------------------------------------------------

    async def stats(self, request: Request) -> Response:
        with_digest = request.query_params.get("digest", "") in ("1", "true")
        return _json(await run_in_threadpool(self._svc.stats, with_digest))

    async def keys(self, request: Request) -> Response:
        q = request.query_params
        try:
            offset = int(q.get("offset", "0"))
            limit = int(q.get("limit", "100"))
        except ValueError as exc:
            raise HttpError(400, "offset and limit must be integers") from exc
        if offset < 0 or not 1 <= limit <= _MAX_PAGE:
            raise HttpError(400, f"need offset >= 0 and 1 <= limit <= {_MAX_PAGE}")
        tier_name = q.get("tier")
        tier = None
        if tier_name is not None:
            try:
                tier = Tier(tier_name)
            except ValueError as exc:
                raise HttpError(400, f"tier must be l1 or l2, got {tier_name!r}") from exc
        page = await run_in_threadpool(
            self._svc.keys_page, offset, limit, tier, q.get("instance"), q.get("backend")
        )
        return _json(page)

    async def healthz(self, request: Request) -> Response:
        return _json({"status": "ok"})

    async def readyz(self, request: Request) -> Response:
        if self._svc.ready:
            return _json(ReadyResponse(True, ""))
        return _json(ReadyResponse(False, self._svc.not_ready_reason), 503)

    async def metrics(self, request: Request) -> Response:
        body = await run_in_threadpool(self._metrics.render)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def openapi(self, request: Request) -> Response:
        return Response(self._openapi, media_type="application/json")


def _b64_tokens(raw: bytes) -> bytes:
    """``tokens_b64`` arrives decoded (msgspec validates the base64); check its width."""
    if len(raw) % 4:
        raise HttpError(400, "tokens_b64 must decode to little-endian uint32 tokens")
    return raw
