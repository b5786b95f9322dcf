"""The coordinator's quota and pin routes, answered as LMCache 0.5.6's coordinator does
(lmcache/v1/mp_coordinator/controllers/eviction_http_api.py).

- ``PUT`` / ``GET /quota/config``: the default quota (``tier`` l2 only, else 400);
- ``PUT`` / ``DELETE`` / ``GET /quota/{cache_salt}`` (``_default`` names the empty salt;
  ``DELETE /quota/config`` removes the quota of a salt named ``config``, as LMCache's
  routing does); ``GET /quota``: quota and usage of every salt (``tier`` l1 or l2, else
  400; L1 has no quotas);
- ``POST`` / ``DELETE /cache/pins``: pin or unpin the keys of a token sequence's
  complete chunks (every rank, object group 0; a pin covers every group), fleet-wide;
  ``GET /cache/pins``: the pin table, paged, filtered by salt and model.

Refusals: a body or query that does not decode is a 422 (FastAPI's code), a request
LMCache refuses by its semantics a 400, both as ``{"detail": reason}``. With an operator
token (`--operator-token-file`), every write needs it (403 without), and so do the reads
of one salt (``GET /quota/{cache_salt}``) and of the pin table (``GET /cache/pins``, every
pin names its salt), while ``GET /quota`` answers anyone else the total alone, with no
salt listed; ``GET /quota/config`` needs only what the gate asks. Writes go through an
`OperatorLog`: applied here, or with Kafka published and applied from the log by every
replica (answered once this one applied it). Must not hold state: the controller does.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any, Protocol, TypeVar

import msgspec

from kvatlas.coordinator.http.auth import OperatorCheck
from kvatlas.coordinator.http.edge.messages import HttpRequest, HttpResponse
from kvatlas.coordinator.http.edge.routing import Router, always
from kvatlas.coordinator.quota.controller import QuotaController
from kvatlas.coordinator.service import CoordinatorService
from kvatlas.core.coordinator.quotas import (
    GIB,
    DeleteQuota,
    OperatorOp,
    OpResult,
    PinChunks,
    SetDefaultQuota,
    SetQuota,
    check_key_fields,
    salt_from_path,
)
from kvatlas.core.errors import HttpRefusal, InvalidInput
from kvatlas.core.keys import HASH_BYTES
from kvatlas.core.types import MAX_INT64, Tier
from kvatlas.wire.cache_api import MAX_TOKEN_IDS
from kvatlas.wire.decoding import decode_or_refuse
from kvatlas.wire.http_api import KeyWire
from kvatlas.wire.quota_api import (
    DetailResponse,
    PinList,
    PinnedKeyInfo,
    PinRequest,
    PinResponse,
    QuotaConfigRequest,
    QuotaConfigResponse,
    QuotaResponse,
    SaltStatus,
    SetQuotaRequest,
    StatusList,
)

_T = TypeVar("_T")
_encoder = msgspec.json.Encoder()
_MAX_PAGE = 10000
_TIERS = ("l1", "l2", "all")


class OperatorLog(Protocol):
    """Where an operator write goes to be applied (here, or every replica via Kafka)."""

    async def submit(self, op: OperatorOp) -> OpResult: ...


class LocalOperatorLog:
    """One coordinator: apply here (in the pool: the operator file is written)."""

    def __init__(self, controller: QuotaController) -> None:
        self._ctl = controller

    async def submit(self, op: OperatorOp) -> OpResult:
        return await asyncio.to_thread(self._ctl.apply, op)


class Refused(HttpRefusal):
    """A 4xx in LMCache's words (``{"detail": reason}``)."""


def translate_refusal(exc: Exception) -> HttpResponse | None:
    if isinstance(exc, Refused):
        return _json(DetailResponse(exc.reason), exc.status)
    return None


def _json(obj: Any, status: int = 200) -> HttpResponse:
    return HttpResponse(status, _encoder.encode(obj))


def _decode(t: type[_T], body: bytes | bytearray) -> _T:
    decoder = msgspec.json.Decoder(t, strict=False)
    return decode_or_refuse(decoder, body or b"null", Refused, malformed=422)


def _tier(request: HttpRequest) -> Tier | str:
    """The ``tier`` query parameter (default l2); ``all`` comes back as the string."""
    name = request.query.get("tier", "l2")
    if name not in _TIERS:
        raise Refused(422, f"tier must be one of l1, l2, all; got {name!r}")
    return _tier_of(name)


def _tier_of(name: str) -> Tier | str:
    return "all" if name == "all" else Tier(name)


def _require_quota_tier(tier: Tier | str) -> None:
    if tier is not Tier.L2:
        raise Refused(400, f"quotas apply to tier 'l2' only, not {str(tier)!r}")


def _require_accounted_tier(tier: Tier | str) -> Tier:
    if not isinstance(tier, Tier):
        raise Refused(400, "tier 'all' has no usage accounting; only 'l1', 'l2'")
    return tier


def _limit_bytes(gib: float) -> int:
    if not math.isfinite(gib) or gib * GIB > MAX_INT64:
        raise Refused(422, f"invalid body: limit must be a finite number of GiB, got {gib}")
    return int(gib * GIB)


def _int_query(request: HttpRequest, name: str, default: int, lo: int, hi: int) -> int:
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError as exc:
        raise Refused(422, f"{name} must be an integer, got {raw[:32]!r}") from exc
    if not lo <= value <= hi:
        raise Refused(422, f"{name} must be in [{lo}, {hi}], got {value}")
    return value


class QuotaRoutes:
    def __init__(
        self,
        controller: QuotaController,
        service: CoordinatorService,
        log: OperatorLog,
        operator: OperatorCheck,
    ) -> None:
        self._ctl = controller
        self._svc = service
        self._log = log
        self._operator = operator

    @property
    def controller(self) -> QuotaController:
        return self._ctl

    def add_routes(self, r: Router) -> None:
        r.add("PUT", "/quota/config", self.set_config)
        r.add("GET", "/quota/config", self.get_config)
        r.add("DELETE", "/quota/config", self.delete_config_salt)
        r.add("PUT", "/quota/{cache_salt}", self.set_quota)
        r.add("DELETE", "/quota/{cache_salt}", self.delete_quota)
        r.add("GET", "/quota/{cache_salt}", self.get_status, offload=always)
        r.add("GET", "/quota", self.list_status, offload=always)
        r.add("POST", "/cache/pins", self.pin)
        r.add("DELETE", "/cache/pins", self.unpin)
        r.add("GET", "/cache/pins", self.list_pins, offload=always)

    def _check_operator(self, request: HttpRequest) -> None:
        if self._operator.enabled and not self._operator(request):
            self._ctl.metrics.operator_refusals.labels("auth").inc()
            raise Refused(403, "quota and pin writes need the operator token")

    def _check_tenant_reader(self, request: HttpRequest, what: str) -> None:
        if not self._operator.sees_tenants(request):
            self._ctl.metrics.operator_refusals.labels("auth").inc()
            raise Refused(403, f"{what} needs the operator token")

    # ---- quota config -----------------------------------------------------------------

    async def set_config(self, request: HttpRequest) -> HttpResponse:
        self._check_operator(request)
        body = _decode(QuotaConfigRequest, request.body)
        _require_quota_tier(_tier_of(body.tier))
        limit = None if body.default_limit_gb is None else _limit_bytes(body.default_limit_gb)
        await self._log.submit(SetDefaultQuota(limit))
        return _json(QuotaConfigResponse(body.default_limit_gb))

    def get_config(self, request: HttpRequest) -> HttpResponse:
        _require_quota_tier(_tier(request))
        limit = self._ctl.quota_config()
        return _json(QuotaConfigResponse(None if limit is None else limit / GIB))

    # ---- quotas -----------------------------------------------------------------------

    async def set_quota(self, request: HttpRequest) -> HttpResponse:
        self._check_operator(request)
        body = _decode(SetQuotaRequest, request.body)
        _require_quota_tier(_tier_of(body.tier))
        salt = salt_from_path(request.path_params["cache_salt"])
        await self._log.submit(SetQuota(salt, _limit_bytes(body.limit_gb)))
        return _json(QuotaResponse(salt, body.limit_gb, "ok"))

    async def delete_quota(self, request: HttpRequest) -> HttpResponse:
        return await self._delete(request, salt_from_path(request.path_params["cache_salt"]))

    async def delete_config_salt(self, request: HttpRequest) -> HttpResponse:
        return await self._delete(request, "config")

    async def _delete(self, request: HttpRequest, salt: str) -> HttpResponse:
        self._check_operator(request)
        _require_quota_tier(_tier(request))
        result = await self._log.submit(DeleteQuota(salt))
        return _json(QuotaResponse(salt, 0.0, "removed" if result.found else "not_found"))

    def get_status(self, request: HttpRequest) -> HttpResponse:
        self._check_tenant_reader(request, "one salt's quota and usage")
        tier = _require_accounted_tier(_tier(request))
        salt = salt_from_path(request.path_params["cache_salt"])
        limit, usage = self._ctl.salt_status(salt, tier)
        return _json(
            SaltStatus(salt, 0.0 if limit is None else limit / GIB, limit is not None, usage / GIB)
        )

    def list_status(self, request: HttpRequest) -> HttpResponse:
        """Every salt's row, or for a caller who may not see tenants the total alone."""
        tier = _require_accounted_tier(_tier(request))
        total, by_salt, limits = self._ctl.status_rows(tier)
        if not self._operator.sees_tenants(request):
            return _json(StatusList(total / GIB, []))
        return _json(
            StatusList(
                total / GIB,
                [
                    SaltStatus(
                        salt,
                        limits[salt] / GIB if salt in limits else 0.0,
                        salt in limits,
                        by_salt.get(salt, 0) / GIB,
                    )
                    for salt in sorted(set(by_salt) | set(limits))
                ],
            )
        )

    # ---- pins -------------------------------------------------------------------------

    async def pin(self, request: HttpRequest) -> HttpResponse:
        return await self._pin(request, pin=True)

    async def unpin(self, request: HttpRequest) -> HttpResponse:
        return await self._pin(request, pin=False)

    async def _pin(self, request: HttpRequest, *, pin: bool) -> HttpResponse:
        self._check_operator(request)
        body = _decode(PinRequest, request.body)
        op = await asyncio.to_thread(self.resolve, body, unpin=not pin)
        await self._log.submit(op)
        chunks = len(op.hashes) // HASH_BYTES
        return _json(PinResponse(chunks, chunks * body.world_size, "pinned" if pin else "unpinned"))

    def resolve(self, body: PinRequest, *, unpin: bool = False) -> PinChunks:
        """The complete chunks of the body's tokens, whose keys (every rank, object group
        0, chunk-major) the op pins: LMCache's ``resolve_object_keys``."""
        n = len(body.token_ids)
        if n > MAX_TOKEN_IDS:
            raise Refused(
                400,
                f"too many token_ids in a single request (limit={MAX_TOKEN_IDS}, got={n})",
            )
        try:
            check_key_fields(body.model_name, body.cache_salt)
        except InvalidInput as exc:
            self._ctl.metrics.operator_refusals.labels("invalid").inc()
            raise Refused(400, str(exc)) from exc
        hashes = self._svc.lookups.hash_tokens(body.token_ids)
        return PinChunks(body.model_name, body.world_size, body.cache_salt, b"".join(hashes), unpin)

    def list_pins(self, request: HttpRequest) -> HttpResponse:
        self._check_tenant_reader(request, "the pin table (each pin names its salt)")
        q = request.query
        offset = _int_query(request, "offset", 0, 0, MAX_INT64)
        limit = _int_query(request, "limit", 1000, 1, _MAX_PAGE)
        total, page = self._ctl.pin_page(
            q.get("cache_salt", ""), q.get("model_name", ""), offset, limit
        )
        return _json(
            PinList(total, [PinnedKeyInfo(KeyWire.from_core(p.key), p.pin_count) for p in page])
        )
