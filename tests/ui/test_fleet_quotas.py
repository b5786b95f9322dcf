"""The fleet page's quotas: `GET /ui/fleet.json` carries each salt's L2 usage against its
quota (its own or the default) and its pins, and the page shows them in a real headless
Chromium, an over-quota salt marked."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest

from kvatlas.core.events import Entry, EventBatch
from kvatlas.core.keys import ObjectKey, pack_kv_rank
from kvatlas.core.types import EventType, Incarnation, InstanceId, Tier
from kvatlas.wire.events_api import encode_events_json
from kvatlas.wire.fleet_view import FleetDocument, QuotasView, SaltQuotaView
from support.coordinator import RunningCoordinator

from .browser import chromium_page

Start = Callable[..., RunningCoordinator]
MIB = 2**20


def fill(rc: RunningCoordinator) -> None:
    """Salt a: 3 MiB under a 2 MiB quota; b: 1 MiB under the 4 MiB default; c: pins."""
    rank = pack_kv_rank(1, 0, 1, 0)
    entries = tuple(
        Entry(ObjectKey(bytes([i]) * 32, "m", rank, 0, salt), MIB) for i, salt in enumerate("aaab")
    )
    b = EventBatch(InstanceId("s1"), Incarnation(1), 1, EventType.STORE, Tier.L2, entries)
    r = rc.client.post(
        "/events",
        content=encode_events_json([b]),
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 200, r.text
    rc.client.put("/quota/a", json={"limit_gb": 2 / 1024})
    rc.client.put("/quota/config", json={"default_limit_gb": 4 / 1024})
    pin = {"model_name": "m", "world_size": 1, "token_ids": list(range(512)), "cache_salt": "c"}
    rc.client.post("/cache/pins", json=pin)


def test_document_carries_usage_against_quotas_and_pins(start_coordinator: Start) -> None:
    rc = start_coordinator(eviction_check_interval=0)
    fill(rc)
    doc = msgspec.json.decode(rc.client.get("/ui/fleet.json").content, type=FleetDocument)
    assert doc.quotas == QuotasView(
        default_limit_bytes=4 * MIB,
        pinned_keys=2,
        salts=[
            SaltQuotaView("a", 3 * MIB, 2 * MIB, 2 * MIB, 0),
            SaltQuotaView("b", MIB, None, 4 * MIB, 0),
            SaltQuotaView("c", 0, None, 4 * MIB, 2),
        ],
        eviction_interval_s=0.0,
        l2_bytes=4 * MIB,
        salts_over_quota=1,
    )


@pytest.mark.browser
def test_page_shows_quotas(start_coordinator: Start, tmp_path: Path) -> None:
    rc = start_coordinator(eviction_check_interval=0)
    fill(rc)
    with chromium_page(tmp_path / "profile") as page:
        page.goto(rc.url + "/ui?interval=1")
        page.wait_for_selector("#quotas tbody tr:nth-child(3)", timeout=20_000)
        rows = page.evaluate(
            "[...document.querySelectorAll('#quotas tbody tr')]"
            ".map((r) => [r.className, ...[...r.cells].map((c) => c.textContent)])"
        )
        assert [r[1] for r in rows] == ["a", "b", "c"]
        assert rows[0][0] == "warn" and rows[1][0] == ""  # a is over its quota
        assert "(own)" in rows[0][3] and "(default)" in rows[1][3]
        assert rows[2][4] == "2"
        note = page.text_content("#quotas-note") or ""
        assert "2 keys pinned" in note and "Eviction loop off" in note
