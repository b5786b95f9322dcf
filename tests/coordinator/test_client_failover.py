"""`CoordinatorClient` over several replicas, against real coordinators on 127.0.0.1 and
replicas that fail as real ones do: a dead port (refused), a socket that accepts and
never answers (a frozen process: SIGSTOP looks exactly like this from outside), a 503.
The client sticks to the replica that answers, fails over within the call's deadline,
skips a failed replica for a while and tries it again later, never fails over on a 4xx,
and counts and reports every failover."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from kvatlas.core.types import Incarnation, InstanceId
from kvatlas.launch.procs import free_port
from kvatlas.runtime.coordinator_client import (
    CoordinatorClient,
    CoordinatorRefused,
    CoordinatorUnreachable,
    Failover,
    UnknownInstance,
)
from kvatlas.wire.directory_api import LookupRequest
from kvatlas.wire.instances_api import RegisterRequest
from support.coordinator import RunningCoordinator
from support.wait import wait_until

from .events import batch, fake_hash

Start = Callable[..., RunningCoordinator]


def register_request(iid: str) -> RegisterRequest:
    return RegisterRequest(
        ip="127.0.0.1", http_port=7555, instance_id=InstanceId(iid), incarnation=Incarnation(1)
    )


def dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}"


@pytest.fixture
def frozen() -> Iterator[str]:
    """A replica that accepts connections and never answers."""
    with socket.create_server(("127.0.0.1", 0)) as sock:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


class _Unavailable(BaseHTTPRequestHandler):
    def _answer(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        body = b'{"error": "catching up on the log"}'
        self.send_response(503)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self._answer()

    def do_POST(self) -> None:
        self._answer()

    def do_PUT(self) -> None:
        self._answer()

    def log_message(self, format: str, *args: object) -> None:
        return


@pytest.fixture
def unavailable() -> Iterator[str]:
    """A replica that answers every request 503."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Unavailable)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join(5)


def test_one_url_is_never_skipped() -> None:
    url = dead_url()
    with CoordinatorClient(url, timeout_s=2.0) as client:
        for _ in range(2):
            with pytest.raises(CoordinatorUnreachable):
                client.heartbeat("node-a")
        st = client.stats()
        assert st.url == url and st.failovers == 0
        assert [(r.failures, r.skipped_for_s) for r in st.replicas] == [(2, 0.0)]


def test_a_dead_replica_fails_over_and_is_then_skipped(start_coordinator: Start) -> None:
    live = start_coordinator()
    dead = dead_url()
    seen: list[Failover] = []
    with CoordinatorClient([dead, live.url], timeout_s=2.0, on_failover=seen.append) as client:
        client.register(register_request("node-a"))
        assert client.url == live.url and client.urls == (dead, live.url)
        assert [(f.from_url, f.to_url) for f in seen] == [(dead, live.url)]
        assert "ConnectError" in seen[0].reason
        client.heartbeat("node-a")
        assert client.post_events([batch("node-a", 1, [fake_hash(1)])]).applied == 1
        st = client.stats()
        assert st.failovers == 1
        assert st.replicas[0].failures == 1  # skipped since: asked once
        assert st.replicas[0].skipped_for_s > 0 and st.replicas[1].failures == 0
    assert live.instance_ids() == ["node-a"]


def test_a_frozen_replica_costs_one_deadline(start_coordinator: Start, frozen: str) -> None:
    live = start_coordinator()
    with CoordinatorClient([frozen, live.url], timeout_s=0.5) as client:
        t0 = time.monotonic()
        client.register(register_request("node-a"))
        assert time.monotonic() - t0 >= 0.5  # it waited out the frozen one's deadline
        assert client.stats().replicas[0].failures == 1  # once
        for _ in range(5):
            client.heartbeat("node-a")
        # the frozen replica is not asked again: one more ask would be one more failure
        assert client.stats().replicas[0].failures == 1


def test_the_calls_own_deadline_bounds_every_replica_together(frozen: str) -> None:
    with socket.create_server(("127.0.0.1", 0)) as other:
        second = f"http://127.0.0.1:{other.getsockname()[1]}"
        with CoordinatorClient([frozen, second], timeout_s=30.0) as client:
            t0 = time.monotonic()
            with pytest.raises(CoordinatorUnreachable) as info:
                client.lookup(LookupRequest(keys=[]), timeout_s=0.4)
            # not a replica's own 30 s deadline, let alone two of them
            assert time.monotonic() - t0 < 15.0
            assert isinstance(info.value.__cause__, httpx.TimeoutException)


def test_a_5xx_fails_over_and_a_4xx_does_not(start_coordinator: Start, unavailable: str) -> None:
    a = start_coordinator()
    b = start_coordinator()
    with CoordinatorClient([unavailable, a.url, b.url], timeout_s=2.0) as client:
        client.register(register_request("node-a"))
        assert client.url == a.url and client.stats().failovers == 1
        with pytest.raises(UnknownInstance):
            client.heartbeat("nobody")  # 404: an answer, A stays in use
        stale = RegisterRequest(
            ip="127.0.0.1",
            http_port=7555,
            instance_id=InstanceId("node-a"),
            incarnation=Incarnation(0),
        )
        with pytest.raises(CoordinatorRefused) as info:
            client.register(stale)  # a lower incarnation: refused, by A
        assert 400 <= info.value.status < 500, info.value
        assert client.url == a.url and client.stats().failovers == 1
    assert a.instance_ids() == ["node-a"] and b.instance_ids() == []


def test_every_replica_failing_raises_the_last_error_naming_the_others(
    unavailable: str,
) -> None:
    dead = dead_url()
    with CoordinatorClient([dead, unavailable], timeout_s=2.0) as client:
        with pytest.raises(CoordinatorRefused) as info:
            client.register(register_request("node-a"))
        assert info.value.status == 503 and info.value.reason == "catching up on the log"
        assert dead in str(info.value)
        # both skipped now: the next call asks only the one whose skip ends first
        with pytest.raises(CoordinatorUnreachable):
            client.register(register_request("node-a"))
        assert [r.failures for r in client.stats().replicas] == [2, 1]


def test_a_replica_that_comes_back_is_tried_again(start_coordinator: Start) -> None:
    port = free_port()
    first = f"http://127.0.0.1:{port}"
    second = start_coordinator()
    with CoordinatorClient([first, second.url], timeout_s=2.0, skip_s=0.2) as client:
        client.register(register_request("node-a"))
        assert client.url == second.url
        back = start_coordinator(port=port)
        second.stop()
        wait_until(
            lambda: client.stats().replicas[0].skipped_for_s, lambda left: left == 0,
            what="the first replica's skip over (half-open)",
        )  # fmt: skip
        client.register(register_request("node-a"))
        st = client.stats()
        assert st.url == first and st.failovers == 2
        assert [r.skipped_for_s > 0 for r in st.replicas] == [False, True]
    assert back.instance_ids() == ["node-a"]
