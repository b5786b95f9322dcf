"""Every socket a cache server listens on is bound where its flag says, never on every
interface: the engine API (which is also LMCache's MP port) on ``--host``, the P2P
control channel on ``--p2p-listen-url``'s host, the tcp transport's data port on that
host too, the KV-event sockets on their endpoints. An IPv6 address binds as one.

Loopback has many addresses (127.0.0.0/8 on Linux): a socket bound on 127.0.0.2 is not
reachable at 127.0.0.1, which a socket bound on ``*`` / 0.0.0.0 would be. The process
test reads the kernel's own list of the server's listening sockets (psutil)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import psutil
import pytest
import zmq

from kvatlas.launch.procs import free_port, free_ports
from kvatlas.runtime.net import zmq_tcp
from kvatlas.server.engine_api import EngineApi
from kvatlas.server.engine_service import ServiceIdentity
from kvatlas.server.p2p.channel import ChannelServer
from kvatlas.transfer.base import ArrayMemory
from kvatlas.transfer.config import TcpConfig
from kvatlas.transfer.tcp import TcpServer
from kvatlas.wire.engine_proto import ErrorReply, RequestBody, ResponseBody
from support.launch import launch, python_module
from support.services import start_coordinator_process
from support.wait import wait_until

OTHER = "127.0.0.2"
"""A loopback address other than the tests' usual 127.0.0.1."""


def _ipv6() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


needs_ipv6 = pytest.mark.skipif(not _ipv6(), reason="no IPv6 loopback here")
HOSTS = [OTHER, pytest.param("::1", marks=needs_ipv6)]


def _refused(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=2).close()
    except ConnectionRefusedError:
        return True
    return False


class _Idle:
    identity = ServiceIdentity("node-bind", 1, 256, 30.0)

    def handle(self, body: RequestBody) -> ResponseBody:
        return ErrorReply("invalid_input", "not asked")


def _expect(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


@pytest.mark.parametrize("host", HOSTS)
@pytest.mark.parametrize("fixed", [False, True], ids=["port-0", "port-given"])
def test_engine_api_binds_the_host(host: str, fixed: bool) -> None:
    port = free_port() if fixed else 0
    api = EngineApi(_Idle(), host, port, workers=1)
    api.start()
    try:
        assert api.endpoint == _expect(host, api.bound_port)
        assert fixed is False or api.bound_port == port
        if host == OTHER:
            assert _refused("127.0.0.1", api.bound_port)
    finally:
        api.stop()


@pytest.mark.parametrize("host", HOSTS)
def test_p2p_channel_binds_the_listen_host(host: str) -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    port = free_port()
    server = ChannelServer(ctx, host, port)
    try:
        assert server.endpoint == _expect(host, port)
        if host == OTHER:
            assert _refused("127.0.0.1", port)
    finally:
        server.stop()
        ctx.destroy(0)


@pytest.mark.parametrize("host", HOSTS)
def test_tcp_transport_binds_the_listen_host(host: str) -> None:
    memory = ArrayMemory(np.zeros(4096, np.uint8))
    server = TcpServer(memory, lambda *a: True, token="t", config=TcpConfig(host=host))
    endpoint = server.start()
    try:
        port = int(endpoint.url.rsplit(":", 1)[1])
        assert endpoint.url == _expect(host, port)
        with socket.create_connection((host, port), timeout=2):
            pass
        if host == OTHER:
            assert _refused("127.0.0.1", port)
    finally:
        server.stop()


def test_zmq_endpoints_of_each_host_form() -> None:
    assert zmq_tcp("127.0.0.2", 5) == ("tcp://127.0.0.2:5", False)
    assert zmq_tcp("node-a.internal") == ("tcp://node-a.internal", False)
    assert zmq_tcp("::1", 5) == ("tcp://[::1]:5", True)
    assert zmq_tcp("[fd00::7]", 5) == ("tcp://[fd00::7]:5", True)


@pytest.fixture
def coordinator_url(tmp_path: Path) -> Iterator[str]:
    proc = start_coordinator_process(log=tmp_path / "coordinator.log")
    try:
        yield proc.url
    finally:
        proc.stop()


def _listening(pid: int) -> set[tuple[str, int]]:
    return {
        (c.laddr.ip, c.laddr.port)
        for c in psutil.Process(pid).net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN
    }


@pytest.mark.parametrize("host", HOSTS)
def test_a_server_process_listens_only_where_its_flags_say(
    tmp_path: Path, coordinator_url: str, host: str
) -> None:
    """`kvatlas server` with P2P (tcp transport) and KV events: each of its listening
    sockets is on the host given, on the port its flag names."""
    port, http_port, p2p_port, data_port, pub, replay = free_ports(6)
    url_host = f"[{host}]" if ":" in host else host
    argv = python_module(
        "kvatlas.cli.server",
        "--host", host, "--port", str(port), "--http-port", str(http_port),
        "--instance-id", "bind-a", "--state-dir", str(tmp_path / "state"),
        "--l1-size-gb", "0.01", "--coordinator-url", coordinator_url,
        "--p2p-advertise-url", f"{url_host}:{p2p_port}", "--p2p-data-port", str(data_port),
        "--kv-events-endpoint", f"tcp://{url_host}:{pub}",
        "--kv-events-replay-endpoint", f"tcp://{url_host}:{replay}",
    )  # fmt: skip
    proc = launch(argv, name="bind-a", log=tmp_path / "bind-a.log", wait=False)
    try:
        want = {(host, p) for p in (port, http_port, p2p_port, data_port, pub, replay)}

        def listening() -> set[tuple[str, int]]:
            assert proc.alive(), proc.tail()
            return _listening(proc.pid)

        wait_until(
            listening,
            lambda got: got == want,
            what=f"listening sockets {sorted(want)}",
            timeout=60,  # P2P starts after the first registration
            every=0.2,
        )
        r = httpx.get(f"http://{url_host}:{http_port}/healthz", timeout=5)
        assert r.status_code == 200, r.text
    finally:
        proc.stop()
