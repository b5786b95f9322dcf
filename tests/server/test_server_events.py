"""Registrar, event publisher and HTTP sink against the real coordinator on loopback.

The coordinator is `kvatlas.coordinator.app.Coordinator` served from a thread of this
process (``support.coordinator``); it is stopped and started again on the same port, from
the snapshot its clean stop wrote or from nothing. Tests observe it through its HTTP API
(``/instances``, ``/directory/lookup``, ``/directory/stats``) and, where they look at what
a sink put on the wire, through a recording tap in front of it (``support.tap``).
"""

from __future__ import annotations

import itertools
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from kvatlas.core.events import Entry, EventBatch
from kvatlas.core.keys import HashContract, Namespace, ObjectKey, chunk_hashes, object_keys
from kvatlas.core.types import EventType, Incarnation, InstanceId, Tier
from kvatlas.runtime.coordinator_client import CoordinatorClient, Failover
from kvatlas.server.incarnation import next_incarnation
from kvatlas.server.publisher import EventPublisher
from kvatlas.server.registrar import Identity, Registrar, RegistrationState
from kvatlas.server.sinks import HttpSink
from kvatlas.wire.events_api import decode_events
from support.coordinator import RunningCoordinator
from support.launch import launch
from support.tap import HttpTap
from support.wait import wait_until

NS = Namespace("m", 16777472)

Start = Callable[..., RunningCoordinator]


@pytest.fixture
def coordinator(start_coordinator: Start, tmp_path: Path) -> RunningCoordinator:
    """A real coordinator whose clean stop writes a snapshot (see ``restart``)."""
    return start_coordinator(snapshot_path=str(tmp_path / "coordinator.snap"))


def restart(start: Start, c: RunningCoordinator, keep_state: bool) -> RunningCoordinator:
    """A stopped coordinator started again on its port: from the snapshot its clean stop
    wrote, or from nothing (it lost its state)."""
    assert not c.running
    return start(port=c.port, snapshot_path=c.config.snapshot_path if keep_state else "")


_clients: list[CoordinatorClient] = []


@pytest.fixture(autouse=True)
def _close_clients() -> Iterator[None]:
    yield
    while _clients:
        _clients.pop().close()


def client_of(url: str, token: str | None = None, timeout_s: float = 2.0) -> CoordinatorClient:
    """A client of the coordinator at ``url``, closed after the test."""
    client = CoordinatorClient(url, auth_token=token, timeout_s=timeout_s)
    _clients.append(client)
    return client


def keys(n: int, salt: int = 0) -> list[ObjectKey]:
    tokens = [salt * 1_000_003 + i for i in range(n * 4)]
    return object_keys(chunk_hashes(tokens, 4), NS)


def lookup(c: RunningCoordinator, ks: list[ObjectKey]) -> list[list[dict[str, Any]]]:
    """Per key, its placements as the coordinator lists them."""
    body = {
        "keys": [
            {"chunk_hash_hex": k.chunk_hash.hex(), "model_name": k.model_name, "kv_rank": k.kv_rank}
            for k in ks
        ]
    }
    r = c.client.post("/directory/lookup", json=body)
    assert r.status_code == 200, r.text
    return [list(res["placements"]) for res in r.json()["results"]]


def held(c: RunningCoordinator, iid: str, ks: list[ObjectKey]) -> int:
    """How many of ``ks`` the directory lists at ``iid``."""
    return sum(1 for ps in lookup(c, ks) if any(p["instance_id"] == iid for p in ps))


def gaps(c: RunningCoordinator, iid: str) -> int:
    """Seq gaps the coordinator's event gate counted for ``iid``."""
    return sum(cur["gaps"] for cur in c.stats()["cursors"] if cur["instance_id"] == iid)


# ---------------------------------------------------------------------------- incarnation


def test_incarnation_strictly_increases_even_within_one_tick(tmp_path: Path) -> None:
    values = [next_incarnation(tmp_path, "node-a") for _ in range(200)]
    assert all(b > a for a, b in itertools.pairwise(values))
    assert values[0] >= time.time_ns() - 10**10
    other = next_incarnation(tmp_path, "node-b")
    assert other > 0


def test_incarnation_survives_a_clock_behind_the_file(tmp_path: Path) -> None:
    far_future = time.time_ns() + 10**15
    (tmp_path / "node-a.incarnation").write_text(f"{far_future}\n")
    assert next_incarnation(tmp_path, "node-a") == far_future + 1


def test_incarnation_across_processes(tmp_path: Path) -> None:

    code = (
        "import sys; from pathlib import Path; from kvatlas.server.incarnation import "
        "next_incarnation as n; print(*[n(Path(sys.argv[1]), 'x') for _ in range(50)])"
    )
    procs = [
        launch([sys.executable, "-c", code, str(tmp_path)], name=f"incarnations-{i}", wait=False)
        for i in range(3)
    ]
    seen: list[int] = []
    for p in procs:
        assert p.wait_exit(60) == 0, p.text()
        seen.extend(int(v) for v in p.text().split())
    assert len(set(seen)) == len(seen) == 150


# ------------------------------------------------------------------------------ registrar


def make_registrar(
    c: RunningCoordinator,
    incarnation: int = 1,
    on_resync: Callable[[], None] | None = None,
    token: str | None = None,
) -> Registrar:
    ident = Identity(
        InstanceId("node-a"), Incarnation(incarnation), "127.0.0.1", http_port=7555, mq_port=6555
    )
    return Registrar(client_of(c.url, token), ident, heartbeat_interval_s=0.1, on_resync=on_resync)


def wait_state(reg: Registrar, state: RegistrationState) -> None:
    wait_until(lambda: reg.state, lambda s: s is state, what=f"the registrar {state.value}")


def test_registrar_registers_heartbeats_and_deregisters(coordinator: RunningCoordinator) -> None:
    reg = make_registrar(coordinator)
    reg.start()
    wait_until(lambda: reg.stats().heartbeats, lambda n: n >= 3, what="three heartbeats")
    assert reg.state is RegistrationState.REGISTERED
    assert coordinator.instance_ids() == ["node-a"]
    reg.stop()
    assert coordinator.instance_ids() == []


def test_registrar_reregisters_on_404_and_resyncs(
    coordinator: RunningCoordinator, start_coordinator: Start
) -> None:
    resyncs: list[float] = []
    reg = make_registrar(coordinator, on_resync=lambda: resyncs.append(time.time()))
    reg.start()
    wait_state(reg, RegistrationState.REGISTERED)
    assert resyncs == []
    coordinator.stop()
    wait_state(reg, RegistrationState.DISCONNECTED)
    restart(start_coordinator, coordinator, keep_state=False)  # heartbeat answers 404
    wait_until(lambda: len(resyncs), lambda n: n == 1, what="one resync")
    assert reg.state is RegistrationState.REGISTERED
    s = reg.stats()
    assert s.reregistrations_after_404 == 1 and s.resyncs == 1
    reg.stop()


def test_registrar_keeps_state_when_coordinator_restarts_with_snapshot(
    coordinator: RunningCoordinator, start_coordinator: Start
) -> None:
    resyncs: list[float] = []
    reg = make_registrar(coordinator, on_resync=lambda: resyncs.append(time.time()))
    reg.start()
    wait_state(reg, RegistrationState.REGISTERED)
    coordinator.stop()
    wait_state(reg, RegistrationState.DISCONNECTED)
    restart(start_coordinator, coordinator, keep_state=True)
    wait_state(reg, RegistrationState.REGISTERED)
    beats = reg.stats().heartbeats
    wait_until(
        lambda: reg.stats().heartbeats,
        lambda n: n >= beats + 3,
        what="three heartbeats accepted by the restarted coordinator",
    )
    assert resyncs == [] and reg.stats().reregistrations_after_404 == 0
    reg.stop()


def test_registrar_declares_contracts_and_reports_a_mismatch(
    coordinator: RunningCoordinator,
) -> None:
    other = Identity(
        InstanceId("node-b"), Incarnation(1), "127.0.0.1", http_port=7556, mq_port=6556
    )
    reg_b = Registrar(client_of(coordinator.url, timeout_s=5.0), other, heartbeat_interval_s=0.1)
    assert reg_b.declare_contract(HashContract("llama", kv_dtype="float16")) is None
    reg = make_registrar(coordinator)
    reg.start()
    assert reg.declare_contract(HashContract("qwen", kv_dtype="float16")) is None
    refusal = reg.declare_contract(HashContract("llama", kv_dtype="bfloat16"))
    assert refusal is not None and "kv_dtype" in refusal
    assert reg.stats().contracts == ("qwen",)
    reg.stop()
    reg_b.stop()


def test_registrar_sends_the_bearer_token(start_coordinator: Start) -> None:
    c = start_coordinator(auth_token="s3cret")
    bad = make_registrar(c)
    bad.tick()
    assert bad.state is RegistrationState.UNREGISTERED
    assert "401" in bad.stats().last_error
    good = make_registrar(c, token="s3cret")
    good.tick()
    assert good.state is RegistrationState.REGISTERED
    bad.stop(deregister=False)
    good.stop()


# ------------------------------------------------------------------------------ publisher


def register_once(c: RunningCoordinator) -> None:
    reg = make_registrar(c)
    reg.tick()
    reg.stop(deregister=False)


def make_publisher(
    url: str,
    incarnation: int = 1,
    buffer_batches: int = 1000,
    fmt: str = "msgpack",
    on_loss: Callable[[], None] | None = None,
) -> EventPublisher:
    sink = HttpSink(client_of(url), fmt="json" if fmt == "json" else "msgpack")
    return EventPublisher(
        sink,
        InstanceId("node-a"),
        Incarnation(incarnation),
        flush_interval_s=0.05,
        buffer_batches=buffer_batches,
        max_batch_entries=16,
        on_loss_recovered=on_loss,
    )


@pytest.mark.parametrize("fmt", ["msgpack", "json"])
def test_publisher_delivers_in_order_in_batches(coordinator: RunningCoordinator, fmt: str) -> None:
    register_once(coordinator)
    with HttpTap(coordinator.port) as tap:
        pub = make_publisher(tap.url, fmt=fmt)
        pub.start()
        ks = keys(100)
        pub.publish(EventType.STORE, Tier.L1, [Entry(k, 10) for k in ks])
        pub.publish(EventType.DELETE, Tier.L1, [Entry(k, 10) for k in ks[:10]])
        pub.publish(EventType.STORE, Tier.L2, [Entry(k, 10) for k in ks[:10]])
        wait_until(lambda: pub.stats().sent_entries, lambda n: n == 120, what="120 events sent")
        assert held(coordinator, "node-a", ks) == 100
        assert all(
            [p["tier"] for p in ps] == [Tier.L2.value] for ps in lookup(coordinator, ks[:10])
        )
        s = pub.stats()
        assert s.sent_batches == 7 + 1 + 1 and s.last_seq == 9 and s.dropped_batches == 0
        assert gaps(coordinator, "node-a") == 0
        # msgpack bodies carry every batch as a key block; JSON has no such form
        sent = [
            b
            for r in tap.requests
            if r.target == "/events"
            for b in decode_events(r.body, r.headers["content-type"], 4096)
        ]
        assert [
            isinstance(b, EventBatch) and b.block is not None and not b.entries for b in sent
        ] == [fmt == "msgpack"] * 9
        pub.stop()


def test_outage_shorter_than_the_buffer_loses_nothing(
    coordinator: RunningCoordinator, start_coordinator: Start
) -> None:
    register_once(coordinator)
    pub = make_publisher(coordinator.url)
    pub.start()
    first, during = keys(20, salt=1), keys(50, salt=2)
    pub.publish(EventType.STORE, Tier.L1, [Entry(k, 1) for k in first])
    wait_until(lambda: pub.stats().sent_entries, lambda n: n == 20, what="20 events sent")
    coordinator.stop()
    for start in range(0, len(during), 10):  # five flushes' worth, each cut into batches
        for k in during[start : start + 10]:
            pub.publish(EventType.STORE, Tier.L1, [Entry(k, 1)])
        wait_until(
            lambda: pub.stats().pending_entries, lambda n: n == 0, what="the flush to cut them"
        )
    wait_until(lambda: pub.stats().failed_sends, lambda n: n >= 3, what="three failed sends")
    assert pub.stats().buffered_batches > 0 and pub.stats().last_error
    coordinator = restart(start_coordinator, coordinator, keep_state=True)
    wait_until(lambda: pub.stats().buffered_batches, lambda n: n == 0, what="the buffer to drain")
    assert held(coordinator, "node-a", first + during) == 70
    assert gaps(coordinator, "node-a") == 0
    s = pub.stats()
    assert s.retried_batches > 0 and s.dropped_batches == 0 and s.last_error == ""
    pub.stop()


def test_overflow_is_counted_and_triggers_a_resync(
    coordinator: RunningCoordinator, start_coordinator: Start
) -> None:
    register_once(coordinator)
    recovered: list[int] = []
    pub = make_publisher(coordinator.url, buffer_batches=3, on_loss=lambda: recovered.append(1))
    coordinator.stop()
    for salt in range(6):
        pub.publish(EventType.STORE, Tier.L1, [Entry(k, 1) for k in keys(16, salt=salt)])
        assert pub.flush() is False
    s = pub.stats()
    assert s.dropped_batches == 3 and s.dropped_entries == 48 and s.buffered_batches == 3
    coordinator = restart(start_coordinator, coordinator, keep_state=True)
    assert pub.flush() is True
    assert recovered == [1]
    # the dropped seqs: visible at the coordinator, then resynced
    assert gaps(coordinator, "node-a") == 1
    pub.stop()


def test_registrar_registers_and_resyncs_on_a_replica_that_shares_no_log(
    coordinator: RunningCoordinator, start_coordinator: Start
) -> None:
    """Independent replicas (events over HTTP): A stops, the server fails over to B (404
    there: register, resync); A comes back from its snapshot knowing the instance (its
    heartbeat would answer 200) and B stops: failing back, the registrar registers on A
    again with the same incarnation (no fence) and resyncs, so that A learns what was
    stored while B was in use."""
    b = start_coordinator()
    resyncs: list[str] = []
    reg: Registrar | None = None

    def failed_over(event: Failover) -> None:
        assert reg is not None
        reg.replica_changed(event.to_url)

    client = CoordinatorClient([coordinator.url, b.url], timeout_s=2.0, on_failover=failed_over)
    _clients.append(client)
    ident = Identity(
        InstanceId("node-a"), Incarnation(1), "127.0.0.1", http_port=7555, mq_port=6555
    )
    reg = Registrar(
        client,
        ident,
        heartbeat_interval_s=0.1,
        on_resync=lambda: resyncs.append(client.url),
        resync_on_failover=True,
    )
    reg.start()
    wait_state(reg, RegistrationState.REGISTERED)
    coordinator.stop()
    wait_until(lambda: list(resyncs), lambda r: r == [b.url], what="a resync on B")
    a = restart(start_coordinator, coordinator, keep_state=True)
    assert a.instance_ids() == ["node-a"]
    b.stop()
    wait_until(lambda: list(resyncs), lambda r: r == [b.url, a.url], what="a resync on A")
    s = reg.stats()
    assert s.url == a.url and s.failovers == 2 and s.resyncs == 2
    assert s.reregistrations_after_404 == 1
    assert a.instance_ids() == ["node-a"]
    assert "kvatlas_coordinator_fences_total{" not in a.client.get("/metrics").text
    reg.stop()


class _CatchingUp(BaseHTTPRequestHandler):
    """A coordinator replica that took the registration and now answers 503 (as a Kafka
    replica does while it catches up on the log)."""

    def _reply(self, status: int, body: bytes) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        self._reply(200, b'{"instance_id": "node-a", "re_registered": false, "incarnation": 1}')

    def do_PUT(self) -> None:
        self._reply(503, b'{"error": "not caught up on Kafka topic t yet"}')

    def log_message(self, format: str, *args: object) -> None:
        return


def test_registrar_counts_a_503_as_disconnected_not_as_unregistered() -> None:
    """A 503 is a coordinator that cannot serve now, not one that forgot this server: the
    registrar keeps heartbeating instead of registering again every tick."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _CatchingUp)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        ident = Identity(
            InstanceId("node-a"), Incarnation(1), "127.0.0.1", http_port=7555, mq_port=6555
        )
        url = f"http://127.0.0.1:{server.server_address[1]}"
        reg = Registrar(client_of(url), ident, heartbeat_interval_s=0.05)
        reg.start()
        wait_until(
            lambda: reg.stats().heartbeat_failures, lambda n: n >= 5, what="five 503 heartbeats"
        )
        s = reg.stats()
        assert s.state is RegistrationState.DISCONNECTED and s.registrations == 1
        assert "not caught up" in s.last_error
        reg.stop(deregister=False)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
