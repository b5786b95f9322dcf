"""The fleet L2 eviction loop of a real coordinator when servers cannot do what it asks:
a server that does not answer is counted and asked again next sweep, and the copies of
an instance gone for good leave the book instead of being asked for forever. (The loop
against real LMCache and kvatlas servers: tests/lmcache/test_lmcache_eviction.py.)"""

from __future__ import annotations

from collections.abc import Callable

from kvatlas.core.events import Entry, EventBatch
from kvatlas.core.keys import ObjectKey, pack_kv_rank
from kvatlas.core.types import EventType, Incarnation, InstanceId, Tier
from kvatlas.launch.procs import free_ports
from support.coordinator import RunningCoordinator
from support.wait import wait_until

from .events import json_body, register_body

Start = Callable[..., RunningCoordinator]


def keys(n: int) -> list[ObjectKey]:
    return [ObjectKey(bytes([i]) * 32, "m", pack_kv_rank(1, 0, 1, 0), 0, "t") for i in range(n)]


def post_l2(rc: RunningCoordinator, iid: str, keys: list[ObjectKey]) -> None:
    b = EventBatch(
        InstanceId(iid),
        Incarnation(1),
        1,
        EventType.STORE,
        Tier.L2,
        tuple(Entry(k, 1000) for k in keys),
    )
    r = rc.client.post(
        "/events", content=json_body(b), headers={"content-type": "application/json"}
    )
    assert r.status_code == 200, r.text


def counter(rc: RunningCoordinator, sample: str) -> float:
    for line in rc.client.get("/metrics").text.splitlines():
        if line.startswith(sample + " "):
            return float(line.split()[-1])
    return 0.0


def test_a_server_that_does_not_answer_is_counted_and_asked_again(start_coordinator: Start) -> None:
    rc = start_coordinator(eviction_check_interval=0.1)
    (closed,) = free_ports(1)  # nothing listens there
    assert rc.client.post("/instances", json=register_body("s1", http_port=closed)).is_success
    post_l2(rc, "s1", keys(4))
    rc.client.put("/quota/t", json={"limit_gb": 0})
    failed = 'kvatlas_coordinator_eviction_keys_total{result="failed"}'
    wait_until(
        lambda: counter(rc, failed),
        lambda n: n >= 8,  # every key, in two sweeps at least
        what="two failed sweeps",
        timeout=20,
    )
    assert rc.client.get("/quota/t").json()["usage_gb"] > 0  # nothing was deleted
    assert counter(rc, 'kvatlas_coordinator_eviction_sweeps_total{outcome="planned"}') >= 2


def test_an_instance_gone_for_good_is_forgotten_not_asked(start_coordinator: Start) -> None:
    rc = start_coordinator(
        eviction_check_interval=0.1, instance_timeout=0.5, health_check_interval=0.1
    )
    post_l2(rc, "ghost", keys(3))  # never registered: nobody to ask
    rc.client.put("/quota/t", json={"limit_gb": 0})
    assert rc.client.get("/quota/t").json()["usage_gb"] > 0
    wait_until(
        lambda: rc.client.get("/quota/t").json()["usage_gb"],
        lambda usage: usage == 0,
        what="the unregistered instance's copies to leave the book when it expires",
        timeout=20,
    )
    assert counter(rc, 'kvatlas_coordinator_eviction_keys_total{result="failed"}') == 0
    assert counter(rc, 'kvatlas_coordinator_eviction_keys_total{result="sent"}') == 0
