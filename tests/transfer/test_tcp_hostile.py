"""The tcp transport's data port under hostile clients: idle
connections without a token got a thread each and kept it; now a connection gets a thread
only after a first request that carries the token, connections are capped, and idle
ones are closed. Reads of honest requesters still succeed, also after their pooled
connection was closed while idle."""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Iterator

import msgspec
import numpy as np
import pytest

from kvatlas.core.checksum import checksum
from kvatlas.transfer.base import ArrayMemory, Endpoint, ReadOp, ReadStatus
from kvatlas.transfer.config import TcpConfig
from kvatlas.transfer.tcp import TcpClient, TcpServer
from support.wait import wait_until

TOKEN = "s3cret"
SIZE = 1 << 16


@pytest.fixture
def owner() -> Iterator[tuple[Endpoint, int, np.ndarray]]:
    data = np.random.default_rng(0).integers(0, 255, SIZE, dtype=np.uint8)
    cfg = TcpConfig(max_connections=16, first_request_s=0.5, idle_timeout_s=0.5)
    server = TcpServer(ArrayMemory(data), lambda *a: True, token=TOKEN, config=cfg)
    endpoint = server.start()
    port = int(endpoint.url.rsplit(":", 1)[1])
    yield endpoint, port, data
    server.stop()


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    sock.settimeout(seconds)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except OSError:
        return True


def _closed_now(sock: socket.socket) -> bool:
    """True when the other end has closed ``sock`` (its end of stream is readable)."""
    try:
        return sock.recv(1, socket.MSG_DONTWAIT | socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def _tcp_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name == "kvatlas-tcp-conn")


def test_silent_connections_get_no_thread_and_are_closed(
    owner: tuple[Endpoint, int, np.ndarray],
) -> None:
    _, port, _ = owner
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(12)]
    threads: list[int] = []

    def closed() -> int:
        threads.append(_tcp_threads())  # sampled all along, until the last one closes
        return sum(_closed_now(s) for s in socks)

    try:
        wait_until(closed, lambda n: n == len(socks), what="the owner to close all 12")
        assert max(threads) == 0, threads
    finally:
        for s in socks:
            s.close()


def test_connections_over_the_cap_are_closed_at_once(
    owner: tuple[Endpoint, int, np.ndarray],
) -> None:
    _, port, _ = owner
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(40)]
    try:
        closed = sum(_closed_within(s, 0.2) for s in socks)
        assert closed >= 40 - 16
    finally:
        for s in socks:
            s.close()


def test_a_first_request_without_the_token_is_refused_and_closed(
    owner: tuple[Endpoint, int, np.ndarray],
) -> None:
    _, port, _ = owner
    msg = msgspec.msgpack.encode(["peer", "wrong", "lease", 0, 16])
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(struct.pack(">I", len(msg)) + msg)
        s.settimeout(3)
        answer = b""
        while chunk := s.recv(4096):
            answer += chunk
        assert b"bad auth token" in answer
    assert _tcp_threads() == 0


def test_reads_work_and_survive_the_idle_timeout(
    owner: tuple[Endpoint, int, np.ndarray],
) -> None:
    endpoint, _, data = owner
    local = np.zeros(SIZE, dtype=np.uint8)
    client = TcpClient(ArrayMemory(local), "peer-b", token=TOKEN)
    peer = client.connect(endpoint)
    op = ReadOp(0, 4096, 0, "lease", checksum(data[:4096].data))
    assert [r.status for r in peer.read([op], 5)] == [ReadStatus.OK]
    # the owner closes the pooled connection once it is idle: its thread ends
    wait_until(_tcp_threads, lambda n: n == 0, what="the owner to close the idle connection")
    assert [r.status for r in peer.read([op, op], 5)] == [ReadStatus.OK, ReadStatus.OK]
    assert np.array_equal(local[:4096], data[:4096])
    client.close()
