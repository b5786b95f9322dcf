"""Message shapes of the cache-control API, LMCache 0.5.6's field for field.

Two surfaces share these shapes:

- a cache server's node-local ``/cache/*`` routes (``DELETE /cache/objects``,
  ``GET /cache/objects``, ``POST /cache/prefetches`` (202),
  ``GET /cache/prefetches/{request_id}``, ``POST /cache/clear``), which a kvatlas server
  and an LMCache MP server both serve (lmcache/v1/multiprocess/http_apis/cache_api.py and
  schemas.py), and the coordinator drives through ``coordinator.server_control``;
- the coordinator's fleet-level routes (``POST /cache/prefetches``,
  ``GET /cache/prefetches/{instance_id}/{request_id}``, ``POST /cache/delete``:
  lmcache/v1/mp_coordinator/schemas.py).

A reply of LMCache's that leaves a field out (the ``noop`` prefetch has no
``request_id``, a pending poll no key counts, a delete without an L2 failure no
``error``) is a Struct with ``omit_defaults``, so the JSON is the same bytes' worth of
fields. Requests ignore unknown fields (a newer client may send more).

Owns shapes and their bounds only; no I/O and no state.
"""

from __future__ import annotations

from typing import Annotated, Final, Literal

import msgspec

from kvatlas.core.keys import MAX_TOKEN_ID, ObjectKey
from kvatlas.core.types import U63
from kvatlas.wire.http_api import KeyWire

MAX_DELETE_BATCH: Final = 10_000
"""Keys one ``DELETE /cache/objects`` may carry (LMCache's ``MAX_DELETE_BATCH``): a
bigger request is a 400, so a caller splits at this size."""
MAX_TOKEN_IDS: Final = 1_000_000
"""Token ids one token-addressed request may carry (LMCache's ``MAX_TOKEN_IDS``)."""

CacheTier = Literal["l1", "l2", "all"]
"""Which tier(s) an operation acts on; ``all`` only where an operation allows both."""
TokenId = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKEN_ID)]
WorldSize = Annotated[int, msgspec.Meta(ge=1, le=256)]
"""LMCache packs the world size into 8 bits of the kv rank."""


# ---- a cache server's node-local routes ------------------------------------------------


class DeleteObjectsRequest(msgspec.Struct, frozen=True):
    """Body of ``DELETE /cache/objects`` on a server. ``tier`` defaults to ``l2`` (the
    fleet eviction loop's delete); ``force`` deletes L1 keys even when locked;
    ``adapter`` names an L2 adapter (None: the primary)."""

    keys: list[KeyWire]
    tier: CacheTier = "l2"
    force: bool = False
    adapter: str | None = None


class DeleteObjectsResponse(msgspec.Struct, frozen=True, omit_defaults=True):
    """``deleted``: keys removed across the tiers acted on; ``skipped``: L1 keys refused
    because they were locked (non-force); ``ok`` False with ``error`` when L2 failed."""

    deleted: int
    skipped: int
    ok: bool
    error: str | None = None


class ObjectEntryWire(msgspec.Struct, frozen=True):
    """One listed object (LMCache's ``KeyEntry``)."""

    key: KeyWire
    size_bytes: int


class ObjectsPage(msgspec.Struct, frozen=True):
    """Reply of ``GET /cache/objects``: one page of one L2 adapter's keys."""

    adapter: str
    shared: bool
    entries: list[ObjectEntryWire]
    next_page_token: str | None = None


class NodePrefetchRequest(msgspec.Struct, frozen=True):
    """Body of ``POST /cache/prefetches`` on a server: warm L1 with the complete chunks of
    ``token_ids`` (today only from L2 into L1)."""

    model_name: str
    world_size: WorldSize
    token_ids: list[TokenId]
    cache_salt: str = ""
    source_tier: CacheTier = "l2"
    target_tier: CacheTier = "l1"


class NodePrefetchResponse(msgspec.Struct, frozen=True, omit_defaults=True, kw_only=True):
    """``{"request_id", "chunks", "status": "submitted"}`` or ``{"chunks": 0, "status":
    "noop"}`` (a sequence shorter than one chunk)."""

    request_id: str = ""
    chunks: int
    status: str


class NodePrefetchStatus(msgspec.Struct, frozen=True, omit_defaults=True):
    """Reply of ``GET /cache/prefetches/{request_id}``: ``pending``, or ``completed`` with
    the keys found in L1 of those requested. The first poll that sees it completed drops
    the job: the next one is a 404."""

    request_id: str
    status: str
    found_keys: int | None = None
    total_keys: int | None = None


class ClearRequest(msgspec.Struct, frozen=True):
    """Body of ``POST /cache/clear`` (optional): only ``l1``; ``force`` also drops
    chunks that are being read or written."""

    tier: CacheTier = "l1"
    force: bool = False


class ChecksumRequest(msgspec.Struct, frozen=True):
    """Body of ``POST /cache/checksums``: MD5 digests of a registered worker's KV
    blocks, ``chunk_size`` blocks a chunk (LMCache's diagnostic; its bench reads it)."""

    block_ids: list[int] = msgspec.field(default_factory=list)
    chunk_size: int = 0
    instance_id: int = 0
    layerwise: bool = False


class ClearedWire(msgspec.Struct, frozen=True):
    tier: str


class ClearResponse(msgspec.Struct, frozen=True):
    status: str
    cleared: ClearedWire


# ---- the coordinator's fleet-level routes ----------------------------------------------


class PrefetchRequest(msgspec.Struct, frozen=True):
    """Body of ``POST /cache/prefetches`` on the coordinator: forwarded to the server
    ``instance_id`` names."""

    instance_id: str
    model_name: str
    world_size: WorldSize
    token_ids: list[TokenId] = []
    cache_salt: str = ""


class PrefetchResponse(msgspec.Struct, frozen=True, kw_only=True):
    """``request_id`` is the server's job id, empty when ``status`` is ``noop``. Fields
    in LMCache's order."""

    instance_id: str
    request_id: str = ""
    chunks: int = 0
    status: str


class DeleteRequest(msgspec.Struct, frozen=True):
    """Body of ``POST /cache/delete`` on the coordinator. ``force`` deletes locked L1
    keys on the server and L2 keys the fleet pins (and clears those pins)."""

    instance_id: str
    model_name: str
    world_size: WorldSize
    token_ids: list[TokenId] = []
    cache_salt: str = ""
    tier: CacheTier = "all"
    force: bool = False


class DeleteResponse(msgspec.Struct, frozen=True, kw_only=True):
    """``requested``: chunks the tokens resolved to; ``affected``: keys the server
    removed; ``skipped``: keys refused (L1 locks the server reported, plus L2 keys held
    back for a pin). Fields in LMCache's order."""

    instance_id: str
    requested: U63 = 0
    affected: U63 = 0
    skipped: U63 = 0
    status: str


def keys_wire(keys: list[ObjectKey]) -> list[KeyWire]:
    return [KeyWire.from_core(k) for k in keys]
