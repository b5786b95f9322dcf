"""L2 bytes per ``cache_salt``, each salt's keys in least-recently-used order, and the
eviction plan that keeps salts under their quotas.

The key directory keeps 8-byte hash prefixes (hints for millions of keys); an eviction
names full keys to the servers that hold them. So the L2 half of the event stream is
also kept here, as LMCache 0.5.6's coordinator keeps it (``CacheUsageManager`` beside
``IsolatedLRUEvictionPolicy``):

- a placement is (key, owner, backend) with its size; ``owner`` is the reporting
  instance, or "" for a shared pool (one copy, whoever reported it);
- STORE upserts a placement and moves the key to its salt's most-recent end; ACCESS
  moves a known key there; DELETE removes a placement, and the key leaves the order
  only when its last L2 placement is gone (its other copies still count against the
  quota, so it must stay evictable);
- L2 bytes outlive their reporter: only DELETE removes them (no fencing).

`eviction_plan` is LMCache's ``compute_eviction_plan`` as a pure function of this
book, the operator state and the two knobs: for each tracked salt at or over
``watermark * limit``, ``ratio`` of its keys by count (all for a limit of 0, at least
one), least recently used first, pinned keys never.

Pure: no I/O, no clock, no locks. The coordinator applies every admitted batch under
its state lock (`apply`).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Mapping

import msgspec

from kvatlas.core.coordinator.quotas import OperatorState
from kvatlas.core.events import EventBatch, KeyBlock
from kvatlas.core.keys import ObjectKey
from kvatlas.core.types import EventType, InstanceId, Tier


class Holder(msgspec.Struct, frozen=True):
    """Who holds an L2 copy: ``owner`` "" for a shared pool (any live server reaches it)."""

    owner: str
    backend: str


class SaltPlan(msgspec.Struct, frozen=True):
    """The keys one salt is to lose in one sweep, and why."""

    cache_salt: str
    keys: list[ObjectKey]
    evict_bytes: int
    usage_bytes: int
    limit_bytes: int


class UsageCapture(msgspec.Struct, frozen=True, array_like=True):
    """The durable form: every placement with its size, in LRU order within its salt
    (a key's copies together)."""

    placements: list[tuple[ObjectKey, str, str, int]]
    order: list[ObjectKey] = []
    """Unused (the placements' order is the LRU order); kept so files read alike."""


class SaltUsage:
    """L2 placements' bytes per key and per salt, with each salt's LRU order.

    One ordered dict per salt maps each key to its holders' sizes: its order is the
    LRU order (a store or read moves the key to the end), so an upsert costs two
    lookups of the key, not four."""

    def __init__(self) -> None:
        self._salts: dict[str, dict[ObjectKey, dict[Holder, int]]] = {}
        self._salt_bytes: dict[str, int] = {}
        self._keys = 0
        self.total_bytes = 0

    # ---- the one way in -----------------------------------------------------------

    def apply(self, batch: EventBatch) -> int:
        """Account one admitted batch (other tiers, CONFIG: nothing); returns the
        number of placements it created or removed."""
        if batch.tier is not Tier.L2 or batch.event_type is EventType.CONFIG:
            return 0
        if batch.event_type is EventType.ACCESS:
            for key, _ in _sized(batch):
                self._touch(key)
            return 0
        holder = Holder("" if batch.shared else batch.instance_id, batch.backend)
        if batch.event_type is EventType.STORE:
            created = self._store_many(((e.key, e.size_bytes) for e in batch.entries), holder)
            if batch.block is not None:
                created += self._store_block(batch.block, holder)
            return created
        return sum(self._delete(key, holder) for key, _ in _sized(batch))

    def _store_many(self, pairs: Iterable[tuple[ObjectKey, int]], holder: Holder) -> int:
        """Upsert ``holder``'s copies; one pass, salt totals added once per salt (the
        hot path of L2 ingest)."""
        salts = self._salts
        deltas: dict[str, int] = {}
        created = 0
        for key, size in pairs:
            salt = key.cache_salt
            order = salts.get(salt)
            if order is None:
                order = salts[salt] = {}
            holders = order.pop(key, None)
            if holders is None:
                order[key] = {holder: size}
                self._keys += 1
                created += 1
                old = 0
            else:
                order[key] = holders
                prev = holders.get(holder)
                holders[holder] = size
                if prev is None:
                    created += 1
                old = prev or 0
            if size != old:
                deltas[salt] = deltas.get(salt, 0) + size - old
        for salt, delta in deltas.items():
            self._add(salt, delta)
        return created

    def _store_block(self, block: KeyBlock, holder: Holder) -> int:
        """`_store_many` of a key block: one salt, one namespace, so the salt's map is
        found once and its total added once (the form kvatlas' servers send)."""
        ns = block.namespace
        m, r, g, salt = ns.model_name, ns.kv_rank, ns.object_group_id, ns.cache_salt
        order = self._salts.get(salt)
        if order is None:
            order = self._salts[salt] = {}
        pop = order.pop
        created = new_keys = delta = 0
        for h, size in zip(block.hash_list(), block.sizes, strict=True):
            key = ObjectKey(h, m, r, g, salt)
            holders = pop(key, None)
            if holders is None:
                order[key] = {holder: size}
                new_keys += 1
                delta += size
                continue
            order[key] = holders
            prev = holders.get(holder)
            holders[holder] = size
            if prev is None:
                created += 1
            delta += size - (prev or 0)
        self._keys += new_keys
        if delta:
            self._add(salt, delta)
        return created + new_keys

    def _delete(self, key: ObjectKey, holder: Holder) -> int:
        order = self._salts.get(key.cache_salt)
        holders = None if order is None else order.get(key)
        if order is None or holders is None or holder not in holders:
            return 0
        self._add(key.cache_salt, -holders.pop(holder))
        if not holders:
            del order[key]
            self._keys -= 1
            if not order:
                del self._salts[key.cache_salt]
        return 1

    def forget_owner(self, owner: str) -> int:
        """Drop every private L2 placement of ``owner`` (an instance gone for good, whose
        placements the directory dropped too); one pass over the book. Returns how many."""
        gone = [
            (key, h)
            for order in self._salts.values()
            for key, holders in order.items()
            for h in holders
            if h.owner == owner
        ]
        for key, h in gone:
            self._delete(key, h)
        return len(gone)

    def _touch(self, key: ObjectKey) -> None:
        order = self._salts.get(key.cache_salt)
        if order is not None:
            holders = order.pop(key, None)
            if holders is not None:
                order[key] = holders

    def _add(self, salt: str, delta: int) -> None:
        total = self._salt_bytes.get(salt, 0) + delta
        self.total_bytes += delta
        if total > 0:
            self._salt_bytes[salt] = total
        else:
            self._salt_bytes.pop(salt, None)

    # ---- reads --------------------------------------------------------------------

    def salt_bytes(self, cache_salt: str) -> int:
        return self._salt_bytes.get(cache_salt, 0)

    def bytes_by_salt(self) -> dict[str, int]:
        return dict(self._salt_bytes)

    def _holders_of(self, key: ObjectKey) -> dict[Holder, int]:
        return self._salts.get(key.cache_salt, {}).get(key, {})

    def key_bytes(self, key: ObjectKey) -> int:
        return sum(self._holders_of(key).values())

    def holders(self, key: ObjectKey) -> list[Holder]:
        """Who holds ``key`` in L2 (empty: nobody the book knows of)."""
        return list(self._holders_of(key))

    def keys_of(self, cache_salt: str) -> list[ObjectKey]:
        """The salt's keys, least recently used first."""
        return list(self._salts.get(cache_salt, ()))

    def lru(self, cache_salt: str) -> Mapping[ObjectKey, Mapping[Holder, int]]:
        """The salt's keys with their holders' sizes, least recently used first: a view
        for the caller to walk under its lock (no copy)."""
        return self._salts.get(cache_salt, {})

    def tracked_salts(self) -> list[str]:
        return list(self._salts)

    def __len__(self) -> int:
        return self._keys

    # ---- durability ---------------------------------------------------------------

    def capture(self) -> UsageCapture:
        """Placements salt by salt, each salt's keys in LRU order (the order is theirs)."""
        return UsageCapture(
            [
                (k, h.owner, h.backend, n)
                for order in self._salts.values()
                for k, hs in order.items()
                for h, n in hs.items()
            ],
            [],
        )

    @classmethod
    def restore(cls, capture: UsageCapture) -> SaltUsage:
        book = cls()
        for key, owner, backend, size in capture.placements:
            order = book._salts.setdefault(key.cache_salt, {})
            holders = order.get(key)
            if holders is None:
                holders = order[key] = {}
                book._keys += 1
            holders[Holder(owner, backend)] = size
            book._add(key.cache_salt, size)
        return book


def _sized(batch: EventBatch) -> Iterator[tuple[ObjectKey, int]]:
    """(key, size) of every object of a batch: its entries, then its block's."""
    for e in batch.entries:
        yield e.key, e.size_bytes
    block = batch.block
    if block is not None:
        ns = block.namespace
        m, r, g, salt = ns.model_name, ns.kv_rank, ns.object_group_id, ns.cache_salt
        for h, size in zip(block.hash_list(), block.sizes, strict=True):
            yield ObjectKey(h, m, r, g, salt), size


def eviction_plan(
    usage: SaltUsage,
    operator: OperatorState,
    ratio: float,
    watermark: float,
    live: Collection[str] | None = None,
    *,
    salts: Iterable[str] | None = None,
) -> list[SaltPlan]:
    """What each salt over its quota loses in this sweep (see the module docstring).
    ``live``: the servers that can be asked (None: any copy can be deleted); a key with
    no copy they reach is passed over like a pinned one (its bytes still count), so
    copies nobody can reach do not take every sweep's share forever. Walks each salt's
    order only as far as it picks (the caller holds its lock for it). ``salts``: plan
    these only (None: every tracked salt), so a caller can hold its lock per salt."""
    plans = []
    pinned = operator.pinned_keys > 0
    for salt in usage.tracked_salts() if salts is None else salts:
        current = usage.salt_bytes(salt)
        if current <= 0:
            continue
        limit = operator.effective_limit(salt)
        if limit is None or current < watermark * limit:
            continue
        effective = 1.0 if limit == 0 else max(0.0, min(1.0, ratio))
        order = usage.lru(salt)
        target = int(len(order) * effective)
        if effective > 0 and target == 0:
            target = 1
        keys: list[ObjectKey] = []
        freed = 0
        for key, holders in order.items():
            if len(keys) >= target:
                break
            if pinned and operator.is_pinned(key):
                continue
            if live is not None and not _reachable(holders, live):
                continue
            keys.append(key)
            freed += sum(holders.values())
        if keys:
            plans.append(SaltPlan(salt, keys, freed, current, limit))
    return plans


def _reachable(holders: Mapping[Holder, int], live: Collection[str]) -> bool:
    return any(h.owner in live if h.owner else bool(live) for h in holders)


def delete_targets(
    usage: SaltUsage, keys: Iterable[ObjectKey], live: list[InstanceId]
) -> tuple[dict[InstanceId, list[ObjectKey]], int]:
    """Which live server is told to delete which keys: every owner of a private copy
    that is live, and for a shared pool the first live server (sorted, so replicas
    agree); also the number of keys nobody live holds (left for a later sweep)."""
    alive = set(live)
    first = min(live) if live else None
    out: dict[InstanceId, list[ObjectKey]] = {}
    orphans = 0
    for key in keys:
        sent = False
        for h in usage.holders(key):
            target = first if h.owner == "" else InstanceId(h.owner)
            if target is not None and target in alive:
                bucket = out.setdefault(target, [])
                if not bucket or bucket[-1] != key:
                    bucket.append(key)
                sent = True
        orphans += not sent
    return out, orphans
