"""LMCache 0.5.7's coordinator API on a real kvatlas coordinator: the chunk size binding
(`PUT /config/chunk-size`, a registration's ``chunk_size``; bind once, 409 in LMCache's
words, kept in the snapshot, through the log with Kafka replicas) and the events servers
report dropped (``dropped_events``: a rise is a gap, counted). The answers themselves
are compared with 0.5.7rc2's coordinator in ``tests/differential/test_chunk_size.py``;
these pin what only kvatlas has (metrics, snapshot, replicas) and the pure rules."""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvatlas.core.coordinator.fleet import FleetState
from kvatlas.core.coordinator.gate import admit
from kvatlas.core.errors import ChunkSizeConflict, ConfigError
from kvatlas.core.keys import chunk_hashes
from kvatlas.core.types import Incarnation
from support.coordinator import RunningCoordinator
from support.wait import wait_until

from .events import register_body
from .lmcache_shapes import INCARNATION, events_body, lmcache_batch

Start = Callable[..., RunningCoordinator]
JSON = {"content-type": "application/json"}
PUT = "/config/chunk-size"
ALREADY = (
    "Coordinator is already bound to chunk size {bound}; use a separate coordinator for a"
    " fleet requiring chunk size {asked}"
)
SMALLER = "Chunk size {asked} is smaller than the coordinator's configured minimum {minimum}"


def metric(rc: RunningCoordinator, name: str) -> float:
    """The sum of a metric's samples (0 when absent)."""
    text = rc.client.get("/metrics").text
    return sum(
        float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    )


# ------------------------------------------------------------------ the pure rules


def test_fleet_binds_once_and_refuses_in_lmcache_words() -> None:
    fleet = FleetState(chunk_size=256)
    with pytest.raises(ChunkSizeConflict, match=re.escape(SMALLER.format(asked=128, minimum=256))):
        fleet.bind_chunk_size(128)
    assert (fleet.chunk_size, fleet.chunk_size_bound) == (256, False)  # a refusal binds nothing
    assert fleet.bind_chunk_size(512) is True
    assert fleet.bind_chunk_size(512) is False  # the same again: no change
    with pytest.raises(ChunkSizeConflict, match=re.escape(ALREADY.format(bound=512, asked=256))):
        fleet.bind_chunk_size(256)
    restored, _ = FleetState.restore(fleet.snapshot())
    assert (restored.chunk_size, restored.chunk_size_bound) == (512, True)


def test_binding_rebuilds_the_blend_index() -> None:
    fleet = FleetState(chunk_size=4, enable_blend=True)
    assert fleet.bind_chunk_size(8)
    assert fleet.blend is not None and fleet.blend.stats().chunks == 0
    assert fleet.chunk_size == 8


DROPS = st.lists(st.integers(0, 20), min_size=1, max_size=12)


@given(drops=DROPS, first_seq=st.sampled_from([1, 5]))
def test_gate_counts_the_rises_of_dropped_events(drops: list[int], first_seq: int) -> None:
    """Against a simple model: the sum of the rises from a known start (seq 1: 0), or
    from the first report of a stream met midway."""
    cursor = admit(None, Incarnation(1), first_seq, drops[0]).cursor
    counted = cursor.dropped
    for i, d in enumerate(drops[1:], start=1):
        adm = admit(cursor, Incarnation(1), first_seq + i, d)
        counted += adm.dropped
        assert (adm.dropped > 0) == (adm.cursor.gaps == cursor.gaps + 1)
        cursor = adm.cursor
    known = [0, *drops] if first_seq == 1 else drops
    want = sum(max(b - a, 0) for a, b in itertools.pairwise(known))
    assert counted == want == cursor.dropped
    # a new incarnation starts from 0; a batch that carries no count changes nothing
    adm = admit(cursor, Incarnation(2), 1, 4)
    assert adm.dropped == 4 and adm.fence_incarnation == 1
    assert admit(adm.cursor, Incarnation(2), 2, None).cursor.last_dropped == 4


# ------------------------------------------------------------------ over HTTP


def test_put_chunk_size_binds_once(coord: RunningCoordinator) -> None:
    c = coord.client
    r = c.put(PUT, json={"chunk_size": 128})
    assert r.status_code == 409
    assert r.json() == {"detail": SMALLER.format(asked=128, minimum=256)}
    assert c.put(PUT, json={"chunk_size": 512}).json() == {"chunk_size": 512}
    assert c.put(PUT, json={"chunk_size": "512"}).json() == {"chunk_size": 512}  # lax, as LMCache
    r = c.put(PUT, json={"chunk_size": 256, "from_a_newer_server": 1})
    assert r.status_code == 409
    assert r.json() == {"detail": ALREADY.format(bound=512, asked=256)}
    for bad in ({"chunk_size": 0}, {"chunk_size": None}, {}, {"chunk_size": 1.5}):
        r = c.put(PUT, json=bad)
        assert r.status_code == 422 and "detail" in r.json(), (bad, r.text)
    assert c.put(PUT, content=b"{nope").status_code == 422
    assert metric(coord, 'kvatlas_coordinator_chunk_size{bound="1"}') == 512
    assert metric(coord, "kvatlas_coordinator_chunk_size_binds_total") == 4
    doc = c.get("/openapi.json").json()
    assert "put" in doc["paths"][PUT]
    assert {"409", "422"} <= set(doc["paths"][PUT]["put"]["responses"])


def test_registration_binds_first_and_a_conflict_registers_nothing(
    coord: RunningCoordinator,
) -> None:
    c = coord.client
    r = c.post(
        "/instances", json={"instance_id": "a", "ip": "h", "http_port": 1, "chunk_size": None}
    )
    assert r.status_code == 200  # nothing to bind: 0.5.6's registration, or negotiation pending
    assert metric(coord, 'kvatlas_coordinator_chunk_size{bound="0"}') == 256
    body = {"instance_id": "b", "ip": "h", "http_port": 1, "chunk_size": 1024}
    assert c.post("/instances", json=body).status_code == 200
    r = c.post("/instances", json={**body, "instance_id": "c", "chunk_size": 512})
    assert r.status_code == 409
    assert r.json() == {"detail": ALREADY.format(bound=1024, asked=512)}
    assert {i["instance_id"] for i in c.get("/instances").json()["instances"]} == {"a", "b"}
    assert c.post("/instances", json={**body, "chunk_size": 0}).status_code == 400
    # token-form lookups hash with the bound size
    toks = list(range(3000))
    r = c.post("/directory/lookup", json={"token_ids": toks, "model_name": "m"})
    got = [x["key"]["chunk_hash_hex"] for x in r.json()["results"]]
    assert got == [h.hex() for h in chunk_hashes(toks, 1024)]


def test_a_raised_minimum_and_a_restart_keep_the_binding(
    start_coordinator: Start, tmp_path: Path
) -> None:
    snap = str(tmp_path / "c.snap")
    a = start_coordinator(snapshot_path=snap, chunk_size=512)
    assert a.client.put(PUT, json={"chunk_size": 256}).status_code == 409  # below 512
    assert a.client.put(PUT, json={"chunk_size": 768}).status_code == 200
    a.stop()
    b = start_coordinator(snapshot_path=snap, chunk_size=512, port=a.port)
    r = b.client.put(PUT, json={"chunk_size": 512})
    assert r.status_code == 409, "the binding survives a restart (LMCache's does not)"
    assert b.client.put(PUT, json={"chunk_size": 768}).status_code == 200
    b.stop()
    with pytest.raises(ConfigError, match="bound by the fleet's servers, below --chunk-size 1024"):
        start_coordinator(snapshot_path=snap, chunk_size=1024)


def test_dropped_events_count_as_gaps(coord: RunningCoordinator) -> None:
    c = coord.client
    c.post("/instances", json={"instance_id": "node-a", "ip": "127.0.0.1", "http_port": 7555})

    def send(seq: int, dropped: int, **extra: Any) -> dict[str, Any]:
        b = lmcache_batch("node-a", seq, "access", dropped_events=dropped, **extra)
        r = c.post("/events", content=events_body(b), headers=JSON)
        assert r.status_code == 200, r.text
        out: dict[str, Any] = r.json()
        return out

    assert send(1, 0)["gaps"] == 0
    assert send(2, 5)["gaps"] == 1
    assert send(3, 5, future_field={"x": 1})["gaps"] == 0  # unchanged, and unknown fields
    assert send(4, 2)["gaps"] == 0  # a fall is no loss
    assert send(5, 9)["gaps"] == 1
    assert metric(coord, "kvatlas_coordinator_ingest_events_dropped_total") == 12
    assert metric(coord, "kvatlas_coordinator_ingest_gaps_total") == 2
    assert metric(coord, 'kvatlas_coordinator_instance_events_dropped{instance_id="node-a"}') == 12
    # a restart of the server starts its count from 0
    b = lmcache_batch("node-a", 1, "access", INCARNATION + 1, dropped_events=3)
    assert c.post("/events", content=events_body(b), headers=JSON).json()["gaps"] == 1
    assert metric(coord, "kvatlas_coordinator_ingest_events_dropped_total") == 15
    b = lmcache_batch("node-a", 2, "access", INCARNATION + 1, dropped_events=-1)
    r = c.post("/events", content=events_body(b), headers=JSON)
    assert r.status_code == 400 and "dropped_events" in r.text


@pytest.mark.kafka
def test_replicas_bind_in_the_logs_order(
    kafka_broker: Any, start_coordinator: Start, tmp_path: Path
) -> None:
    topic = f"chunk-{tmp_path.name[-8:]}"
    kafka_broker.create_topic(topic, partitions=4)
    cfg = {
        "event_transport": "kafka",
        "kafka_bootstrap_servers": kafka_broker.bootstrap,
        "kafka_topic": topic,
    }
    a = start_coordinator(**cfg)
    b = start_coordinator(**cfg)
    a.wait_ready()
    b.wait_ready()
    assert a.client.put(PUT, json={"chunk_size": 512}).json() == {"chunk_size": 512}
    r = b.client.put(PUT, json={"chunk_size": 1024})
    assert r.status_code == 409
    assert r.json() == {"detail": ALREADY.format(bound=512, asked=1024)}
    r = b.client.post("/instances", json={**register_body("node-b"), "chunk_size": 1024})
    assert r.status_code == 409
    assert (
        b.client.post("/instances", json={**register_body("node-c"), "chunk_size": 512}).status_code
        == 200
    )
    wait_until(
        lambda: metric(a, 'kvatlas_coordinator_chunk_size{bound="1"}'),
        lambda v: v == 512,
        what="replica A bound to 512",
        timeout=15,
    )
    wait_until(a.instance_ids, lambda ids: ids == ["node-c"], what="A lists node-c", timeout=15)
