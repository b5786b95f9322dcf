"""A control request waiting on a peer ends as soon as its abandon event is set (the
controller sets it when the peer's breaker opens), not at its own deadline: lookups in
flight to a frozen peer end with the first one that met its deadline."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import zmq

from kvatlas.launch.procs import free_port
from kvatlas.server.p2p.channel import ChannelClient, ChannelError, ChannelServer
from kvatlas.wire import p2p_proto
from kvatlas.wire.engine_proto import PeerFallback

DEADLINE_S = 60.0
"""The calls' own deadline: an abandoned call ends long before it (the bound is half of
it, so a stalled machine cannot fail a call that ended on its event)."""


@pytest.fixture
def stuck() -> Iterator[tuple[zmq.Context[zmq.Socket[bytes]], str, threading.Event]]:
    """A peer whose handler does not answer until released (a frozen one)."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    port = free_port()
    server = ChannelServer(ctx, "127.0.0.1", port)
    release = threading.Event()

    def handler(body: p2p_proto.P2PRequestBody) -> p2p_proto.P2PResponseBody:
        release.wait(10)
        return p2p_proto.Unlocked(0)

    server.start(handler)
    yield ctx, f"tcp://127.0.0.1:{port}", release
    release.set()
    server.stop()
    ctx.destroy(0)


def test_an_abandoned_call_ends_at_once_as_a_timeout(
    stuck: tuple[zmq.Context[zmq.Socket[bytes]], str, threading.Event],
) -> None:
    ctx, url, _ = stuck
    client = ChannelClient(ctx, url)
    abandon = threading.Event()
    try:
        threading.Timer(0.2, abandon.set).start()
        t0 = time.monotonic()
        with pytest.raises(ChannelError, match="breaker opened") as exc:
            client.call(p2p_proto.Unlock("peer", []), timeout_s=DEADLINE_S, abandon=abandon)
        took = time.monotonic() - t0
        assert exc.value.cause is PeerFallback.TIMEOUT
        # ended by the event (set at 0.2 s), not by its deadline
        assert 0.15 < took < DEADLINE_S / 2, took
        # already set: a call ends without waiting on the peer
        t0 = time.monotonic()
        with pytest.raises(ChannelError):
            client.call(p2p_proto.Unlock("peer", []), timeout_s=DEADLINE_S, abandon=abandon)
        assert time.monotonic() - t0 < DEADLINE_S / 2
    finally:
        client.close()


def test_an_unset_event_leaves_the_deadline_alone(
    stuck: tuple[zmq.Context[zmq.Socket[bytes]], str, threading.Event],
) -> None:
    ctx, url, release = stuck
    client = ChannelClient(ctx, url)
    try:
        threading.Timer(0.3, release.set).start()
        answer = client.call(p2p_proto.Unlock("peer", []), timeout_s=8, abandon=threading.Event())
        assert isinstance(answer, p2p_proto.Unlocked)
    finally:
        client.close()
