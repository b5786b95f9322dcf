"""The cache-control routes on Kafka replicas against the real tansu broker: a server
registered through one replica is a target at the other, a pinned key is held back by
either, and a forced delete through one drops the pin on both (through the log)."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from kvatlas.launch.procs import HOST
from support.cache_fleet import CHUNK, MODEL, data, prompt, start_node
from support.coordinator import RunningCoordinator
from support.wait import wait_until

pytestmark = [pytest.mark.kafka]

Start = Callable[..., RunningCoordinator]


def pins_total(rc: RunningCoordinator) -> int:
    return int(rc.client.get("/cache/pins").json()["total"])


def test_pins_and_forced_deletes_across_replicas(
    start_coordinator: Start, kafka_broker: Any, tmp_path: Path
) -> None:
    topic = f"cache-{uuid.uuid4().hex[:8]}"
    kafka_broker.create_topic(topic, partitions=4)
    cfg = {
        "event_transport": "kafka",
        "kafka_bootstrap_servers": kafka_broker.bootstrap,
        "kafka_topic": topic,
        "eviction_check_interval": 0,
        "chunk_size": CHUNK,
    }
    a = start_coordinator(**cfg)
    b = start_coordinator(**cfg)
    a.wait_ready()
    b.wait_ready()
    # A kvatlas server without a coordinator of its own (its events would need Kafka):
    # an operator registers its HTTP address through replica A.
    node = start_node(tmp_path, "node-k", None)
    try:
        reg = {"instance_id": "node-k", "ip": HOST, "http_port": node.http_port}
        assert a.client.post("/instances", json=reg).status_code == 200
        wait_until(b.instance_ids, lambda ids: "node-k" in ids, what="node-k at B", timeout=30)
        tokens = prompt(2, seed=1)
        c = node.client()
        assert c.store_chunks(tokens, data(2, 1)).stored == 2
        pin = {"model_name": MODEL, "world_size": 1, "token_ids": tokens[:CHUNK]}
        assert a.client.post("/cache/pins", json=pin).status_code == 200
        wait_until(
            lambda: b.client.get("/cache/pins").json()["total"],
            lambda n: n == 1,
            what="the pin at B",
            timeout=30,
        )
        body = {"instance_id": "node-k", "model_name": MODEL, "world_size": 1, "token_ids": tokens}
        r = b.client.post("/cache/delete", json=body)
        assert (r.json()["affected"], r.json()["skipped"]) == (1, 1), r.text
        assert c.lookup(tokens).hit_chunks == 1  # the pinned first chunk stays
        r = b.client.post("/cache/delete", json={**body, "force": True})
        assert (r.json()["affected"], r.json()["skipped"]) == (1, 0), r.text
        for rc in (a, b):
            wait_until(
                partial(pins_total, rc),
                lambda n: n == 0,
                what="the forced delete's pin drop at both replicas",
                timeout=30,
            )
        assert c.lookup(tokens).hit_chunks == 0
    finally:
        assert node.stop() == 0, node.tail()
