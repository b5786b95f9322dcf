"""The P2P control channel refuses a huge message from its size header, before reading
it or checking its token (reading three unauthenticated 48 MB messages whole stalled
everyone else), and keeps answering honest requests meanwhile."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import zmq
import zmq.utils.monitor

from kvatlas.launch.procs import free_port
from kvatlas.server.p2p.channel import MAX_MESSAGE_BYTES, ChannelClient, ChannelServer
from kvatlas.wire import p2p_proto


@pytest.fixture
def channel() -> Iterator[tuple[zmq.Context[zmq.Socket[bytes]], ChannelServer, str]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    port = free_port()
    server = ChannelServer(ctx, "127.0.0.1", port)
    server.start(lambda body: p2p_proto.Unlocked(0))
    yield ctx, server, f"tcp://127.0.0.1:{port}"
    server.stop()
    ctx.destroy(0)


def test_huge_messages_are_dropped_unread_and_others_answered(
    channel: tuple[zmq.Context[zmq.Socket[bytes]], ChannelServer, str],
) -> None:
    ctx, server, url = channel
    big = ctx.socket(zmq.DEALER)
    big.setsockopt(zmq.LINGER, 0)
    cut = big.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    big.connect(url)
    blob = b"\x00" * (MAX_MESSAGE_BYTES + 1)
    for _ in range(3):
        big.send_multipart([b"", blob])
    client = ChannelClient(ctx, url)
    try:
        # answered within its own timeout (generous: a hang guard on a loaded machine)
        answer = client.call(p2p_proto.Unlock("peer", []), timeout_s=10)
        assert isinstance(answer, p2p_proto.Unlocked)
        # the sender was cut off at its first size header: its connection dropped, no
        # answer came, and none of its messages reached the handler
        assert cut.poll(10_000, zmq.POLLIN), "the huge sender was not disconnected"
        event = zmq.utils.monitor.recv_monitor_message(cut)
        assert event["event"] == zmq.EVENT_DISCONNECTED, event
        assert big.poll(1000, zmq.POLLIN) == 0
        assert server.requests == 1
    finally:
        client.close()
        big.disable_monitor()
        cut.close(0)
        big.close(0)
