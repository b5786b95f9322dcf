"""Response shapes of the coordinator's read-only HTTP endpoints: `GET /directory/stats`,
`GET /directory/keys` and `GET /readyz`.

The coordinator encodes these Structs and `runtime.coordinator_client` decodes its
answers into the same ones, so both sides share one definition (the rest of the
API's shapes are in `wire.http_api` and the modules it names; the blend index's size
is `core.blend.BlendStats` as it is). Owns the shapes only: no I/O, no state, no
mapping from core snapshots (the coordinator's `views` builds them).
"""

from __future__ import annotations

import msgspec

from kvatlas.core.coordinator.blend import BlendStats
from kvatlas.wire.directory_api import PlacementWire


class OwnerView(msgspec.Struct, frozen=True):
    """Placements and bytes of one (instance, incarnation, tier, backend)."""

    instance_id: str
    incarnation: int
    tier: str
    backend: str
    placements: int
    bytes: int


class CursorView(msgspec.Struct, frozen=True):
    """The event gate's cursor of one instance. ``incarnation`` and ``last_seq`` are
    null unless the request carried the operator token, when the coordinator has one
    (`--operator-token-file`): they are what a forger of the instance's events needs."""

    instance_id: str
    incarnation: int | None
    last_seq: int | None
    gaps: int
    missing: int


class TokenIdsView(msgspec.Struct, frozen=True):
    keys: int
    """Keys whose chunk token ids are kept (those their senders sent)."""
    bytes: int
    """Memory of those token ids (4 bytes per token)."""


class CompartmentView(msgspec.Struct, frozen=True):
    tier: str
    backend: str
    capacity_bytes: int
    shared: bool


class DeclarationView(msgspec.Struct, frozen=True):
    """An instance's newest capacity declaration (config batches)."""

    instance_id: str
    incarnation: int
    revision: int
    compartments: list[CompartmentView]


class StatsResponse(msgspec.Struct, frozen=True):
    """`GET /directory/stats`."""

    keys: int
    placements: int
    bytes: int
    placements_by_tier: dict[str, int]
    bytes_by_tier: dict[str, int]
    namespaces: int
    owners: list[OwnerView]
    cursors: list[CursorView]
    live_instances: int
    provisional_instances: list[str]
    blend: BlendStats | None
    digest: str | None = None
    """Only with `?digest=1`: blake3 of the directory content (replicas compare it)."""
    kafka_positions: dict[str, int] = {}
    """With Kafka: next offset to consume per partition."""
    capacity: list[DeclarationView] = []
    """The declared capacities, per instance (`GET /instances/usage` joins them with
    the placements' bytes)."""
    token_ids: TokenIdsView | None = None
    """Token ids kept for lookups (None with `--drop-token-ids`)."""
    # LMCache 0.5.6's names of the same counts (its `DirectoryStats`), for its tools.
    num_keys: int = 0
    """Keys with at least one placement (``keys``)."""
    num_placements: int = 0
    """Placements across every key (``placements``)."""
    l1_keys_by_instance: dict[str, int] = {}
    """L1 placements each instance holds (one per key and backend)."""
    l1_count: int = 0
    l1_size_bytes: int = 0
    l2_count: int = 0
    l2_size_bytes: int = 0


class KeyView(msgspec.Struct, frozen=True):
    """One stored key. The directory keeps only the first 8 bytes of a chunk hash (as a
    hint; owners verify the full key), so this is a prefix, not the full hash."""

    chunk_hash_prefix_hex: str
    model_name: str
    kv_rank: int
    object_group_id: int
    cache_salt: str
    placements: list[PlacementWire]
    num_tokens: int = 0
    """Token ids kept for the key's chunk (LMCache's field)."""
    access_count: int = 0
    """ACCESS events applied to the key (LMCache's field)."""


class KeysPage(msgspec.Struct, frozen=True):
    """`GET /directory/keys`: one page; ``next_offset`` is None on the last page.

    Offsets walk the directory's insertion order, which ingest changes between pages:
    a page is a consistent view of its own keys, not of the whole listing."""

    offset: int
    limit: int
    keys: list[KeyView]
    next_offset: int | None
    note: str = "keys are stored as 8-byte chunk hash prefixes"
    total: int = 0
    """Keys matching the filters in the whole directory (LMCache's field)."""


class ReadyResponse(msgspec.Struct, frozen=True):
    ready: bool
    reason: str
