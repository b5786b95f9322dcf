"""Two registrations with conflicting hash contracts for one model, sent at the same
moment through two replicas of a Kafka-replicated coordinator (a real tansu broker, a
topic of 8 partitions): every replica ends with the same members, and the HTTP answers
agree with them (one 200, one 409). The receiving replica decides a contract through a
claim keyed by the model (`core.contract_claims`), so the log's one order of claims
decides, not each replica's interleaving of the two instances' partitions."""

from __future__ import annotations

import concurrent.futures
import threading
import uuid
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from support.coordinator import RunningCoordinator
from support.wait import wait_until

from .events import register_body

pytestmark = [pytest.mark.kafka]

Start = Callable[..., RunningCoordinator]
RUNS = 50
"""Races in a row (the bar: 50 in a row, one broker, a new model each)."""


def _replicas(kafka_broker: Any, start_coordinator: Start) -> tuple[RunningCoordinator, ...]:
    topic = f"race-{uuid.uuid4().hex[:8]}"
    kafka_broker.create_topic(topic, partitions=8)
    cfg = {
        "event_transport": "kafka",
        "kafka_bootstrap_servers": kafka_broker.bootstrap,
        "kafka_topic": topic,
    }
    replicas = (start_coordinator(**cfg), start_coordinator(**cfg))
    for r in replicas:
        r.wait_ready()
    return replicas


def _race(
    a: RunningCoordinator, b: RunningCoordinator, bodies: tuple[dict[str, Any], dict[str, Any]]
) -> tuple[httpx.Response, httpx.Response]:
    """Both registrations sent at once, one through each replica (each on a client of
    its own: httpx's clients are not shared across threads here)."""
    go = threading.Barrier(2)

    def send(replica: RunningCoordinator, body: dict[str, Any]) -> httpx.Response:
        with httpx.Client(base_url=replica.url, timeout=30) as client:
            go.wait()
            return client.post("/instances", json=body)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        fa = pool.submit(send, a, bodies[0])
        fb = pool.submit(send, b, bodies[1])
        return fa.result(), fb.result()


def test_conflicting_registrations_racing_through_two_replicas_end_alike(
    kafka_broker: Any, start_coordinator: Start
) -> None:
    a, b = _replicas(kafka_broker, start_coordinator)
    members: set[str] = set()
    winners = {"x": 0, "y": 0}
    for run in range(RUNS):
        model = f"model-{run}-{uuid.uuid4().hex[:6]}"
        x, y = f"x-{run}", f"y-{run}"
        bodies = (
            register_body(x, contract={"model_name": model, "chunk_size": 256}),
            register_body(y, contract={"model_name": model, "chunk_size": 16}),
        )
        ra, rb = _race(a, b, bodies)
        codes = (ra.status_code, rb.status_code)
        assert sorted(codes) == [200, 409], (run, ra.text, rb.text)
        winner, loser = (x, y) if codes[0] == 200 else (y, x)
        refused = rb if codes[0] == 200 else ra
        assert "chunk_size" in refused.json()["error"], refused.text
        winners[winner[0]] += 1
        members.add(winner)
        # every replica lists the winner and never the loser: the same members, so the
        # same contract for the model (the winner's, its only live instance)
        for replica in (a, b):
            wait_until(
                lambda r=replica: set(r.instance_ids()),  # type: ignore[misc]
                lambda ids: ids == members,
                what=f"run {run}: {replica.url} lists {sorted(members)}",
                timeout=15,
            )
        # and every replica refuses the loser's contract now, as its receiver did
        loser_body = bodies[0] if loser == x else bodies[1]
        for replica in (a, b):
            again = replica.client.post("/instances", json={**loser_body, "instance_id": loser})
            assert again.status_code == 409, (run, replica.url, again.text)
    assert set(a.instance_ids()) == set(b.instance_ids()) == members
    # both replicas received winners: the race was a race, not one replica always first
    print(f"{RUNS} races: winners through replica A {winners['x']}, through B {winners['y']}")
