"""Message shapes of the coordinator's quota and pin routes, LMCache 0.5.6's field for
field (lmcache/v1/mp_coordinator/schemas.py).

- ``PUT /quota/config`` (`QuotaConfigRequest` -> `QuotaConfigResponse`), ``GET`` it;
- ``PUT /quota/{cache_salt}`` (`SetQuotaRequest` -> `QuotaResponse`), ``DELETE`` it
  (`QuotaResponse`, ``status`` removed or not_found), ``GET`` it (`SaltStatus`);
- ``GET /quota`` (`StatusList`);
- ``POST`` / ``DELETE /cache/pins`` (`PinRequest` -> `PinResponse`), ``GET /cache/pins``
  (`PinList`).

Quotas and usage travel in GiB (2**30 bytes) as LMCache's do; the coordinator keeps
bytes. Requests ignore unknown fields, and are decoded leniently (a number in a string
is a number) as LMCache's pydantic models are. Owns the shapes only: no I/O, no state.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from kvatlas.wire.cache_api import CacheTier, TokenId, WorldSize
from kvatlas.wire.http_api import KeyWire

Gib = Annotated[float, msgspec.Meta(ge=0.0)]


class SetQuotaRequest(msgspec.Struct, frozen=True):
    limit_gb: Gib
    tier: CacheTier = "l2"


class QuotaResponse(msgspec.Struct, frozen=True):
    cache_salt: str
    limit_gb: float
    status: str


class QuotaConfigRequest(msgspec.Struct, frozen=True):
    """``default_limit_gb`` None: salts without a quota are exempt from eviction."""

    default_limit_gb: Gib | None = None
    tier: CacheTier = "l2"


class QuotaConfigResponse(msgspec.Struct, frozen=True):
    default_limit_gb: float | None


class SaltStatus(msgspec.Struct, frozen=True):
    """One salt's quota (of the tier asked; only L2 has quotas) and usage."""

    cache_salt: str
    quota_limit_gb: float
    quota_exists: bool
    usage_gb: float


class StatusList(msgspec.Struct, frozen=True):
    total_gb: float
    by_cache_salt: list[SaltStatus]


class PinRequest(msgspec.Struct, frozen=True):
    """The token sequence whose complete chunks' keys (every rank, object group 0) are
    pinned or unpinned."""

    model_name: str
    world_size: WorldSize
    token_ids: list[TokenId] = []
    cache_salt: str = ""


class PinResponse(msgspec.Struct, frozen=True):
    """``requested``: complete chunks; ``affected``: keys (chunks x ranks)."""

    requested: int
    affected: int
    status: str


class PinnedKeyInfo(msgspec.Struct, frozen=True):
    key: KeyWire
    pin_count: int


class PinList(msgspec.Struct, frozen=True):
    """``total``: pinned keys matching the filters; ``pins``: the page asked for."""

    total: int
    pins: list[PinnedKeyInfo]


class DetailResponse(msgspec.Struct, frozen=True):
    """A refusal as LMCache's coordinator words it (FastAPI's ``{"detail": ...}``)."""

    detail: str
