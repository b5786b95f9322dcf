"""The P2P data path under clients without the token. The tcp
transport's data port gave each of 1,000 idle unauthenticated connections a thread that
stayed, and the P2P control channel read three unauthenticated 48 MB messages
whole, answering no one else meanwhile. Replayed against a real ``kvatlas server`` with P2P
over tcp: idle connections get no thread, those over the cap are closed at once and the
rest within the first-request deadline; huge channel messages are dropped from their
size header and honest requests are answered meanwhile.

The same on the transport and the channel alone: ``tests/transfer/test_tcp_hostile.py``,
``tests/p2p/test_channel_limits.py``.
"""

from __future__ import annotations

import select
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import zmq

from kvatlas.launch.procs import free_ports
from kvatlas.server.p2p.channel import MAX_MESSAGE_BYTES, ChannelClient
from kvatlas.transfer.config import TcpConfig
from kvatlas.wire import p2p_proto
from support.launch import Proc
from support.services import ServerProc

from .conftest import TOKEN, connect, start_server

IDLE = 300
"""More than the data port's cap (TcpConfig.max_connections)."""
SPARE_THREADS = 16
"""Threads the server may start meanwhile for its own work (pools grow lazily); a thread
per connection would be IDLE more."""


@dataclass
class P2PNode:
    proc: ServerProc
    channel_port: int
    """The P2P control channel (ZeroMQ)."""
    data_port: int
    """The tcp transport's data port."""


@pytest.fixture(scope="module")
def node(
    tmp_path_factory: pytest.TempPathFactory, token_file: Path, coordinator: Proc
) -> Iterator[P2PNode]:
    channel, data = free_ports(2)
    s = start_server(
        tmp_path_factory.mktemp("data-path"), "node-p2p", token_file,
        "--p2p-advertise-url", f"127.0.0.1:{channel}", "--p2p-transfer-engine", "tcp",
        "--p2p-data-port", str(data), "--coordinator-url", coordinator.url,
    )  # fmt: skip
    s.wait_port(data)
    yield P2PNode(s, channel, data)
    assert s.stop() == 0, s.text()


def _threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError(f"no thread count for pid {pid}")


def test_idle_unauthenticated_data_connections_get_no_thread_and_are_closed(
    node: P2PNode,
) -> None:
    assert TcpConfig().max_connections < IDLE
    pid = node.proc.pid
    before = _threads(pid)
    socks = [connect(node.data_port) for _ in range(IDLE)]
    try:
        # Not a synchronisation: the time a server that spawned a thread per connection
        # would need to show it.
        time.sleep(0.5)
        assert _threads(pid) < before + SPARE_THREADS
        deadline = time.monotonic() + TcpConfig().first_request_s + 15
        open_ = list(socks)
        while open_ and time.monotonic() < deadline:
            readable, _, _ = select.select(open_, [], [], 0.5)
            for s in readable:
                assert s.recv(1) == b""  # closed by the server, nothing sent
                open_.remove(s)
        assert not open_, f"{len(open_)} idle connections still open"
        assert _threads(pid) < before + SPARE_THREADS
    finally:
        for s in socks:
            s.close()


def test_huge_channel_messages_are_dropped_and_honest_requests_answered(
    node: P2PNode,
) -> None:
    url = f"tcp://127.0.0.1:{node.channel_port}"
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    big = ctx.socket(zmq.DEALER)
    big.setsockopt(zmq.LINGER, 0)
    client = ChannelClient(ctx, url)
    try:
        big.connect(url)
        for _ in range(3):
            big.send_multipart([b"", b"\x00" * (MAX_MESSAGE_BYTES + 1)])
        t0 = time.monotonic()
        answer = client.call(p2p_proto.Unlock("peer", [], token=TOKEN), timeout_s=5)
        assert isinstance(answer, p2p_proto.Unlocked)
        assert time.monotonic() - t0 < 5
        assert big.poll(1000, zmq.POLLIN) == 0  # no answer: the sender was cut off
    finally:
        client.close()
        big.close(0)
        ctx.term()
