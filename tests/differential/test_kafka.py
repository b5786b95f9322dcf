"""The Kafka transport, differentially: LMCache's coordinator and kvatlas' consume the
same topic on the real tansu broker, and their directories must answer alike.

The records are LMCache's own (``KafkaCacheEventSink``): one ``{"batches": [batch]}``
JSON envelope per batch, keyed by instance id, librdkafka's default partitioner.
Hypothesis generates each instance's stream (stores of prompt prefixes in L1 or L2,
accesses, deletes, config declarations, replays of an earlier record, a stale
incarnation, an undecodable record); when both coordinators have read a closing
sentinel record of every instance, the same lookups, listings, stats and usage reads go
to both and are judged (``compare.py``). ``POST /events`` is closed at both. The pair
runs once per LMCache version (``conftest.VERSIONS``).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from kvatlas.launch.broker import Broker
from lmcache.fleet import KvatlasCoordinator
from support.wait import wait_until

from .differences import Call
from .harness import LMCacheCoord, Pair, body, report
from .ops import CHUNK, Run, tokens

pytestmark = [pytest.mark.lmcache, pytest.mark.kafka]

STEP = st.one_of(
    st.tuples(st.just("store"), st.integers(0, 1), st.integers(1, 3),
              st.sampled_from(["l1", "l2"])),
    st.tuples(st.just("access"), st.integers(0, 1), st.integers(1, 3), st.just("l1")),
    st.tuples(st.just("delete"), st.integers(0, 1), st.integers(1, 3),
              st.sampled_from(["l1", "l2"])),
    st.tuples(st.just("config"), st.integers(0, 1), st.integers(1, 3),
              st.sampled_from(["l1", "l2"])),
    st.tuples(st.sampled_from(["replay", "stale", "garbage"]), st.just(0), st.just(1),
              st.just("l1")),
)  # fmt: skip


@pytest.fixture(scope="module")
def kafka_pair(
    version: str, coordinator_venv: Path, logs: Path, kafka_broker: Broker
) -> Iterator[tuple[Pair, Any, str]]:
    topic = f"diff-{uuid.uuid4().hex[:8]}"
    kafka_broker.create_topic(topic, partitions=4)
    lm = LMCacheCoord(
        logs,
        coordinator_venv,
        "--event-transport", "kafka",
        "--kafka-bootstrap-servers", kafka_broker.bootstrap,
        "--kafka-topic", topic,
        name=f"lmcache-coord-kafka-{version}",
    )  # fmt: skip
    kv = KvatlasCoordinator(
        logs,
        "--event-transport", "kafka",
        "--kafka-bootstrap-servers", kafka_broker.bootstrap,
        "--kafka-topic", topic,
        "--kafka-partitioner", "consistent_random",
    )  # fmt: skip
    producer = Producer(
        {
            "bootstrap.servers": kafka_broker.bootstrap,
            "partitioner": "consistent_random",
            "log_level": 2,  # no reconnect noise once the session's broker has stopped
        }
    )
    try:
        lm.wait()
        kv.wait()
        yield Pair(lm, kv, version), producer, topic
    finally:
        producer.flush(10)
        kv.stop()
        lm.stop()


def publish(producer: Any, topic: str, records: list[tuple[str, bytes]]) -> None:
    for key, value in records:
        producer.produce(topic, key=key.encode(), value=value)
    assert producer.flush(15) == 0


def holds(pair: Pair, run: Run, sentinel: str) -> bool:
    """Both coordinators show the sentinel key of every instance of the run."""
    req = {"keys": [run.key(sentinel)]}
    for c in (pair.lm.http, pair.kv.http):
        r = c.post("/directory/lookup", json=req)
        if r.status_code != 200:
            return False
        ids = {p["instance_id"] for p in r.json()["results"][0]["placements"]}
        if ids != {run.iid(1), run.iid(2)}:
            return False
    return True


@settings(
    max_examples=6,
    deadline=None,
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(streams=st.lists(st.tuples(st.integers(1, 2), STEP), min_size=1, max_size=14))
def test_kafka_streams_answered_alike(
    kafka_pair: tuple[Pair, Any, str], streams: list[tuple[int, tuple[str, int, int, str]]]
) -> None:
    pair, producer, topic = kafka_pair
    run = Run(pair)
    since = len(pair.verdicts)
    base = int(run.tag, 16) % 1_000_000 * 4096
    try:
        run.register(1)
        run.register(2)
        records: list[tuple[str, bytes]] = []
        sent: dict[int, list[bytes]] = {1: [], 2: []}
        for n, (op, p, chunks, tier) in streams:
            # each instance its own prompts: partitions are read in each consumer's own
            # interleaving, so an access to a key another instance's record creates would
            # count or not by that order, at either coordinator
            toks = tokens(base + n * 1_000_000 + p * 100_000, chunks)
            backend = "dram" if tier == "l1" else "fs"
            value: bytes
            if op in ("store", "access", "delete"):
                hashes = run.chain(toks)
                if op == "delete":
                    hashes = hashes[-1:]
                parts = [toks[i * CHUNK : (i + 1) * CHUNK] for i in range(len(hashes))]
                b = run.logged(n, op, tier=tier, backend="" if op == "access" else backend,
                              entries=[{"key": run.key(h), "size_bytes": 4096 if op == "store"
                                        else 0, "token_ids": parts[i] if op == "store" else [],
                                        "token_offset": i * CHUNK if op == "store" else -1}
                                       for i, h in enumerate(hashes)])  # fmt: skip
                value = body({"batches": [b]})
            elif op == "config":
                b = run.logged(n, "config", tier=tier, backend=backend, capacity_bytes=chunks << 20,
                              capacity_revision=chunks)  # fmt: skip
                value = body({"batches": [b]})
            elif op == "replay" and sent[n]:
                value = sent[n][-1]
            elif op == "stale":
                s = run.streams[run.iid(n)]
                b = run.batch(n, "access", seq=s.seq + 1, incarnation=s.incarnation - 1)
                value = body({"batches": [b]})
            else:
                value = b"\x00not json"
            sent[n].append(value)
            records.append((run.iid(n), value))
        sentinel = uuid.uuid4().hex + uuid.uuid4().hex
        for n in (1, 2):
            b = run.logged(n, "store", entries=[{"key": run.key(sentinel), "size_bytes": 1}])
            records.append((run.iid(n), body({"batches": [b]})))
        publish(producer, topic, records)
        wait_until(lambda: holds(pair, run, sentinel), bool, what="both read every record",
                   timeout=30)  # fmt: skip
        # the same reads at both
        run.send("POST", "/events", {"batches": []}, kind="kafka-transport")
        for p in (0, 1):
            for n in (1, 2):
                prompt = tokens(base + n * 1_000_000 + p * 100_000, 3)
                run.lookup_tokens(prompt)
                run.lookup_keys(run.chain(prompt))
        for n in (1, 2):
            run.get(f"/directory/keys?instance_id={run.iid(n)}")
            run.get(f"/instances/{run.iid(n)}/usage")
        run.get("/directory/stats")
        run.get("/instances/usage")
        bad = pair.mismatches(since)
        if bad:
            pytest.fail(report(bad), pytrace=False)
    finally:  # POST /events is closed: the instances leave, their L1 placements with them
        for n in (1, 2):
            pair.raw(Call("DELETE", f"/instances/{run.iid(n)}"))
