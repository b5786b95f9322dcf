"""The router's per-tier holdings (``router.tiers``): which engine a device hit belongs
to, which tier an engine's cached tokens come from, and which tier won a choice."""

from __future__ import annotations

from kvatlas.router.tiers import (
    DeviceHit,
    Held,
    TierView,
    chunk_matches,
    device_matches,
    engine_base,
    hit_tier,
    pending_matches,
)


def test_hit_tiers_by_medium_and_engine_ids_of_ranks() -> None:
    assert hit_tier(["GPU"]) == "device"
    assert hit_tier([]) == "device"  # no medium holds all of the blocks: a mix
    assert hit_tier(["GPU", "CPU"]) == "device"
    assert hit_tier(["CPU"]) == "l1"
    assert hit_tier(["STORAGE"]) == "l2"
    assert engine_base("e/dp3") == "e"
    assert engine_base("e/dpx") == "e/dpx"
    assert engine_base("e") == "e"


def test_best_tier_prefers_the_cheaper_one_on_a_tie() -> None:
    assert Held().best() == ("none", 0)
    assert Held(device=32, l1=32).best() == ("device", 32)
    assert Held(device=16, l1=32, l2=64).best() == ("l2", 64)
    assert Held(pending=48, l2=48).best() == ("l2", 48)


def test_view_maps_hits_by_url_or_instance_and_names_the_winning_tier() -> None:
    view = TierView(
        [
            *chunk_matches([("node-a", "l1", 64), ("node-b", "l2", 128)]),
            *device_matches(
                [
                    DeviceHit("a/dp1", 96, ("GPU",)),
                    DeviceHit("gpu-b", 32, ("GPU",), "http://b:8000/"),
                    DeviceHit("c", 0, ("GPU",)),
                ]
            ),
            *pending_matches({"http://c:8000": 16}),
        ]
    )
    assert view.fleet == 128
    assert view.held("http://a:8000", "a") == Held(device=96)
    assert view.held("http://x:8000", "node-a") == Held(l1=64)
    assert view.held("http://b:8000", "node-b") == Held(device=32, l2=128)
    assert view.local("http://b:8000", "node-b") == 128
    assert view.local("http://c:8000", "c") == 16
    assert view.tier_of("http://a:8000", "a", 96) == "device"
    assert view.tier_of("http://b:8000", "node-b", 128) == "l2"
    # kv-p2p: a peer's tokens beyond the local prefix are most of what is cached
    assert view.tier_of("http://x:8000", "node-a", 160) == "peer"
    assert view.tier_of("http://c:8000", "c", 16) == "pending"
    assert view.tier_of("http://c:8000", "c", 0) == "none"
    assert view.tiers([("http://a:8000", "a", 96), ("http://d:1", "d", 0)]) == {
        "http://a:8000": "device",
        "http://d:1": "none",
    }
