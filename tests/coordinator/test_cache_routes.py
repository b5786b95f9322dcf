"""The coordinator's cache-control routes driving real kvatlas servers: warm prefetch
(from L2, and from a peer), delete across tiers honouring leases and pins unless forced,
the DELETE/STORE events those produce, LMCache's shapes, refusals, auth and metrics.

The coordinator is served from a thread of this process; the servers are real
``kvatlas server`` processes (``cache_fleet``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvatlas.connector.client import CacheClient
from kvatlas.launch.procs import free_ports
from support.cache_fleet import (
    CHUNK,
    MODEL,
    Node,
    data,
    placements,
    poll_prefetch,
    prompt,
    start_node,
    wait_placements,
)
from support.coordinator import RunningCoordinator
from support.wait import wait_until

Start = Callable[..., RunningCoordinator]


@pytest.fixture
def coord(start_coordinator: Start) -> RunningCoordinator:
    return start_coordinator(chunk_size=CHUNK, eviction_check_interval=0)


@pytest.fixture
def node(tmp_path: Path, coord: RunningCoordinator) -> Iterator[Node]:
    n = start_node(tmp_path, "node-a", coord)
    yield n
    assert n.stop() == 0, n.tail()


def in_l2_only(coord: RunningCoordinator, node: Node, tokens: list[int], n: int) -> None:
    """Store ``tokens``' ``n`` chunks, then enough others that L1 demotes them to L2."""
    c = node.client()
    assert c.store_chunks(tokens, data(n, 1)).stored == n
    filler = prompt(16, seed=9)
    c.store_chunks(filler, data(16, 2))
    wait_placements(coord, tokens, [{"node-a/l2"}] * n)


def test_prefetch_warms_l1_from_l2_and_the_poll_is_once(
    coord: RunningCoordinator, node: Node
) -> None:
    tokens = prompt(3, seed=1)
    in_l2_only(coord, node, tokens, 3)
    r = coord.client.post(
        "/cache/prefetches",
        json={"instance_id": "node-a", "model_name": MODEL, "world_size": 1, "token_ids": tokens},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["instance_id"] == "node-a" and body["status"] == "submitted"
    assert body["chunks"] == 3 and len(body["request_id"]) == 32
    done = poll_prefetch(coord, "node-a", body["request_id"])
    assert done == {
        "request_id": body["request_id"],
        "status": "completed",
        "found_keys": 3,
        "total_keys": 3,
    }
    # The promotions reached the directory as L1 STOREs (L2 keeps its copy).
    wait_placements(coord, tokens, [{"node-a/l1", "node-a/l2"}] * 3)
    # Exactly once: the job is gone after the completed poll; the server's 404 relayed.
    again = coord.client.get(f"/cache/prefetches/node-a/{body['request_id']}")
    assert again.status_code == 404
    assert "unknown prefetch request_id" in again.json()["detail"]


def test_prefetch_of_less_than_a_chunk_is_a_noop(coord: RunningCoordinator, node: Node) -> None:
    r = coord.client.post(
        "/cache/prefetches",
        json={"instance_id": "node-a", "model_name": MODEL, "world_size": 1, "token_ids": [1, 2]},
    )
    assert r.status_code == 200, r.text
    assert r.json() == {"instance_id": "node-a", "status": "noop", "request_id": "", "chunks": 0}


def test_prefetch_of_unknown_keys_completes_with_none_found(
    coord: RunningCoordinator, node: Node
) -> None:
    r = coord.client.post(
        "/cache/prefetches",
        json={
            "instance_id": "node-a",
            "model_name": MODEL,
            "world_size": 2,
            "token_ids": prompt(2, seed=5),
        },
    )
    assert r.status_code == 200, r.text
    done = poll_prefetch(coord, "node-a", r.json()["request_id"])
    assert (done["found_keys"], done["total_keys"]) == (0, 4)  # 2 chunks x 2 ranks


def test_delete_l1_keeps_l2_and_reports_deletes(coord: RunningCoordinator, node: Node) -> None:
    tokens = prompt(3, seed=1)
    in_l2_only(coord, node, tokens, 3)
    c = node.client()
    assert c.lookup(tokens).hit_chunks == 3  # promoted back: in both tiers now
    wait_placements(coord, tokens, [{"node-a/l1", "node-a/l2"}] * 3)
    r = coord.client.post(
        "/cache/delete",
        json={
            "instance_id": "node-a",
            "model_name": MODEL,
            "world_size": 1,
            "token_ids": tokens,
            "tier": "l1",
        },
    )
    assert r.status_code == 200, r.text
    assert r.json() == {
        "instance_id": "node-a",
        "status": "deleted",
        "requested": 3,
        "affected": 3,
        "skipped": 0,
    }
    wait_placements(coord, tokens, [{"node-a/l2"}] * 3)
    # tier all: L2 goes too, and the directory forgets them.
    r = coord.client.post(
        "/cache/delete",
        json={"instance_id": "node-a", "model_name": MODEL, "world_size": 1, "token_ids": tokens},
    )
    assert r.json()["affected"] == 3, r.text
    wait_placements(coord, tokens, [set()] * 3)
    assert c.lookup(tokens).hit_chunks == 0


def test_delete_skips_leased_chunks_unless_forced(coord: RunningCoordinator, node: Node) -> None:
    tokens = prompt(2, seed=3)
    c = node.client()
    assert c.store_chunks(tokens, data(2, 3)).stored == 2
    locs = c.acquire(c.hashes(tokens)[:1], lease_s=60)  # an engine reads chunk 0
    assert locs[0] is not None
    body = {
        "instance_id": "node-a",
        "model_name": MODEL,
        "world_size": 1,
        "token_ids": tokens,
        "tier": "l1",
    }
    r = coord.client.post("/cache/delete", json=body)
    assert (r.json()["affected"], r.json()["skipped"]) == (1, 1), r.text
    wait_placements(coord, tokens, [{"node-a/l1"}, set()])
    r = coord.client.post("/cache/delete", json={**body, "force": True})
    assert (r.json()["affected"], r.json()["skipped"]) == (1, 0), r.text
    wait_placements(coord, tokens, [set(), set()])
    assert c.release([locs[0].lease_id]) == 0  # the forced delete ended the lease


def test_delete_honours_pins_unless_forced(coord: RunningCoordinator, node: Node) -> None:
    tokens = prompt(2, seed=4)
    c = node.client()
    assert c.store_chunks(tokens, data(2, 4)).stored == 2
    wait_placements(coord, tokens, [{"node-a/l1"}] * 2)
    pin = {"model_name": MODEL, "world_size": 1, "token_ids": tokens[:CHUNK]}
    assert coord.client.post("/cache/pins", json=pin).status_code == 200
    body = {"instance_id": "node-a", "model_name": MODEL, "world_size": 1, "token_ids": tokens}
    r = coord.client.post("/cache/delete", json=body)
    # The pinned chunk is held back from both tiers; the other goes.
    assert r.json() == {**_shape("deleted", 2), "affected": 1, "skipped": 1}, r.text
    wait_placements(coord, tokens, [{"node-a/l1"}, set()])
    # l1 only: pins guard L2, so L1 goes.
    r = coord.client.post("/cache/delete", json={**body, "tier": "l1"})
    assert (r.json()["affected"], r.json()["skipped"]) == (1, 0), r.text
    c.store_chunks(tokens, data(2, 4))
    wait_placements(coord, tokens, [{"node-a/l1"}] * 2)
    r = coord.client.post("/cache/delete", json={**body, "force": True})
    assert (r.json()["affected"], r.json()["skipped"]) == (2, 0), r.text
    assert coord.client.get("/cache/pins").json()["total"] == 0  # force clears the pins
    wait_placements(coord, tokens, [set(), set()])


def _shape(status: str, requested: int) -> dict[str, object]:
    return {"instance_id": "node-a", "status": status, "requested": requested}


def test_delete_of_less_than_a_chunk_is_a_noop(coord: RunningCoordinator, node: Node) -> None:
    r = coord.client.post(
        "/cache/delete",
        json={"instance_id": "node-a", "model_name": MODEL, "world_size": 1, "token_ids": [1]},
    )
    assert r.json() == {**_shape("noop", 0), "affected": 0, "skipped": 0}, r.text


def test_prefetch_fetches_from_a_peer(tmp_path: Path, coord: RunningCoordinator) -> None:
    """B holds the chunks in L1; a prefetch on A (empty, no L2) reads them from B."""
    pa, pb = free_ports(2)
    p2p = ["--p2p-transfer-engine", "tcp", "--p2p-lookup-timeout", "5"]
    a = start_node(tmp_path, "node-a", coord, "--p2p-advertise-url", f"127.0.0.1:{pa}", *p2p)
    b = start_node(tmp_path, "node-b", coord, "--p2p-advertise-url", f"127.0.0.1:{pb}", *p2p)
    try:
        tokens = prompt(3, seed=6)
        assert b.client().store_chunks(tokens, data(3, 6)).stored == 3
        wait_placements(coord, tokens, [{"node-b/l1"}] * 3)
        # A reads from the peers its controller has listed: wait until it lists B, or
        # the prefetch races the first poll of the fleet and finds nobody to ask
        wait_until(
            lambda: a.http("GET", "/status").json(),
            lambda st: "node-b" in st.get("p2p_peers", []),
            what="node-a listing node-b as a peer",
            timeout=20,
        )
        r = coord.client.post(
            "/cache/prefetches",
            json={
                "instance_id": "node-a",
                "model_name": MODEL,
                "world_size": 1,
                "token_ids": tokens,
            },
        )
        assert r.status_code == 200, r.text
        done = poll_prefetch(coord, "node-a", r.json()["request_id"])
        assert (done["found_keys"], done["total_keys"]) == (3, 3)
        wait_placements(coord, tokens, [{"node-a/l1", "node-b/l1"}] * 3)
        assert 'source="peer"' in a.http("GET", "/metrics").text
    finally:
        assert a.stop() == 0, a.tail()
        assert b.stop() == 0, b.tail()


def test_placements_helper_sees_nothing_for_unknown_tokens(coord: RunningCoordinator) -> None:
    assert placements(coord, prompt(1, seed=77)) == [set()]


def wait_metric(coord: RunningCoordinator, needle: str) -> None:
    wait_until(
        lambda: coord.client.get("/metrics").text,
        lambda text: needle in text,
        what=f"{needle} in /metrics",
        timeout=10,
    )


def test_delete_reaches_every_object_group_the_directory_knows(
    coord: RunningCoordinator, node: Node
) -> None:
    """Tokens resolve to object group 0; copies in other groups that the directory lists
    are deleted too (LMCache's ``get_keys_across_object_groups``)."""
    tokens = prompt(2, seed=8)
    g0 = node.client()
    g1 = CacheClient(node.engine_url, timeout_s=10.0, engine_id="eng-g1")
    node.clients.append(g1)
    g1.register(MODEL, "float16", (2, 2, 8), chunk_size=CHUNK, object_group_id=1)
    assert g0.store_chunks(tokens, data(2, 8)).stored == 2
    assert g1.store_chunks(tokens, data(2, 9)).stored == 2
    body = {"token_ids": tokens, "model_name": MODEL, "object_group_id": 1}
    wait_until(
        lambda: coord.client.post("/directory/lookup", json=body).json()["results"],
        lambda rs: all(r["placements"] for r in rs),
        what="group 1's placements",
        timeout=20,
    )
    r = coord.client.post(
        "/cache/delete",
        json={"instance_id": "node-a", "model_name": MODEL, "world_size": 1, "token_ids": tokens},
    )
    assert r.json() == {**_shape("deleted", 2), "affected": 4, "skipped": 0}, r.text
    assert g0.lookup(tokens).hit_chunks == 0 and g1.lookup(tokens).hit_chunks == 0
