"""Slow clients held the coordinator. Any received byte counted as
activity, so clients trickling headers and bodies stayed connected past the idle timeout,
enough of them exhausted the descriptors, and 8 connections sending 60 MiB of declared
64 MiB bodies and then stalling grew the process's resident memory by hundreds of MB
that it never gave back. Replayed against a real ``kvatlas coordinator``: trickled
headers and stalled bodies are cut with 408, bodies held at once are capped (503 with
Retry-After beyond the budget), their memory is returned, the connection cap answers
503, and normal clients are answered all along.

The same rules on the HTTP server alone (deadlines, windows, the budget's accounting):
``tests/coordinator/test_edge_protocol.py`` (on a fake clock) and ``test_edge_server.py``;
normal clients' latency during such an attack: ``python -m bench.http_attack_bench``
(docs/benchmarks.md).
"""

from __future__ import annotations

import select
import socket
import threading
from collections.abc import Iterator

import httpx
import pytest

from support.launch import Proc
from support.services import start_coordinator_process
from support.wait import wait_until

from .conftest import client, connect, rss_bytes

MIB = 1 << 20
BODY_LIMIT = 32 * MIB
BUDGET = 64 * MIB
STALLED = 30 * MIB
"""What each stalled body sends of its declared BODY_LIMIT before it stops."""
HEADER_DEADLINE_S = 3.0
BODY_WINDOW_S = 3.0


@pytest.fixture(scope="module")
def coordinator(token_file: object) -> Iterator[Proc]:
    proc = start_coordinator_process(
        "--auth-token-file", str(token_file), "--max-body-bytes", str(BODY_LIMIT),
        "--max-buffered-bytes", str(BUDGET), "--max-connections", "64",
        "--header-timeout-s", str(HEADER_DEADLINE_S), "--body-timeout-s", str(BODY_WINDOW_S),
    )  # fmt: skip
    yield proc
    proc.stop()


def _status(sock: socket.socket, timeout: float) -> int:
    """The status of the answer on ``sock`` (0 when it closed without one)."""
    sock.settimeout(timeout)
    head = b""
    try:
        while b"\r\n" not in head:
            got = sock.recv(4096)
            if not got:
                return 0
            head += got
    except OSError:
        return 0
    return int(head.split()[1])


def _send_stalled_body(port: int) -> socket.socket:
    """A POST that declares BODY_LIMIT bytes, sends STALLED of them (or until refused)."""
    s = connect(port)
    s.sendall(
        b"POST /events HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % BODY_LIMIT
    )
    chunk = b"x" * MIB
    try:
        for _ in range(STALLED // MIB):
            if select.select([s], [], [], 0)[0]:
                break  # answered already: refused
            s.sendall(chunk)
    except OSError:
        pass  # refused and reset while sending
    return s


class _Trickler(threading.Thread):
    """Clients that send their headers a byte every 0.5 s, until each is answered."""

    def __init__(self, port: int, n: int) -> None:
        super().__init__(daemon=True)
        self.socks = [connect(port) for _ in range(n)]
        for s in self.socks:
            s.sendall(b"GET /instances HTTP/1.1\r\nHost: x\r\n")
        self.answered: dict[int, int] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.5) and len(self.answered) < len(self.socks):
            for i, s in enumerate(self.socks):
                if i in self.answered:
                    continue
                if select.select([s], [], [], 0)[0]:
                    self.answered[i] = _status(s, 5)
                else:
                    try:
                        s.sendall(b"x")
                    except OSError:
                        self.answered[i] = 0


def test_slow_headers_and_stalled_bodies_are_cut_and_normal_clients_answered(
    coordinator: Proc,
) -> None:
    port = coordinator.http_port
    before = rss_bytes(coordinator.pid)
    tricklers = _Trickler(port, 20)
    tricklers.start()
    bodies = [_send_stalled_body(port) for _ in range(4)]
    # Two bodies fit the budget; the other two were refused before being read.
    refused = [b for b in bodies if select.select([b], [], [], 2.0)[0]]
    assert [_status(b, 5) for b in refused] == [503, 503]
    held = rss_bytes(coordinator.pid) - before
    assert held < BUDGET + 40 * MIB, f"resident memory grew by {held / MIB:.0f} MiB"

    normal = client(coordinator)
    answers: list[int] = []
    stalled = [b for b in bodies if b not in refused]
    statuses: dict[int, int] = {}

    def cut() -> tuple[dict[int, int], dict[int, int]]:
        """A normal client's request (its answer kept), then the connections cut so far."""
        answers.append(normal.get("/instances").status_code)
        for i, b in enumerate(stalled):
            if i not in statuses and select.select([b], [], [], 0)[0]:
                statuses[i] = _status(b, 5)
        return statuses, dict(tricklers.answered)

    try:
        wait_until(
            cut,
            lambda seen: len(seen[0]) == len(stalled) and len(seen[1]) == len(tricklers.socks),
            what="every stalled body and trickling header cut",
            timeout=HEADER_DEADLINE_S + 2 * BODY_WINDOW_S + 5,
            every=0.2,
        )
    finally:
        tricklers.stop.set()
        tricklers.join(10)
    assert set(tricklers.answered.values()) == {408}, tricklers.answered
    assert statuses == {0: 408, 1: 408}
    assert answers and set(answers) == {200}, "a normal client was refused during the attack"

    for s in tricklers.socks + bodies:
        s.close()
    wait_until(
        lambda: rss_bytes(coordinator.pid) - before,
        lambda grown: grown < 24 * MIB,
        what="the coordinator to give the stalled bodies' memory back",
        timeout=10,
    )
    metrics = normal.get("/metrics").text
    assert 'kvatlas_coordinator_http_refused_total{cause="buffered_bytes"} 2.0' in metrics
    assert 'kvatlas_coordinator_http_refused_total{cause="header_deadline"} 20.0' in metrics
    assert 'kvatlas_coordinator_http_refused_total{cause="body_rate"} 2.0' in metrics
    assert "kvatlas_coordinator_http_buffered_bytes 0.0" in metrics
    normal.close()


def test_connections_over_the_cap_get_503_and_normal_clients_come_back(
    coordinator: Proc,
) -> None:
    port = coordinator.http_port
    with client(coordinator) as normal:
        assert normal.get("/instances").status_code == 200
    held = [connect(port) for _ in range(64)]
    try:
        wait_until(
            lambda: _refused_now(coordinator),
            what="a connection over the cap of 64 to be refused with 503",
            timeout=10,
            ignore=(httpx.TransportError,),
        )
    finally:
        for s in held:
            s.close()
    with client(coordinator) as normal:
        assert normal.get("/instances").status_code == 200


def _refused_now(coordinator: Proc) -> bool:
    r = httpx.get(coordinator.url + "/healthz", timeout=5)
    return r.status_code == 503 and r.headers.get("retry-after") == "1"
