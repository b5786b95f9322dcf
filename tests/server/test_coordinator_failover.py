"""Coordinator high availability with real processes: two coordinator replicas (on the
real Kafka-protocol broker, or independent over HTTP) and a real ``kvatlas server`` given
both URLs. The replica the server uses is killed (SIGKILL) or frozen (SIGSTOP); the
server fails over within a bounded time, is never fenced, and what it stores afterwards
is found on the survivor; a server that dies behind a dead replica is expired by the
survivor. Every event batch is applied exactly once on the survivor: its cursor reaches
the server's last seq with no gap, and its applied count equals that seq."""

from __future__ import annotations

import os
import re
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import numpy as np
import pytest

from kvatlas.connector.client import CacheClient
from kvatlas.launch.broker import Broker
from kvatlas.wire.directory_api import LookupRequest, LookupResponse
from support.launch import Proc
from support.services import ServerProc, start_coordinator_process, start_server_process
from support.wait import wait_until

pytestmark = [pytest.mark.slow]

CHUNK = 16
MODEL = "tiny"
INSTANCE_TIMEOUT_S = 3.0
SWEEP_S = 0.5
HEARTBEAT_S = 0.3
REQUEST_TIMEOUT_S = 1.0
FAILOVER_BOUND_S = HEARTBEAT_S + REQUEST_TIMEOUT_S + 4.0
"""A heartbeat interval, one replica's deadline, and room for a loaded 2-core machine."""


# ---------------------------------------------------------------------------- the fleet


def start_replicas(tmp: Path, *flags: str) -> list[Proc]:
    common = [
        "--chunk-size", str(CHUNK), "--instance-timeout", str(INSTANCE_TIMEOUT_S),
        "--health-check-interval", str(SWEEP_S),
    ]  # fmt: skip
    replicas = [
        start_coordinator_process(*common, *flags, log=tmp / f"replica-{i}.log") for i in (0, 1)
    ]
    for r in replicas:
        r.wait_http("/readyz", timeout=30)
    return replicas


@pytest.fixture
def kafka_replicas(kafka_broker: Broker, tmp_path: Path) -> Iterator[tuple[list[Proc], list[str]]]:
    """Two replicas on one topic, and the Kafka flags a server needs to publish there."""
    topic = f"ha-{uuid.uuid4().hex[:8]}"
    kafka_broker.create_topic(topic, partitions=8)
    flags = ["--kafka-bootstrap-servers", kafka_broker.bootstrap, "--kafka-topic", topic]
    replicas = start_replicas(tmp_path, "--event-transport", "kafka", *flags)
    yield replicas, flags
    stop_all(replicas)


@pytest.fixture
def http_replicas(tmp_path: Path) -> Iterator[list[Proc]]:
    replicas = start_replicas(tmp_path)
    yield replicas
    stop_all(replicas)


def stop_all(procs: list[Proc]) -> None:
    for p in procs:
        if p.alive():
            os.kill(p.pid, signal.SIGCONT)  # a frozen one must be able to leave
        p.stop(grace_s=5)


def start_server(tmp: Path, replicas: list[Proc], *flags: str) -> ServerProc:
    return start_server_process(
        tmp, "node-a",
        "--l1-size-gb", "0.01", "--no-l1-prefault", "--chunk-size", str(CHUNK),
        "--coordinator-url", ",".join(r.url for r in replicas),
        "--coordinator-heartbeat-interval", str(HEARTBEAT_S),
        "--coordinator-timeout", str(REQUEST_TIMEOUT_S),
        "--event-flush-interval", "0.1",
        *flags,
    )  # fmt: skip


def start_stored(tmp: Path, replicas: list[Proc], *flags: str) -> ServerProc:
    """A server registered at ``replicas[0]`` that has stored BEFORE; stopped if either
    fails."""
    s = start_server(tmp, replicas, *flags)
    try:
        wait_in_use(s, replicas[0], 0, 10)
        store(s, BEFORE, 4, seed=1)
    except BaseException:
        s.stop()
        raise
    return s


def store(s: ServerProc, tokens: list[int], n: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    with CacheClient(s.engine_url, timeout_s=5.0, engine_id="test-engine") as c:
        c.register(MODEL, "float16", (2, 2, 8), chunk_size=CHUNK)
        data = [rng.integers(0, 255, 1000, dtype=np.uint8) for _ in range(n)]
        assert c.store_chunks(tokens, data).stored == n


# ------------------------------------------------------------------- what replicas say


def held(c: Proc, tokens: list[int]) -> int:
    req = LookupRequest(token_ids=tokens, model_name=MODEL)
    r = httpx.post(c.url + "/directory/lookup", content=msgspec.json.encode(req), timeout=5)
    assert r.status_code == 200, r.text
    resp = msgspec.json.decode(r.content, type=LookupResponse)
    return max((h.chunks for h in resp.prefix_holders if h.instance_id == "node-a"), default=0)


def listed(c: Proc) -> list[str]:
    r = httpx.get(c.url + "/instances", timeout=5)
    return [i["instance_id"] for i in r.json()["instances"]]


def fences(c: Proc) -> dict[str, float]:
    text = httpx.get(c.url + "/metrics", timeout=5).text
    return {
        m.group(1): float(m.group(2))
        for m in re.finditer(r'kvatlas_coordinator_fences_total\{reason="(\w+)"\} (\S+)', text)
    }


def applied_batches(c: Proc) -> float:
    text = httpx.get(c.url + "/metrics", timeout=5).text
    m = re.search(r'kvatlas_coordinator_ingest_batches_total\{outcome="applied"[^}]*\} (\S+)', text)
    return float(m.group(1)) if m else 0.0


def cursor(c: Proc) -> dict[str, Any]:
    stats = httpx.get(c.url + "/directory/stats", timeout=5).json()
    return next(x for x in stats["cursors"] if x["instance_id"] == "node-a")


def in_use(s: ServerProc) -> tuple[str, int, str]:
    st = s.status()
    return st["coordinator"]["url"], st["coordinator"]["failovers"], st["registration_state"]


def wait_in_use(s: ServerProc, replica: Proc, failovers: int, bound_s: float) -> float:
    """Seconds until the server is registered and talks to ``replica``."""
    t0 = time.monotonic()
    wait_until(
        lambda: in_use(s),
        lambda u: u == (replica.url, failovers, "registered"),
        what=f"the server on {replica.url} after {failovers} failovers",
        timeout=bound_s + 10,
        every=0.05,
    )
    return time.monotonic() - t0


def each_event_once(s: ServerProc, survivor: Proc) -> None:
    """The survivor applied every batch the server sent, once, in order."""
    wait_until(lambda: s.status()["events"]["buffered_batches"], lambda n: n == 0, what="sent all")
    last = s.status()["events"]["last_seq"]
    wait_until(lambda: cursor(survivor)["last_seq"], lambda n: n == last, what=f"seq {last}")
    assert cursor(survivor)["gaps"] == 0
    assert applied_batches(survivor) == last


BEFORE = list(range(CHUNK * 4))
AFTER = [7] * CHUNK + list(range(1000, 1000 + CHUNK * 5))


# ------------------------------------------------------------------------------- Kafka


@pytest.mark.kafka
def test_killed_replica_fails_over_without_fence_or_lost_event(
    kafka_replicas: tuple[list[Proc], list[str]], tmp_path: Path
) -> None:
    (a, b), flags = kafka_replicas
    s = start_stored(tmp_path, [a, b], "--event-transport", "kafka", *flags)
    try:
        wait_until(lambda: held(b, BEFORE), lambda n: n == 4, what="B learns from the log")
        killed = time.monotonic()
        a.kill()
        assert wait_in_use(s, b, 1, FAILOVER_BOUND_S) < FAILOVER_BOUND_S
        store(s, AFTER, 6, seed=2)
        wait_until(lambda: held(b, AFTER), lambda n: n == 6, what="events after the failover")
        # past the instance timeout the survivor still lists the server: its heartbeats
        # reach B, and nothing was fenced
        time.sleep(max(0.0, killed + INSTANCE_TIMEOUT_S + 2 * SWEEP_S + 1 - time.monotonic()))
        assert listed(b) == ["node-a"] and fences(b) == {}
        assert held(b, BEFORE) == 4 and held(b, AFTER) == 6
        coordinator = s.status()["coordinator"]
        assert coordinator["reregistrations_after_404"] == 0 and coordinator["resyncs"] == 0
        incarnation = s.status()["incarnation"]
        assert (
            f"coordinator failover of instance node-a incarnation {incarnation}:"
            f" from {a.url} to {b.url} (" in s.text()
        )
        assert re.search(r"kvatlas_server_coordinator_failovers_total\{[^}]*\} 1\.0", s.metrics())
        each_event_once(s, b)
    finally:
        assert s.stop() == 0, s.text()


@pytest.mark.kafka
def test_frozen_replica_costs_a_bounded_delay_then_fails_over(
    kafka_replicas: tuple[list[Proc], list[str]], tmp_path: Path
) -> None:
    (a, b), flags = kafka_replicas
    s = start_stored(tmp_path, [a, b], "--event-transport", "kafka", *flags)
    try:
        frozen = time.monotonic()
        os.kill(a.pid, signal.SIGSTOP)
        assert wait_in_use(s, b, 1, FAILOVER_BOUND_S) < FAILOVER_BOUND_S
        store(s, AFTER, 6, seed=2)
        wait_until(lambda: held(b, AFTER), lambda n: n == 6, what="events after the failover")
        # not synchronisation: the instance timeout elapses, past which B must still list it
        time.sleep(max(0.0, frozen + INSTANCE_TIMEOUT_S + 2 * SWEEP_S + 1 - time.monotonic()))
        assert listed(b) == ["node-a"] and fences(b) == {}
        # the frozen replica wakes with a heartbeat seconds old: it catches up on the log
        # (where the heartbeats B took are) and expires nothing
        os.kill(a.pid, signal.SIGCONT)
        wait_until(lambda: held(a, AFTER), lambda n: n == 6, what="A caught up")
        time.sleep(4 * SWEEP_S)  # not synchronisation: sweeps in which A must expire nothing
        assert listed(a) == ["node-a"] and fences(a) == {}
        assert in_use(s) == (b.url, 1, "registered")  # sticks to the replica that works
        each_event_once(s, b)
    finally:
        assert s.stop() == 0, s.text()


@pytest.mark.kafka
def test_server_dying_behind_a_dead_replica_is_expired_by_the_survivor(
    kafka_replicas: tuple[list[Proc], list[str]], tmp_path: Path
) -> None:
    (a, b), flags = kafka_replicas
    s = start_stored(tmp_path, [a, b], "--event-transport", "kafka", *flags)
    wait_until(lambda: held(b, BEFORE), lambda n: n == 4, what="B learns from the log")
    a.kill()
    s.kill()
    died = time.monotonic()
    wait_until(lambda: listed(b), lambda ids: ids == [], what="B expires the server", timeout=20)
    assert time.monotonic() - died < INSTANCE_TIMEOUT_S + SWEEP_S + 4.0
    assert fences(b) == {"expired": 1.0} and held(b, BEFORE) == 0


# ----------------------------------------------------------- independent replicas (HTTP)


def test_independent_replica_is_registered_and_resynced_without_fence(
    http_replicas: list[Proc], tmp_path: Path
) -> None:
    a, b = http_replicas
    s = start_stored(tmp_path, [a, b])
    try:
        wait_until(lambda: held(a, BEFORE), lambda n: n == 4, what="A holds the chunks")
        assert held(b, BEFORE) == 0 and listed(b) == []  # B shares nothing with A
        a.kill()
        assert wait_in_use(s, b, 1, FAILOVER_BOUND_S) < FAILOVER_BOUND_S
        store(s, AFTER, 6, seed=2)
        # B learns what the server held before (the resync) and what came after
        wait_until(lambda: held(b, BEFORE), lambda n: n == 4, what="the resync on B")
        wait_until(lambda: held(b, AFTER), lambda n: n == 6, what="events after the failover")
        assert listed(b) == ["node-a"] and fences(b) == {}
        assert s.status()["coordinator"]["resyncs"] >= 1
        assert cursor(b)["incarnation"] == s.status()["incarnation"]
    finally:
        assert s.stop() == 0, s.text()
