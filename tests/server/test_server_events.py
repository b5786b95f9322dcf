"""Registrar, event publisher and HTTP sink against a real HTTP coordinator on loopback.

The coordinator here is a small starlette app over the real core ``FleetState`` (the
same gate and directory the coordinator process uses), served by uvicorn on 127.0.0.1;
it can be stopped and restarted on the same port, with or without its snapshot.
"""

from __future__ import annotations

import itertools
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvatlas.core.errors import InvalidInput
from kvatlas.core.events import Entry
from kvatlas.core.fleet import FleetState
from kvatlas.core.keys import HashContract, Namespace, ObjectKey, chunk_hashes, object_keys
from kvatlas.core.membership import InstanceInfo
from kvatlas.core.types import EventType, Tier
from kvatlas.runtime.coordinator_client import CoordinatorClient
from kvatlas.server.incarnation import next_incarnation
from kvatlas.server.publisher import EventPublisher
from kvatlas.server.registrar import Identity, Registrar, RegistrationState
from kvatlas.server.sinks import HttpSink
from kvatlas.wire.http_api import (
    EventsResponse,
    RegisterRequest,
    RegisterResponse,
    decode_events,
)

NS = Namespace("m", 16777472)


class StandInCoordinator:
    """The coordinator's HTTP membership and events endpoints over a real FleetState."""

    def __init__(self, port: int = 0, token: str | None = None) -> None:
        self.state = FleetState(instance_timeout=30.0)
        self.lock = threading.Lock()
        self.token = token
        self.gaps = 0
        self.requests = 0
        self.block_forms: list[bool] = []
        """Per batch received, whether it came in the key block form."""
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.port = port

    # ---- endpoints
    def _authorized(self, request: Request) -> bool:
        return self.token is None or request.headers.get("authorization") == (
            f"Bearer {self.token}"
        )

    async def register(self, request: Request) -> Response:
        if not self._authorized(request):
            return JSONResponse({"error": "unauthorized"}, 401)
        req = msgspec.json.decode(await request.body(), type=RegisterRequest)
        info = InstanceInfo(
            instance_id=req.instance_id,
            ip=req.ip,
            http_port=req.http_port,
            metadata=req.metadata,
            mq_port=req.mq_port or 0,
            incarnation=req.incarnation or 0,
            contract=req.contract.to_core() if req.contract else None,
        )
        with self.lock:
            try:
                outcome, _ = self.state.register(info, time.time())
            except InvalidInput as exc:
                return JSONResponse({"error": str(exc)}, 409)
        body = RegisterResponse(outcome.instance_id, outcome.re_registered, info.incarnation)
        return Response(msgspec.json.encode(body), media_type="application/json")

    async def heartbeat(self, request: Request) -> Response:
        with self.lock:
            ok = self.state.heartbeat(request.path_params["iid"], time.time())
        if not ok:
            return JSONResponse({"error": "unknown instance"}, 404)
        return JSONResponse({"instance_id": request.path_params["iid"]})

    async def deregister(self, request: Request) -> Response:
        with self.lock:
            self.state.deregister(request.path_params["iid"])
        return JSONResponse({})

    async def events(self, request: Request) -> Response:
        if not self._authorized(request):
            return JSONResponse({"error": "unauthorized"}, 401)
        self.requests += 1
        batches = decode_events(await request.body(), request.headers.get("content-type", ""), 4096)
        counts = {"apply": 0, "duplicate": 0, "stale": 0}
        gaps = provisional = 0
        with self.lock:
            for b in batches:
                self.block_forms.append(b.block is not None and not b.entries)
                out = self.state.ingest(b, time.time())
                counts[out.verdict.value] += 1
                gaps += 1 if out.gap else 0
                provisional += out.provisional
            self.gaps += gaps
        resp = EventsResponse(
            counts["apply"], counts["duplicate"], counts["stale"], gaps, 0, provisional
        )
        return Response(msgspec.json.encode(resp), media_type="application/json")

    # ---- lifecycle
    def start(self) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.port))
        self.port = sock.getsockname()[1]
        app = Starlette(
            routes=[
                Route("/instances", self.register, methods=["POST"]),
                Route("/instances/{iid}/heartbeat", self.heartbeat, methods=["PUT"]),
                Route("/instances/{iid}", self.deregister, methods=["DELETE"]),
                Route("/events", self.events, methods=["POST"]),
            ]
        )
        config = uvicorn.Config(app, log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            assert time.monotonic() < deadline, "stand-in coordinator did not start"
            time.sleep(0.01)

    def stop(self) -> None:
        assert self._server is not None and self._thread is not None
        self._server.should_exit = True
        self._thread.join(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def restart(self, keep_state: bool) -> None:
        """Start again on the same port, from a snapshot of the state or from nothing."""
        if keep_state:
            self.state, _ = FleetState.restore(self.state.snapshot(), now=time.time())
        else:
            self.state = FleetState(instance_timeout=30.0)
        self.start()

    def held_keys(self, iid: str, tier: Tier = Tier.L1) -> set[bytes]:
        with self.lock:
            out: set[bytes] = set()
            for key in self._known:
                for res in self.state.lookup_keys([key]):
                    if any(p.instance_id == iid and p.tier == tier for p in res.placements):
                        out.add(key.chunk_hash)
            return out

    _known: list[ObjectKey] = []


def wait_for(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


@pytest.fixture
def coordinator() -> Iterator[StandInCoordinator]:
    c = StandInCoordinator()
    c.start()
    yield c
    if c._server is not None and not c._server.should_exit:
        c.stop()


_clients: list[CoordinatorClient] = []


@pytest.fixture(autouse=True)
def _close_clients() -> Iterator[None]:
    yield
    while _clients:
        _clients.pop().close()


def client_of(
    c: StandInCoordinator, token: str | None = None, timeout_s: float = 2.0
) -> CoordinatorClient:
    """A client of ``c``, closed after the test."""
    client = CoordinatorClient(c.url, auth_token=token, timeout_s=timeout_s)
    _clients.append(client)
    return client


def keys(n: int, salt: int = 0) -> list[ObjectKey]:
    tokens = [salt * 1_000_003 + i for i in range(n * 4)]
    return object_keys(chunk_hashes(tokens, 4), NS)


def held(c: StandInCoordinator, iid: str, ks: list[ObjectKey]) -> int:
    with c.lock:
        return sum(
            1 for r in c.state.lookup_keys(ks) if any(p.instance_id == iid for p in r.placements)
        )


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
    import subprocess
    import sys

    code = (
        "import sys; from pathlib import Path; from kvatlas.server.incarnation import "
        "next_incarnation as n; print(*[n(Path(sys.argv[1]), 'x') for _ in range(50)])"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE)
        for _ in range(3)
    ]
    seen: list[int] = []
    for p in procs:
        out, _ = p.communicate(timeout=60)
        assert p.returncode == 0
        seen.extend(int(v) for v in out.split())
    assert len(set(seen)) == len(seen) == 150


# ------------------------------------------------------------------------------ registrar


def make_registrar(
    c: StandInCoordinator,
    incarnation: int = 1,
    on_resync: Callable[[], None] | None = None,
    token: str | None = None,
) -> Registrar:
    ident = Identity("node-a", incarnation, "127.0.0.1", http_port=7555, mq_port=6555)
    return Registrar(client_of(c, token), ident, heartbeat_interval_s=0.1, on_resync=on_resync)


def test_registrar_registers_heartbeats_and_deregisters(coordinator: StandInCoordinator) -> None:
    reg = make_registrar(coordinator)
    reg.start()
    wait_for(lambda: reg.stats().heartbeats >= 3)
    assert reg.state is RegistrationState.REGISTERED
    with coordinator.lock:
        assert [i.instance_id for i in coordinator.state.instances()] == ["node-a"]
    reg.stop()
    with coordinator.lock:
        assert coordinator.state.instances() == []


def test_registrar_reregisters_on_404_and_resyncs(coordinator: StandInCoordinator) -> None:
    resyncs: list[float] = []
    reg = make_registrar(coordinator, on_resync=lambda: resyncs.append(time.time()))
    reg.start()
    wait_for(lambda: reg.state is RegistrationState.REGISTERED)
    assert resyncs == []
    coordinator.stop()
    wait_for(lambda: reg.state is RegistrationState.DISCONNECTED)
    coordinator.restart(keep_state=False)  # lost its state: heartbeat answers 404
    wait_for(lambda: len(resyncs) == 1)
    assert reg.state is RegistrationState.REGISTERED
    s = reg.stats()
    assert s.reregistrations_after_404 == 1 and s.resyncs == 1
    reg.stop()


def test_registrar_keeps_state_when_coordinator_restarts_with_snapshot(
    coordinator: StandInCoordinator,
) -> None:
    resyncs: list[float] = []
    reg = make_registrar(coordinator, on_resync=lambda: resyncs.append(time.time()))
    reg.start()
    wait_for(lambda: reg.state is RegistrationState.REGISTERED)
    coordinator.stop()
    wait_for(lambda: reg.state is RegistrationState.DISCONNECTED)
    coordinator.restart(keep_state=True)
    wait_for(lambda: reg.state is RegistrationState.REGISTERED)
    time.sleep(0.3)
    assert resyncs == [] and reg.stats().reregistrations_after_404 == 0
    reg.stop()


def test_registrar_declares_contracts_and_reports_a_mismatch(
    coordinator: StandInCoordinator,
) -> None:
    other = Identity("node-b", 1, "127.0.0.1", http_port=7556, mq_port=6556)
    reg_b = Registrar(client_of(coordinator, timeout_s=5.0), other, heartbeat_interval_s=0.1)
    assert reg_b.declare_contract(HashContract("llama", kv_dtype="float16")) is None
    reg = make_registrar(coordinator)
    reg.start()
    assert reg.declare_contract(HashContract("qwen", kv_dtype="float16")) is None
    refusal = reg.declare_contract(HashContract("llama", kv_dtype="bfloat16"))
    assert refusal is not None and "kv_dtype" in refusal
    assert reg.stats().contracts == ("qwen",)
    reg.stop()
    reg_b.stop()


def test_registrar_sends_the_bearer_token() -> None:
    c = StandInCoordinator(token="s3cret")
    c.start()
    try:
        bad = make_registrar(c)
        bad.tick()
        assert bad.state is RegistrationState.UNREGISTERED
        assert "401" in bad.stats().last_error
        good = make_registrar(c, token="s3cret")
        good.tick()
        assert good.state is RegistrationState.REGISTERED
        bad.stop(deregister=False)
        good.stop()
    finally:
        c.stop()


# ------------------------------------------------------------------------------ publisher


def register_once(c: StandInCoordinator) -> None:
    reg = make_registrar(c)
    reg.tick()
    reg.stop(deregister=False)


def make_publisher(
    c: StandInCoordinator,
    incarnation: int = 1,
    buffer_batches: int = 1000,
    fmt: str = "msgpack",
    on_loss: Callable[[], None] | None = None,
) -> EventPublisher:
    sink = HttpSink(client_of(c), fmt="json" if fmt == "json" else "msgpack")
    return EventPublisher(
        sink,
        "node-a",
        incarnation,
        flush_interval_s=0.05,
        buffer_batches=buffer_batches,
        max_batch_entries=16,
        on_loss_recovered=on_loss,
    )


@pytest.mark.parametrize("fmt", ["msgpack", "json"])
def test_publisher_delivers_in_order_in_batches(coordinator: StandInCoordinator, fmt: str) -> None:
    register_once(coordinator)
    pub = make_publisher(coordinator, fmt=fmt)
    pub.start()
    ks = keys(100)
    pub.publish(EventType.STORE, Tier.L1, [Entry(k, 10) for k in ks])
    pub.publish(EventType.DELETE, Tier.L1, [Entry(k, 10) for k in ks[:10]])
    pub.publish(EventType.STORE, Tier.L2, [Entry(k, 10) for k in ks[:10]])
    wait_for(lambda: pub.stats().sent_entries == 120)
    assert held(coordinator, "node-a", ks) == 100
    with coordinator.lock:
        res = coordinator.state.lookup_keys(ks[:10])
    assert all([p.tier for p in r.placements] == [Tier.L2] for r in res)
    s = pub.stats()
    assert s.sent_batches == 7 + 1 + 1 and s.last_seq == 9 and s.dropped_batches == 0
    assert coordinator.gaps == 0
    # msgpack bodies carry every batch as a key block; JSON has no such form
    assert coordinator.block_forms == [fmt == "msgpack"] * 9
    pub.stop()


def test_outage_shorter_than_the_buffer_loses_nothing(coordinator: StandInCoordinator) -> None:
    register_once(coordinator)
    pub = make_publisher(coordinator)
    pub.start()
    first, during = keys(20, salt=1), keys(50, salt=2)
    pub.publish(EventType.STORE, Tier.L1, [Entry(k, 1) for k in first])
    wait_for(lambda: pub.stats().sent_entries == 20)
    coordinator.stop()
    for k in during:
        pub.publish(EventType.STORE, Tier.L1, [Entry(k, 1)])
        time.sleep(0.005)
    wait_for(lambda: pub.stats().failed_sends >= 3)
    assert pub.stats().buffered_batches > 0 and pub.stats().last_error
    coordinator.restart(keep_state=True)
    wait_for(lambda: pub.stats().buffered_batches == 0)
    assert held(coordinator, "node-a", first + during) == 70
    assert coordinator.gaps == 0
    s = pub.stats()
    assert s.retried_batches > 0 and s.dropped_batches == 0 and s.last_error == ""
    pub.stop()


def test_overflow_is_counted_and_triggers_a_resync(coordinator: StandInCoordinator) -> None:
    register_once(coordinator)
    recovered: list[int] = []
    pub = make_publisher(coordinator, buffer_batches=3, on_loss=lambda: recovered.append(1))
    coordinator.stop()
    for salt in range(6):
        pub.publish(EventType.STORE, Tier.L1, [Entry(k, 1) for k in keys(16, salt=salt)])
        assert pub.flush() is False
    s = pub.stats()
    assert s.dropped_batches == 3 and s.dropped_entries == 48 and s.buffered_batches == 3
    coordinator.restart(keep_state=True)
    assert pub.flush() is True
    assert recovered == [1]
    assert coordinator.gaps == 1  # the dropped seqs: visible at the coordinator, then resynced
    pub.stop()
