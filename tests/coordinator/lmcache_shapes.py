"""Bodies in the exact JSON shapes LMCache 0.5.6's servers send (their pydantic dumps),
for the coordinator tests that must read them as LMCache's coordinator does."""

from __future__ import annotations

from typing import Any

import msgspec

from .events import MODEL, RANK

INCARNATION = 1760000000
"""LMCache servers send their process start time (seconds) as the incarnation."""


def lmcache_key(h: bytes) -> dict[str, Any]:
    return {
        "chunk_hash_hex": h.hex(),
        "model_name": MODEL,
        "kv_rank": RANK,
        "object_group_id": 0,
        "cache_salt": "",
    }


def lmcache_batch(
    iid: str, seq: int, event_type: str, incarnation: int = INCARNATION, **fields: Any
) -> dict[str, Any]:
    """One `CacheEventBatch` as `CacheEventsRequest.model_dump(mode="json")` writes it."""
    out: dict[str, Any] = {
        "instance_id": iid,
        "incarnation": incarnation,
        "seq": seq,
        "event_type": event_type,
        "tier": "l1",
        "backend": "dram",
        "entries": [],
        "shared": False,
        "ts": 1760000001.5,
        "capacity_bytes": 0,
        "capacity_revision": 0,
    }
    out.update(fields)
    return out


def config_batch(
    iid: str, seq: int, tier: str, backend: str, capacity: int, revision: int, **fields: Any
) -> dict[str, Any]:
    return lmcache_batch(
        iid,
        seq,
        "config",
        tier=tier,
        backend=backend,
        capacity_bytes=capacity,
        capacity_revision=revision,
        **fields,
    )


def store_batch(
    iid: str, seq: int, hashes: list[bytes], size: int, **fields: Any
) -> dict[str, Any]:
    entries = [
        {"key": lmcache_key(h), "size_bytes": size, "token_ids": [], "token_offset": -1}
        for h in hashes
    ]
    return lmcache_batch(iid, seq, "store", entries=entries, **fields)


def events_body(*batches: dict[str, Any]) -> bytes:
    return msgspec.json.encode({"batches": list(batches)})
