"""Reading the whole key directory without holding ingest up: a copy of the key order
is walked in steps, the state lock held for one step at a time (`walk`), and the one
reader that needs it paginated and filtered, `GET /directory/keys` (`keys_page`).

The quota routes' L1 sums (`quotas.QuotaController.l1_bytes_by_salt`) walk the same way.
Must not: hold the lock across steps, or change the directory.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

from kvatlas.coordinator.views import key_view
from kvatlas.core.coordinator.directory import KeyDirectory
from kvatlas.core.types import InstanceId, Tier
from kvatlas.wire.coordinator_views import KeysPage

T = TypeVar("T")

SCAN_STEP = 2048
"""Keys read per lock hold: ingest waits for one step, never for the whole walk."""


def walk(
    lock: threading.Lock | threading.RLock,
    directory: KeyDirectory,
    read: Callable[[Sequence[int]], T],
    step: int = SCAN_STEP,
) -> Iterator[T]:
    """``read`` over the key ids of the directory, ``step`` at a time, each call under
    ``lock``; keys stored during the walk are not seen, keys gone are skipped by
    ``read``'s own lookups."""
    with lock:
        order = directory.key_order()
    for start in range(0, len(order), step):
        with lock:
            got = read(order[start : start + step])
        yield got


def keys_page(
    lock: threading.Lock | threading.RLock,
    d: KeyDirectory,
    offset: int,
    limit: int,
    *,
    tier: Tier | None,
    instance_id: InstanceId | None,
    backend: str | None,
) -> KeysPage:
    """A page of the directory's keys; ``total`` counts every matching key, as
    LMCache's listing does."""
    if tier is None and instance_id is None and backend is None:
        # Every stored key has a placement: the page is a slice of the key order.
        with lock:
            rows = d.key_rows(d.key_slice(offset, limit + 1))
            total = len(d)
    else:
        # A filter is checked key by key in Python, so the walk goes to the end.
        rows = []
        to_skip = offset
        total = 0
        for got in walk(lock, d, lambda ids: d.key_rows(ids, tier, instance_id, backend)):
            total += len(got)
            if len(rows) > limit:
                continue
            if to_skip >= len(got):
                to_skip -= len(got)
                continue
            rows.extend(got[to_skip:])
            to_skip = 0
        rows = rows[: limit + 1]
    more = len(rows) > limit
    rows = rows[:limit]
    with lock:
        facts = [d.key_facts(ns, prefix) for ns, prefix, _ in rows]
    views = [key_view(ns, prefix, ps, f) for (ns, prefix, ps), f in zip(rows, facts, strict=True)]
    return KeysPage(offset, limit, views, offset + limit if more else None, total=total)
