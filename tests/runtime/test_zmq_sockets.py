"""The one way a process binds a ZeroMQ socket: a ROUTER on host:port (a free port for
0, a taken one as PortInUse naming the flag, an oversized message refused by ZeroMQ
before it is read) and a socket on an endpoint an operator wrote (ConfigError naming the
flag), on real sockets over loopback."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
import zmq
import zmq.utils.monitor

from kvatlas.core.errors import ConfigError, PortInUse
from kvatlas.runtime.zmq_sockets import bind_endpoint, bind_router
from support.wait import wait_until

Held = list[zmq.Socket[bytes]]


@pytest.fixture
def held() -> Held:
    """The test's sockets, which ``ctx`` closes after it (one left to the garbage
    collector when the test returns warns)."""
    return []


@pytest.fixture
def ctx(held: Held) -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    for sock in reversed(held):
        sock.close(linger=0)
    context.term()


def _dealer(held: Held, ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str) -> zmq.Socket[bytes]:
    dealer: zmq.Socket[bytes] = ctx.socket(zmq.DEALER)
    held.append(dealer)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    return dealer


def test_router_on_port_0_gets_a_free_port_and_answers(
    held: Held, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    bound = bind_router(
        ctx, "127.0.0.1", 0, what="test API", flag="--port", max_message_bytes=1024, recv_hwm=7
    )
    held.append(bound.socket)
    assert bound.port > 0
    assert bound.endpoint == f"tcp://127.0.0.1:{bound.port}"
    assert bound.socket.getsockopt(zmq.LINGER) == 0
    assert bound.socket.getsockopt(zmq.RCVHWM) == 7
    dealer = _dealer(held, ctx, bound.endpoint)
    dealer.send(b"ping")
    assert bound.socket.poll(5000)
    ident, body = bound.socket.recv_multipart()
    assert body == b"ping"
    bound.socket.send_multipart([ident, b"pong"])
    assert dealer.poll(5000)
    assert dealer.recv() == b"pong"


def test_a_taken_port_is_port_in_use_naming_the_flag(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(PortInUse, match="--p2p-listen-url") as info:
            bind_router(
                ctx,
                "127.0.0.1",
                port,
                what="P2P control",
                flag="--p2p-listen-url",
                max_message_bytes=1024,
            )
    assert info.value.port == port
    assert "P2P control port" in str(info.value)


def test_a_message_over_the_cap_disconnects_its_sender_unread(
    held: Held, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    bound = bind_router(ctx, "127.0.0.1", 0, what="test API", flag="--port", max_message_bytes=64)
    held.append(bound.socket)
    monitor = bound.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    held.append(monitor)
    big = _dealer(held, ctx, bound.endpoint)
    big.send(b"x" * 65)

    def disconnected() -> bool:
        return bool(monitor.poll(0)) and (
            zmq.utils.monitor.recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
        )

    wait_until(disconnected, what="the ROUTER drops the sender of an oversized message")
    assert not bound.socket.poll(0)
    bound.socket.disable_monitor()
    small = _dealer(held, ctx, bound.endpoint)
    small.send(b"y" * 64)
    assert bound.socket.poll(5000)
    assert bound.socket.recv_multipart()[1] == b"y" * 64


def test_an_endpoint_that_cannot_bind_is_a_config_error_naming_the_flag(
    held: Held, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    pub = bind_endpoint(ctx, zmq.PUB, "tcp://127.0.0.1:*", flag="--kv-events-endpoint")
    held.append(pub)
    taken = pub.getsockopt_string(zmq.LAST_ENDPOINT)
    with pytest.raises(ConfigError, match="--kv-events-replay-endpoint") as info:
        bind_endpoint(
            ctx, zmq.ROUTER, taken, flag="--kv-events-replay-endpoint", max_message_bytes=1024
        )
    assert taken in str(info.value)
