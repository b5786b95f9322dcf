"""Any token holder could act as any instance. A forged STORE put
placements on a victim, ``seq = 2**63`` made its next batches vanish, ``incarnation =
2**62`` fenced it for good, and a third party could deregister it or re-register it at
its own URL. Replayed against a real ``kvatlas server`` (the victim, which registers with
a credential) and a real ``kvatlas coordinator`` with the shared token: the attacker holds
that token, but not the victim's secret, and every case is refused while the victim's own
requests go on. An unbound instance (registered without a credential, as LMCache's
servers do) is still held to the cursor bounds, and `--require-instance-credentials`
refuses it.
"""

from __future__ import annotations

import hashlib
import logging
import time
import uuid
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import msgspec
import numpy as np
import pytest
from confluent_kafka import Producer

from kvatlas.connector.client import CacheClient
from kvatlas.core.events import Entry, EventBatch
from kvatlas.core.keys import ObjectKey
from kvatlas.core.types import EventType, Incarnation, InstanceId, Tier
from kvatlas.launch.broker import Broker
from kvatlas.runtime.coordinator_client import CoordinatorClient
from kvatlas.server.publisher import EventPublisher
from kvatlas.server.sinks import HttpSink
from kvatlas.wire.instances_api import RegisterRequest
from kvatlas.wire.kafka_records import PROOF_HEADER, encode_batch_msgpack
from support.coordinator import RunningCoordinator
from support.launch import Proc
from support.services import ServerProc, start_coordinator_process
from support.wait import wait_until

from .conftest import BEARER, CHUNK, TOKEN, client, start_server

MODEL = "tiny"
SECRET_HEADER = "kvatlas-instance-secret"  # wire.instances_api.INSTANCE_SECRET_HEADER: the contract
MAX_INT64 = 2**63 - 1


@pytest.fixture(scope="module")
def victim(
    tmp_path_factory: pytest.TempPathFactory, token_file: Path, coordinator: Proc
) -> Iterator[ServerProc]:
    """A ``kvatlas server`` registered with ``coordinator`` (with a credential, as every
    kvatlas server does), heartbeating every 0.5 s and publishing every 0.2 s."""
    s = start_server(
        tmp_path_factory.mktemp("victim"), "victim", token_file,
        "--coordinator-url", coordinator.url, "--coordinator-heartbeat-interval", "0.5",
        "--event-flush-interval", "0.2",
    )  # fmt: skip
    with client(coordinator) as c:
        wait_until(lambda: _listed(c), lambda ids: "victim" in ids, what="the victim listed")
    yield s
    assert s.stop() == 0, s.text()


def _listed(c: httpx.Client) -> dict[str, dict[str, Any]]:
    r = c.get("/instances")
    assert r.status_code == 200, r.text
    return {i["instance_id"]: i for i in r.json()["instances"]}


def _keys_of(c: httpx.Client, instance_id: str) -> int:
    r = c.get("/directory/keys", params={"instance": instance_id, "limit": 1000})
    assert r.status_code == 200, r.text
    return len(r.json()["keys"])


def client_of(rc: RunningCoordinator) -> httpx.Client:
    return httpx.Client(base_url=rc.url, headers=BEARER, timeout=10)


def _digest(secret: str) -> str:
    """What a registration binds: the hex SHA-256 of the instance's secret."""
    return hashlib.sha256(secret.encode()).hexdigest()


def _total_keys(c: httpx.Client) -> int:
    return int(c.get("/directory/stats").json()["keys"])


SNAPSHOTS = "kvatlas_coordinator_snapshot_seconds_count"
"""Snapshots the coordinator has written."""


def _metric(c: httpx.Client, name: str) -> float:
    for row in c.get("/metrics").text.splitlines():
        if row.startswith(name + " "):
            return float(row.rsplit(" ", 1)[1])
    return 0.0


def _status(s: ServerProc) -> dict[str, Any]:
    r = httpx.get(f"{s.url}/status", headers=BEARER, timeout=5)
    assert r.status_code == 200, r.text
    return dict(r.json())


def _batch(iid: str, incarnation: int, seq: int, h: int = 1) -> dict[str, Any]:
    key = {"chunk_hash_hex": f"{h:016x}" * 4, "model_name": MODEL, "kv_rank": 0}
    return {
        "instance_id": iid, "incarnation": incarnation, "seq": seq, "event_type": "store",
        "tier": "l1", "entries": [{"key": key, "size_bytes": 1 << 30}],
    }  # fmt: skip


def _post(c: httpx.Client, *batches: dict[str, Any], secret: str = "") -> httpx.Response:
    headers = {SECRET_HEADER: secret} if secret else {}
    return c.post("/events", json={"batches": list(batches)}, headers=headers)


def _store_through(s: ServerProc, seed: int) -> None:
    """The victim's engine stores one chunk, so the victim publishes a STORE."""
    with CacheClient(s.engine_url, timeout_s=5.0, auth_token=TOKEN) as e:
        e.register(MODEL, "float16", (2, 2, 8), chunk_size=CHUNK)
        data = np.random.default_rng(seed).integers(0, 255, 4096, dtype=np.uint8)
        tokens = [seed * CHUNK + i for i in range(CHUNK)]
        assert e.store_chunks(tokens, [data]).stored == 1


def test_a_forged_store_on_a_bound_victim_is_refused(coordinator: Proc, victim: ServerProc) -> None:
    with client(coordinator) as c:
        me = _listed(c)["victim"]
        before = _keys_of(c, "victim")
        seq = _status(victim)["events"]["last_seq"] + 1
        r = _post(c, _batch("victim", me["incarnation"], seq, h=0xBAD))
        assert r.status_code == 401 and "victim" in r.json()["error"], r.text
        r = _post(c, _batch("victim", me["incarnation"], seq, h=0xBAD), secret="guessed")
        assert r.status_code == 403, r.text
        assert _keys_of(c, "victim") == before


def test_a_seq_jump_or_a_fencing_incarnation_cannot_silence_the_victim(
    coordinator: Proc, victim: ServerProc
) -> None:
    with client(coordinator) as c:
        me = _listed(c)["victim"]
        for attack in (
            _batch("victim", me["incarnation"], MAX_INT64),
            _batch("victim", 2**62, 1),
            _batch("victim", me["incarnation"] + 1, 1),
        ):
            r = _post(c, attack)
            assert r.status_code == 401, (attack, r.text)
        keys = _keys_of(c, "victim")
        _store_through(victim, seed=1)
        # The victim's next real batch still lands: nothing moved its cursor.
        wait_until(
            lambda: _keys_of(c, "victim"), lambda n: n == keys + 1,
            what="the victim's own STORE in the directory",
        )  # fmt: skip
        assert _listed(c)["victim"]["incarnation"] == me["incarnation"]
        assert _status(victim)["events"]["failed_sends"] == 0


def test_a_third_party_cannot_deregister_or_re_register_the_victim(
    coordinator: Proc, victim: ServerProc
) -> None:
    with client(coordinator) as c:
        me = _listed(c)["victim"]
        assert c.delete("/instances/victim").status_code == 401
        r = c.delete("/instances/victim", headers={SECRET_HEADER: "guessed"})
        assert r.status_code == 403, r.text
        takeover = {
            "instance_id": "victim", "ip": "127.0.0.1", "http_port": 6666,
            "p2p_advertised_url": "tcp://127.0.0.1:6667", "incarnation": me["incarnation"] + 1,
            "credential_digest": _digest("attacker"),
        }  # fmt: skip
        r = c.post("/instances", json=takeover)
        assert r.status_code == 401, r.text
        r = c.post("/instances", json=takeover, headers={SECRET_HEADER: "attacker"})
        assert r.status_code == 403, r.text
        unbound = {k: v for k, v in takeover.items() if k != "credential_digest"}
        assert c.post("/instances", json=unbound).status_code == 401
        # The listing still points at the victim, and the victim's heartbeats still count:
        # two more are accepted after the attempts, the last one's age on the listing.
        after = time.monotonic()
        before = _status(victim)["coordinator"]
        wait_until(
            lambda: _status(victim)["coordinator"],
            lambda st: st["heartbeats"] >= before["heartbeats"] + 2,
            what="two more of the victim's heartbeats accepted",
        )
        listed = _listed(c)["victim"]
        assert (listed["http_port"], listed["incarnation"]) == (me["http_port"], me["incarnation"])
        assert listed["heartbeat_age_s"] <= time.monotonic() - after + 0.001, listed
        st = _status(victim)["coordinator"]
        assert st["heartbeat_failures"] == before["heartbeat_failures"], st
        assert st["reregistrations_after_404"] == 0, st


def test_an_unbound_instance_is_held_to_the_cursor_bounds(coordinator: Proc) -> None:
    """What LMCache's servers do (no credential asked): accepted, but no batch may jump
    its seq or incarnation, so nobody can silence it for good either."""
    start = int(time.time())  # LMCache sends its start time in seconds
    with client(coordinator) as c:
        r = c.post("/instances", json={"instance_id": "mp", "ip": "127.0.0.1", "http_port": 7})
        assert r.status_code == 200, r.text
        assert _post(c, _batch("mp", start, 1)).json()["applied"] == 1
        for attack in (_batch("mp", start, MAX_INT64), _batch("mp", start, 2 + 2**20)):
            r = _post(c, attack)
            assert r.status_code == 400 and "--max-seq-jump" in r.json()["error"], r.text
        for inc in (2**62, start + 3600):
            r = _post(c, _batch("mp", inc, 1))
            assert r.status_code == 400, r.text
            assert "--max-incarnation-ahead-s" in r.json()["error"], r.text
        r = c.post(
            "/instances",
            json={"instance_id": "mp", "ip": "127.0.0.1", "http_port": 7, "incarnation": 2**62},
        )
        assert r.status_code == 400, r.text
        # Nothing of a refused body applies, its good batch neither: seq 2 is still new.
        r = _post(c, _batch("mp", start, 2, h=2), _batch("mp", start, MAX_INT64, h=3))
        assert r.status_code == 400
        assert _keys_of(c, "mp") == 1
        r = _post(c, _batch("mp", start, 2, h=2))
        assert (r.json()["applied"], r.json()["duplicates"]) == (1, 0), r.text
        assert _keys_of(c, "mp") == 2
        assert c.delete("/instances/mp").status_code == 204


def test_the_secret_survives_a_coordinator_restart_and_the_attacker_stays_out(
    tmp_path: Path, token_file: Path
) -> None:
    """The snapshot keeps each bound instance's digest: after a restart from it the
    victim's heartbeats and events go on without re-registering, and a third party is
    still refused."""
    snap = tmp_path / "snapshot"
    flags = (
        "--auth-token-file", str(token_file), "--snapshot-path", str(snap),
        "--snapshot-interval", "0.5", "--instance-timeout", "10",
    )  # fmt: skip
    coord = start_coordinator_process(*flags, log=tmp_path / "c1.log")
    s = start_server(
        tmp_path, "victim2", token_file, "--coordinator-url", coord.url,
        "--coordinator-heartbeat-interval", "0.5", "--event-flush-interval", "0.2",
    )  # fmt: skip
    try:
        with client(coord) as c:
            wait_until(lambda: _listed(c), lambda ids: "victim2" in ids, what="victim2 listed")
            # Snapshots are written one after another: the second to end from now on
            # began after victim2 was listed.
            written = _metric(c, SNAPSHOTS)
            wait_until(
                lambda: _metric(c, SNAPSHOTS), lambda n: n >= written + 2,
                what="a snapshot with victim2 in it",
            )  # fmt: skip
        port = int(coord.url.rsplit(":", 1)[1])
        assert coord.stop() == 0, coord.text()
        coord = start_coordinator_process(*flags, port=port, log=tmp_path / "c2.log")
        with client(coord) as c:
            me = _listed(c)["victim2"]
            r = _post(c, _batch("victim2", me["incarnation"], 10**6, h=0xBAD))
            assert r.status_code == 401, r.text
            assert c.delete("/instances/victim2").status_code == 401
            _store_through(s, seed=2)
            wait_until(
                lambda: _keys_of(c, "victim2"), lambda n: n == 1,
                what="victim2's STORE after the restart",
            )  # fmt: skip
        st = _status(s)
        assert st["coordinator"]["reregistrations_after_404"] == 0, st
        assert st["events"]["failed_sends"] == 0, st
    finally:
        assert s.stop() == 0, s.text()
        coord.stop()


def test_require_instance_credentials_refuses_unbound_instances(
    tmp_path: Path, token_file: Path
) -> None:
    coord = start_coordinator_process(
        "--auth-token-file", str(token_file), "--require-instance-credentials",
        log=tmp_path / "c.log",
    )  # fmt: skip
    try:
        body = {"instance_id": "mp", "ip": "127.0.0.1", "http_port": 7}
        with client(coord) as c:
            r = c.post("/instances", json=body)
            assert r.status_code == 401, r.text
            assert "--require-instance-credentials" in r.json()["error"]
            assert _post(c, _batch("mp", 1, 1)).status_code == 401
            secret = "first process of mp"
            r = c.post("/instances", json={**body, "credential_digest": _digest(secret)})
            assert r.status_code == 200, r.text
            assert _post(c, _batch("mp", 1, 1), secret=secret).json()["applied"] == 1
            heartbeat = c.put("/instances/mp/heartbeat", headers={SECRET_HEADER: secret})
            assert heartbeat.status_code == 200
            # The next process proves itself with the old secret and binds its own.
            fresh = "second process of mp"
            again = c.post(
                "/instances", json={**body, "incarnation": 2, "credential_digest": _digest(fresh)},
                headers={SECRET_HEADER: secret},
            )  # fmt: skip
            assert again.status_code == 200, again.text
            assert _post(c, _batch("mp", 2, 1), secret=secret).status_code == 403
            assert _post(c, _batch("mp", 2, 1), secret=fresh).json()["applied"] == 1
            r = c.post("/instances", json={**body, "credential_digest": "ab" * 31})
            assert r.status_code == 400 and "32 bytes" in r.json()["error"], r.text
            assert c.delete("/instances/mp", headers={SECRET_HEADER: fresh}).status_code == 204
            assert _listed(c) == {}
    finally:
        coord.stop()


@pytest.mark.kafka
def test_with_kafka_every_replica_knows_the_credential_and_skips_forged_records(
    kafka_broker: Broker, start_coordinator: Callable[..., RunningCoordinator]
) -> None:
    """Registered through replica A, the instance's digest reaches replica B through the
    log: B takes its heartbeats (failover) and refuses a third party. An event record
    without the instance's proof header is skipped, counted and logged by both."""
    topic = f"events-{uuid.uuid4().hex[:8]}"
    kafka_broker.create_topic(topic, partitions=4)
    cfg = {
        "event_transport": "kafka", "kafka_bootstrap_servers": kafka_broker.bootstrap,
        "kafka_topic": topic, "auth_token": TOKEN,
    }  # fmt: skip
    a, b = start_coordinator(**cfg), start_coordinator(**cfg)
    a.wait_ready()
    b.wait_ready()
    ca = httpx.Client(base_url=a.url, headers=BEARER, timeout=15)
    cb = httpx.Client(base_url=b.url, headers=BEARER, timeout=15)
    body = {"instance_id": "k", "ip": "127.0.0.1", "http_port": 7, "incarnation": 1}
    secret = "k's secret"
    r = ca.post("/instances", json={**body, "credential_digest": _digest(secret)})
    assert r.status_code == 200, r.text
    wait_until(lambda: _listed(cb), lambda ids: "k" in ids, what="replica B to learn k")
    assert cb.put("/instances/k/heartbeat").status_code == 401
    assert cb.put("/instances/k/heartbeat", headers={SECRET_HEADER: "x"}).status_code == 403
    assert cb.put("/instances/k/heartbeat", headers={SECRET_HEADER: secret}).status_code == 200
    r = cb.post("/instances", json={**body, "incarnation": 2, "http_port": 666})
    assert r.status_code == 401, r.text
    producer = Producer(
        {"bootstrap.servers": kafka_broker.bootstrap, "partitioner": "murmur2_random"}
    )
    forged = EventBatch(
        InstanceId("k"), Incarnation(1), 1, EventType.STORE, Tier.L1,
        (Entry(ObjectKey(b"\x01" * 32, MODEL, 0), 10),),
    )  # fmt: skip
    proof = _digest(secret)
    unproven: list[tuple[str, str | bytes | None]] = [(PROOF_HEADER, "00" * 32)]
    proven: list[tuple[str, str | bytes | None]] = [(PROOF_HEADER, proof)]
    for headers in (None, unproven, proven):
        producer.produce(topic, key=b"k", value=encode_batch_msgpack(forged), headers=headers)
        forged = msgspec.structs.replace(
            forged, seq=forged.seq + 1,
            entries=(Entry(ObjectKey(bytes([forged.seq + 1]) * 32, MODEL, 0), 10),),
        )  # fmt: skip
    assert producer.flush(10) == 0
    for c in (ca, cb):
        wait_until(partial(_total_keys, c), lambda n: n == 1, what="the proven record applied")
        metrics = c.get("/metrics").text
        assert 'kvatlas_coordinator_kafka_records_total{kind="refused"} 2.0' in metrics
        assert "kvatlas_coordinator_instance_refusals_total{" in metrics
    assert cb.delete("/instances/k").status_code == 401
    assert cb.delete("/instances/k", headers={SECRET_HEADER: secret}).status_code == 204
    wait_until(lambda: _listed(ca), lambda ids: "k" not in ids, what="k gone from replica A")
    ca.close()
    cb.close()


def test_a_crashed_server_re_registers_at_once_with_the_secret_it_kept(
    tmp_path: Path, token_file: Path
) -> None:
    """The secret of the last registration is kept in the server's state dir: a restart
    after kill -9 presents it and replaces the still-live crashed process at once. A
    start without it (the state dir lost) is refused until the crashed one expires."""
    coord = start_coordinator_process(
        "--auth-token-file", str(token_file), "--instance-timeout", "60",
        log=tmp_path / "c.log",
    )  # fmt: skip
    flags = ("--coordinator-url", coord.url, "--coordinator-heartbeat-interval", "0.5")
    try:
        first = start_server(tmp_path, "phoenix", token_file, *flags)
        with client(coord) as c:
            wait_until(lambda: _listed(c), lambda ids: "phoenix" in ids, what="phoenix listed")
            old = _listed(c)["phoenix"]["incarnation"]
            first.kill()
            second = start_server(tmp_path, "phoenix", token_file, *flags)
            wait_until(
                lambda: _listed(c)["phoenix"]["incarnation"], lambda inc: inc > old,
                what="the restarted phoenix replacing the crashed one", timeout=10,
            )  # fmt: skip
            second.kill()
            elsewhere = tmp_path / "lost"
            elsewhere.mkdir()
            third = start_server(elsewhere, "phoenix", token_file, *flags)
            wait_until(
                lambda: _status(third)["coordinator"]["last_error"], lambda e: "401" in e,
                what="the start without the secret refused",
            )  # fmt: skip
            assert _status(third)["registration_state"] == "unregistered"
            assert third.stop() == 0, third.text()
    finally:
        coord.stop()


def test_a_fresh_batch_answered_duplicate_is_a_fault_at_the_sink(
    start_coordinator: Callable[..., RunningCoordinator], caplog: pytest.LogCaptureFixture
) -> None:
    """A third party moved an unbound instance's seq ahead (within the window): the
    instance's next batches arrive as duplicates. Its publisher tells them from a
    resend's echoes, counts them and logs them with instance, incarnation and seqs."""
    rc = start_coordinator(auth_token=TOKEN)
    coordinator = CoordinatorClient(rc.url, auth_token=TOKEN)
    coordinator.register(
        RegisterRequest("127.0.0.1", 7, InstanceId("u"), incarnation=Incarnation(1))
    )
    with client_of(rc) as c:
        assert _post(c, _batch("u", 1, 5)).json()["applied"] == 1
    pub = EventPublisher(HttpSink(coordinator), InstanceId("u"), Incarnation(1))
    entry = Entry(ObjectKey(b"\x07" * 32, MODEL, 0), 10)
    for event in (EventType.STORE, EventType.DELETE, EventType.STORE):
        pub.publish(event, Tier.L1, [entry])
    with caplog.at_level(logging.WARNING, logger="kvatlas.server.publisher"):
        assert pub.flush() is True
    s = pub.stats()
    assert (s.sent_batches, s.rejected_batches, s.failed_sends) == (3, 3, 0)
    assert "seqs 1..3 of instance u incarnation 1 as duplicate or stale" in caplog.text
    pub.publish(EventType.DELETE, Tier.L1, [entry])
    pub.publish(EventType.STORE, Tier.L1, [entry])
    pub.publish(EventType.DELETE, Tier.L1, [entry])  # seq 6: past the forged one
    assert pub.flush() is True
    assert pub.stats().rejected_batches == 5
    pub.stop(final_flush=False)
    coordinator.close()


def test_with_an_operator_token_only_it_sees_the_cursors(tmp_path: Path, token_file: Path) -> None:
    """`/directory/stats` and the fleet page showed every instance's incarnation and
    last seq to any token holder: what a forger of its events needs. With an operator
    token set, only requests bearing it see them; the rest (in the fleet page's
    document too) get null, with the gaps still there."""
    operator_file = tmp_path / "operator"
    operator_file.write_text("operator-secret\n")
    coord = start_coordinator_process(
        "--auth-token-file", str(token_file), "--operator-token-file", str(operator_file),
        log=tmp_path / "c.log",
    )  # fmt: skip
    try:
        with client(coord) as c:
            assert _post(c, _batch("mp", 7, 3)).json()["applied"] == 1
            cursor = c.get("/directory/stats").json()["cursors"]
            assert cursor == [
                {"instance_id": "mp", "incarnation": None, "last_seq": None, "gaps": 1,
                 "missing": 2},
            ]  # fmt: skip
            page = c.get("/ui/fleet.json").json()["directory"]["cursors"]
            assert (page[0]["incarnation"], page[0]["last_seq"]) == (None, None)
        operator = {"Authorization": "Bearer operator-secret"}
        with httpx.Client(base_url=coord.url, headers=operator, timeout=10) as op:
            cursor = op.get("/directory/stats").json()["cursors"]
            assert (cursor[0]["incarnation"], cursor[0]["last_seq"]) == (7, 3)
            page = op.get("/ui/fleet.json").json()["directory"]["cursors"]
            assert (page[0]["incarnation"], page[0]["last_seq"]) == (7, 3)
            assert op.get("/instances").status_code == 200
        assert httpx.get(f"{coord.url}/directory/stats", timeout=10).status_code == 401
    finally:
        coord.stop()
