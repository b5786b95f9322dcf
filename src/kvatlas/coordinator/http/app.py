"""The coordinator's HTTP API (LMCache-compatible, plus kvatlas' additions).

Owns the routes, decoding with msgspec from raw bodies (no pydantic), the mapping of
errors to status codes (InvalidInput 400, contract and incarnation conflicts 409, a
chunk size conflict 409 in LMCache 0.5.7's words, limits 413, unknown instance 404, the
log unreachable 503) and where each handler runs: small requests on the event loop,
large ones (big bodies, scans) in the thread pool, so one heavy request never stalls the
loop. Must not hold state beyond its collaborators, nor touch the fleet state except
through the service and the membership frontend. Connections, limits on the request
itself and dispatch are `coordinator.edge`'s; the fleet page's routes (`/ui`,
`/ui/fleet.json`) are `fleet_page`'s.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from operator import attrgetter
from typing import Any, Protocol, TypeVar

import msgspec

from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.http.auth import BearerAuth, OperatorCheck
from kvatlas.coordinator.http.cache import CacheRoutes
from kvatlas.coordinator.http.edge.messages import HttpRequest, HttpResponse
from kvatlas.coordinator.http.edge.routing import Router, always
from kvatlas.coordinator.http.edge.server import HttpServer
from kvatlas.coordinator.http.quota import QuotaRoutes, translate_refusal
from kvatlas.coordinator.ingest.frontend import MembershipFrontend, Unavailable
from kvatlas.coordinator.metrics import CoordinatorMetrics
from kvatlas.coordinator.openapi.document import openapi_document
from kvatlas.coordinator.service import CoordinatorService
from kvatlas.coordinator.ui.fleet_view import FleetView
from kvatlas.coordinator.ui.page import FleetPage
from kvatlas.coordinator.views import holders_wire, keys_response, lookup_json
from kvatlas.core.coordinator.membership import InstanceInfo, check_registration, strip_field
from kvatlas.core.credentials import DIGEST_BYTES, credential_digest
from kvatlas.core.errors import (
    ChunkSizeConflict,
    ContractMismatch,
    CredentialRefused,
    HttpRefusal,
    InvalidInput,
    StaleIncarnation,
    TooLarge,
    Unauthenticated,
)
from kvatlas.core.keys import Namespace, default_kv_rank
from kvatlas.core.types import MAX_INT64, Incarnation, InstanceId, Tier
from kvatlas.runtime.gc_pauses import GcPauses
from kvatlas.wire.config_api import ChunkSizeBindRequest, ChunkSizeBindResponse
from kvatlas.wire.coordinator_views import ReadyResponse
from kvatlas.wire.decoding import decode_or_refuse
from kvatlas.wire.directory_api import (
    BlendLookupRequest,
    BlendLookupResponse,
    BlendMatchWire,
    decode_lookup,
)
from kvatlas.wire.events_api import decode_events
from kvatlas.wire.http_api import ErrorResponse, KeyWire, shared_namespace
from kvatlas.wire.instances_api import (
    INSTANCE_SECRET_HEADER,
    HeartbeatResponse,
    InstancesResponse,
    RegisterRequest,
    RegisterResponse,
)
from kvatlas.wire.quota_api import DetailResponse

log = logging.getLogger(__name__)

_INLINE_BODY_BYTES = 512 * 1024
"""Bodies larger than this are decoded and applied in the thread pool."""
_LOOKUP_STEPS = ("decode", "hash", "probe", "encode")
"""The steps of a lookup its `Server-Timing` names, in order."""
_MAX_PAGE = 10000

_register_decoder = msgspec.json.Decoder(RegisterRequest)
_blend_decoder = msgspec.json.Decoder(BlendLookupRequest)
_chunk_size_decoder = msgspec.json.Decoder(ChunkSizeBindRequest, strict=False)
"""Lax like LMCache's pydantic model (``"512"`` and ``512.0`` are 512)."""
_encoder = msgspec.json.Encoder()
_T = TypeVar("_T")


def _decode(decoder: msgspec.json.Decoder[_T], body: bytes | bytearray) -> _T:
    """``decoder.decode(body)``; any body that does not decode is a 400 (a body nested
    past msgspec's recursion too, not a RecursionError's 500)."""
    return decode_or_refuse(decoder, body, HttpError, invalid=400)


class HttpError(HttpRefusal):
    """An answer other than 2xx in kvatlas' words (``{"error": reason}``)."""


def _json(obj: Any, status: int = 200) -> HttpResponse:
    return HttpResponse(status, _encoder.encode(obj))


def _error(status: int, reason: str) -> HttpResponse:
    return _json(ErrorResponse(reason), status)


def translate_error(exc: Exception) -> HttpResponse | None:
    """The error tree as status codes with reasons; None for anything else (a bug)."""
    refusal = translate_refusal(exc)  # the quota routes' answers, in LMCache's words
    if refusal is not None:
        return refusal
    if isinstance(exc, HttpError):
        return _error(exc.status, exc.reason)
    if isinstance(exc, Unavailable):
        return _error(503, str(exc))
    if isinstance(exc, ChunkSizeConflict):
        # An LMCache 0.5.7 refusal, on its route and on registration: its words, its body.
        return _json(DetailResponse(str(exc)), 409)
    if isinstance(exc, ContractMismatch | StaleIncarnation):
        return _error(409, str(exc))
    if isinstance(exc, TooLarge):
        return _error(413, str(exc))
    if isinstance(exc, Unauthenticated):
        return _error(401, f"{exc} (header {INSTANCE_SECRET_HEADER})")
    if isinstance(exc, CredentialRefused):
        return _error(403, str(exc))
    if isinstance(exc, InvalidInput):
        return _error(400, str(exc))
    if isinstance(exc, msgspec.ValidationError):
        return _error(400, f"invalid body: {exc}")
    if isinstance(exc, msgspec.DecodeError):
        return _error(400, f"malformed body: {exc}")
    return None


def _big_body(request: HttpRequest) -> bool:
    return len(request.body) > _INLINE_BODY_BYTES


class RouteSet(Protocol):
    """Routes a composition root adds beside the core ones (the device lookup)."""

    def add_routes(self, router: Router) -> None: ...

    def openapi_paths(self) -> dict[str, Any]:
        """Their entries of the OpenAPI document's ``paths`` (schemas inline)."""
        ...


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
        gc_pauses: GcPauses | None = None,
        quotas: QuotaRoutes | None = None,
        cache: CacheRoutes | None = None,
        extra_routes: Sequence[RouteSet] = (),
    ) -> None:
        """``events_refusal``: when set, `POST /events` answers 409 with it (with Kafka,
        events travel through the topic only, so that every replica sees them).
        ``gc_pauses``: the process's collector pauses, which lookups report as theirs in
        `Server-Timing` (``gc``)."""
        self._gc = gc_pauses
        self._extra_routes = tuple(extra_routes)
        self._cfg = config
        self._svc = service
        self._members = membership
        self._metrics = metrics
        self._clock = clock
        self._events_refusal = events_refusal
        doc = openapi_document()
        for extra in self._extra_routes:
            doc["paths"].update(extra.openapi_paths())
        self._openapi = _encoder.encode(doc)
        quota_view = (
            None
            if quotas is None
            else lambda: quotas.controller.fleet_view(config.eviction_check_interval)
        )
        self._operator = OperatorCheck(config.operator_token)
        self._page = FleetPage(
            FleetView(config, service, metrics, clock=clock, quotas=quota_view),
            self._operator.sees_tenants,
        )
        self._quotas = quotas
        self._cache = cache

    def router(self) -> Router:
        r = Router()
        r.add("POST", "/instances", self.register)
        r.add("GET", "/instances", self.list_instances)
        r.add("GET", "/instances/usage", self.usage, offload=always)
        r.add("GET", "/instances/{instance_id}/usage", self.instance_usage, offload=always)
        r.add("PUT", "/instances/{instance_id}/heartbeat", self.heartbeat)
        r.add("DELETE", "/instances/{instance_id}", self.deregister)
        r.add("PUT", "/config/chunk-size", self.bind_chunk_size)
        r.add("POST", "/events", self.events, offload=_big_body)
        r.add("POST", "/directory/lookup", self.lookup, offload=_big_body)
        r.add("POST", "/directory/blend-lookup", self.blend_lookup, offload=always)
        r.add("GET", "/directory/stats", self.stats, offload=always)
        r.add("GET", "/directory/keys", self.keys, offload=always)
        r.add("GET", "/healthz", self.healthz)
        r.add("GET", "/readyz", self.readyz)
        r.add("GET", "/metrics", self.metrics, offload=always)
        r.add("GET", "/openapi.json", self.openapi)
        self._page.add_routes(r)
        if self._quotas is not None:
            self._quotas.add_routes(r)
        if self._cache is not None:
            self._cache.add_routes(r)
        for extra in self._extra_routes:
            extra.add_routes(r)
        return r

    def server(self) -> HttpServer:
        """The HTTP server of these routes, with the token check when one is set."""
        return HttpServer(
            self.router(),
            translate_error,
            max_body_bytes=self._cfg.max_body_bytes,
            max_connections=self._cfg.max_connections or None,
            max_buffered_bytes=self._cfg.max_buffered_bytes,
            header_timeout=self._cfg.header_timeout_s,
            body_timeout=self._cfg.body_timeout_s,
            min_body_rate=self._cfg.min_body_rate,
            gate=(
                BearerAuth(self._cfg.auth_token, self._cfg.operator_token)
                if self._cfg.auth_token or self._cfg.operator_token
                else None
            ),
        )

    # ---- membership ------------------------------------------------------------------

    async def register(self, request: HttpRequest) -> HttpResponse:
        req = _decode(_register_decoder, request.body)
        # LMCache 0.5.6's schema strips these three; an id left empty is generated
        iid = InstanceId(strip_field(req.instance_id)) or InstanceId(f"mp-{uuid.uuid4().hex}")
        info = InstanceInfo(
            instance_id=iid,
            ip=strip_field(req.ip),
            http_port=req.http_port,
            metadata=dict(req.metadata),
            p2p_advertised_url=strip_field(req.p2p_advertised_url or ""),
            mq_port=req.mq_port or 0,
            incarnation=req.incarnation or Incarnation(0),
            contract=req.contract.to_core() if req.contract is not None else None,
            incarnation_from_events=req.incarnation is None,
        )
        check_registration(info)  # before it travels (Kafka) or is held anywhere
        if req.credential_digest:
            info = msgspec.structs.replace(info, credential_digest=_digest(req.credential_digest))
        if req.chunk_size is not None:
            # LMCache 0.5.7 binds first: a conflict (409) registers nothing, and a binding
            # stays even if the registration is then refused.
            await self._members.bind_chunk_size(req.chunk_size)
        outcome = await self._members.register(info, _proof(request))
        return _json(RegisterResponse(iid, outcome.re_registered, outcome.incarnation))

    async def heartbeat(self, request: HttpRequest) -> HttpResponse:
        iid = InstanceId(request.path_params["instance_id"])
        if not await self._members.heartbeat(iid, _proof(request)):
            raise HttpError(404, f"unknown instance {iid}; re-register")
        return _json(HeartbeatResponse(iid))

    async def deregister(self, request: HttpRequest) -> HttpResponse:
        iid = InstanceId(request.path_params["instance_id"])
        await self._members.deregister(iid, _proof(request))
        return HttpResponse(204)

    async def bind_chunk_size(self, request: HttpRequest) -> HttpResponse:
        """`PUT /config/chunk-size` (LMCache 0.5.7): bind once; the same size again is
        200, another (or one below the minimum before binding) 409."""
        try:
            req = _chunk_size_decoder.decode(request.body or b"null")
        except (msgspec.MsgspecError, RecursionError) as exc:
            # LMCache's route answers FastAPI's 422 with a ``detail``; so does this one.
            return _json(DetailResponse(f"invalid body: {exc}"), 422)
        bound = await self._members.bind_chunk_size(req.chunk_size)
        return _json(ChunkSizeBindResponse(bound))

    def list_instances(self, request: HttpRequest) -> HttpResponse:
        return _json(InstancesResponse(self._svc.views.instances(self._clock())))

    def usage(self, request: HttpRequest) -> HttpResponse:
        """In the pool: it walks the directory's owners."""
        return _json(self._svc.views.usage())

    def instance_usage(self, request: HttpRequest) -> HttpResponse:
        iid = request.path_params["instance_id"]
        for inst in self._svc.views.usage().instances:
            if inst.instance_id == iid:
                return _json(inst)
        raise HttpError(404, f"unknown instance {iid!r}")

    # ---- events ----------------------------------------------------------------------

    def events(self, request: HttpRequest) -> HttpResponse:
        """Runs on the loop, or in the pool for a body over `_INLINE_BODY_BYTES`."""
        if self._events_refusal:
            raise HttpError(409, self._events_refusal)
        ctype = request.headers.get("content-type", "application/json")
        try:
            batches = decode_events(request.body, ctype, self._cfg.max_batch_entries)
        except InvalidInput:  # TooLarge included: answered 413
            self._metrics.ingest_batches.labels("invalid", "http").inc()
            raise
        return _json(self._svc.ingest.apply(batches, self._clock(), proof=_proof(request)))

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

    def lookup(self, request: HttpRequest) -> HttpResponse:
        """Runs on the loop, or in the pool for a body over `_INLINE_BODY_BYTES` (about
        80k JSON tokens): the longest inline lookup takes a few milliseconds. The answer
        says in `Server-Timing` how long it took here, from the body to the answer's
        bytes (``app``, what `bench.coordinator_bench` reports as server-side), and
        each step's part of it: ``decode``, ``hash`` (tokens form), ``probe``,
        ``encode``, and ``gc``, the collector's pauses in between (inside the steps).
        Before ``app``: ``recv``, from the data holding the request's first byte to this
        handler (the body arriving, the HTTP parse, a wait behind a pipelined request)."""
        recv = time.monotonic() - request.arrived if request.arrived else 0.0
        gc_before = self._gc.total if self._gc is not None else 0.0
        marks = [time.perf_counter()]
        response = self._lookup(request, marks)
        end = time.perf_counter()
        steps = [f"recv;dur={recv * 1000:.3f}"]
        steps += [
            f"{name};dur={(t1 - t0) * 1000:.3f}"
            for name, t0, t1 in zip(_LOOKUP_STEPS, marks, marks[1:], strict=False)
        ]
        if self._gc is not None:
            steps.append(f"gc;dur={(self._gc.total - gc_before) * 1000:.3f}")
        steps.append(f"app;dur={(end - marks[0]) * 1000:.3f}")
        timing = ("Server-Timing", ", ".join(steps))
        return dataclasses.replace(response, headers=(*response.headers, timing))

    def _lookup(self, request: HttpRequest, marks: list[float]) -> HttpResponse:
        """The lookup; appends the time at the end of each of `_LOOKUP_STEPS` it took to
        ``marks`` (which holds its start)."""
        req = decode_lookup(request.body, request.headers.get("content-type", ""))
        marks.append(time.perf_counter())
        forms = (req.keys is not None) + (req.token_ids is not None) + (req.tokens_b64 is not None)
        if forms != 1:
            raise HttpError(400, "give exactly one of keys, token_ids or tokens_b64")
        if req.keys is not None:
            if len(req.keys) > self._cfg.max_lookup_keys:
                raise HttpError(
                    413, f"{len(req.keys)} keys exceed the limit of {self._cfg.max_lookup_keys}"
                )
            return self._lookup_keys(req.keys, marks)
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
        t0 = time.perf_counter()
        hashes = self._svc.lookups.hash_tokens(tokens)
        marks.append(time.perf_counter())
        res = self._svc.lookups.prefix(hashes, ns)
        marks.append(time.perf_counter())
        self._metrics.lookup_seconds.labels("tokens").observe(marks[-1] - t0)
        holders = holders_wire(res, self._svc.state.fleet.chunk_size)
        body = lookup_json(list(map(bytes.hex, hashes)), ns, res, holders)
        marks.append(time.perf_counter())
        return HttpResponse(200, body)

    def _lookup_keys(self, asked: list[KeyWire], marks: list[float]) -> HttpResponse:
        marks.append(marks[-1])  # no hashing in the keys form
        t0 = time.perf_counter()
        ns = shared_namespace(asked)
        hexes = list(map(_get_hex, asked))
        if ns is not None and set(map(len, hexes)) == {64}:
            # The common case (one engine asks about its own chunks): one hex decode
            # and one lookup of the hash blob, answered with the asked hex echoed.
            try:
                blob = bytes.fromhex("".join(hexes))
            except ValueError:
                pass  # the per-key path names the bad key
            else:
                cols = self._svc.lookups.blob(blob, ns)
                marks.append(time.perf_counter())
                self._metrics.lookup_seconds.labels("keys").observe(marks[-1] - t0)
                body = lookup_json(hexes, ns, cols, [])
                marks.append(time.perf_counter())
                return HttpResponse(200, body)
        results = self._svc.lookups.keys([k.to_core() for k in asked])
        marks.append(time.perf_counter())
        self._metrics.lookup_seconds.labels("keys").observe(marks[-1] - t0)
        response = _json(keys_response(results, asked))
        marks.append(time.perf_counter())
        return response

    def blend_lookup(self, request: HttpRequest) -> HttpResponse:
        """Always in the pool: a blend lookup scans every position of the prompt."""
        if not self._svc.lookups.blend_enabled:
            raise HttpError(404, "blend lookup is disabled; start with --enable-blend-lookup")
        req = _decode(_blend_decoder, request.body)
        raw = _b64_tokens(req.tokens_b64)
        if len(raw) // 4 > self._cfg.max_lookup_tokens:
            raise HttpError(
                413,
                f"{len(raw) // 4} tokens exceed the limit of {self._cfg.max_lookup_tokens}",
            )
        ns = self._namespace(
            req.model_name, req.world_size, req.kv_rank, req.object_group_id, req.cache_salt
        )
        t0 = time.perf_counter()
        matches = self._svc.lookups.blend(raw, ns)
        self._metrics.lookup_seconds.labels("blend").observe(time.perf_counter() - t0)
        return _json(
            BlendLookupResponse(
                [BlendMatchWire(m.chunk_hash.hex(), m.old_st, m.cur_st) for m in matches]
            )
        )

    # ---- views (in the pool: each walks a whole structure) ---------------------------

    def stats(self, request: HttpRequest) -> HttpResponse:
        """Counts by tier and by instance, and a count of namespaces: nothing per salt.
        With an operator token, only its bearer sees the instances' cursors."""
        with_digest = request.query.get("digest", "") in ("1", "true")
        redact = not self._operator.sees_tenants(request)
        return _json(self._svc.views.stats(with_digest, redact=redact))

    def keys(self, request: HttpRequest) -> HttpResponse:
        """Every key with its namespace (its ``cache_salt``: a tenant) and hash prefix:
        with an operator token, for its bearer only (403), as there is no sum of it."""
        if not self._operator.sees_tenants(request):
            raise HttpError(403, "listing keys by namespace needs the operator token")
        q = request.query
        try:
            offset = int(q.get("offset", "0"))
            limit = int(q.get("limit", "100"))
        except ValueError as exc:
            raise HttpError(400, "offset and limit must be integers") from exc
        if not 0 <= offset <= MAX_INT64 or not 1 <= limit <= _MAX_PAGE:
            raise HttpError(400, f"need 0 <= offset <= {MAX_INT64} and 1 <= limit <= {_MAX_PAGE}")
        tier_name = q.get("tier")
        tier = None
        if tier_name is not None and tier_name != "all":  # LMCache's "all": no filter
            try:
                tier = Tier(tier_name)
            except ValueError as exc:
                raise HttpError(400, f"tier must be l1, l2 or all, got {tier_name!r}") from exc
        # ``instance_id`` is LMCache's name of the filter; empty filters nothing (and
        # ``backend`` alike), as in LMCache.
        instance = q.get("instance") or q.get("instance_id") or None
        return _json(
            self._svc.views.keys_page(
                offset,
                limit,
                tier,
                None if instance is None else InstanceId(instance),
                q.get("backend") or None,
            )
        )

    def healthz(self, request: HttpRequest) -> HttpResponse:
        return _json({"status": "healthy"})  # LMCache 0.5.6's body, byte for byte

    def readyz(self, request: HttpRequest) -> HttpResponse:
        ready, reason = self._svc.readiness.status()
        if ready:
            return _json(ReadyResponse(True, ""))
        return _json(ReadyResponse(False, reason), 503)

    def metrics(self, request: HttpRequest) -> HttpResponse:
        """The per-salt families only for a caller who may see tenants."""
        return HttpResponse(
            200,
            self._metrics.render(tenants=self._operator.sees_tenants(request)),
            "text/plain; version=0.0.4; charset=utf-8",
        )

    def openapi(self, request: HttpRequest) -> HttpResponse:
        return HttpResponse(200, self._openapi)


_get_hex = attrgetter("chunk_hash_hex")


def _digest(text: str) -> bytes:
    try:
        digest = bytes.fromhex(text)
    except ValueError as exc:
        raise HttpError(400, "credential_digest must be hex") from exc
    if len(digest) != DIGEST_BYTES:
        raise HttpError(400, f"credential_digest must be {DIGEST_BYTES} bytes (SHA-256)")
    return digest


def _proof(request: HttpRequest) -> bytes:
    """The digest of the instance secret the request presents; b"" for none."""
    secret = request.headers.get(INSTANCE_SECRET_HEADER)
    return credential_digest(secret) if secret else b""


def _b64_tokens(raw: bytes) -> bytes:
    """``tokens_b64`` arrives decoded (msgspec validates the base64); check its width."""
    if len(raw) % 4:
        raise HttpError(400, "tokens_b64 must decode to little-endian uint32 tokens")
    return raw
