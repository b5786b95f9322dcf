"""A peer of the next version (N+1) against today's server: every request is answered at
once, never hung or dropped. A version the server does not answer in gets a ``version``
error naming its range; an operation it does not know gets ``unknown_operation`` (in the
request's version: ``invalid_input`` to version 1, whose decoder knows no other code);
fields it does not know are skipped. Both refusals are counted; the skipped fields are
not (msgspec skips them without telling, and finding them would take a second decode of
every request). The client moves to the server's version once and keeps it.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
import zmq

from kvatlas.connector.client import CacheClient, RequestRefused
from kvatlas.launch.procs import HOST
from kvatlas.server.p2p.channel import ChannelClient, ChannelError
from kvatlas.wire import engine_proto, p2p_proto
from upgrade.peers import FakeService, ask, channel_server, engine_api

NEXT = p2p_proto.P2P_PROTOCOL_VERSION + 1


def hello(body: p2p_proto.P2PRequestBody) -> p2p_proto.P2PResponseBody:
    assert isinstance(body, p2p_proto.Hello)
    return p2p_proto.HelloReply("owner", 7, {})


def p2p_ask(url: str, msg: dict[str, Any]) -> p2p_proto.P2PResponse:
    return p2p_proto.decode_response(ask(url, msgspec.msgpack.encode(msg)))


def test_p2p_owner_answers_a_newer_requester_at_once_and_counts() -> None:
    current = p2p_proto.P2P_PROTOCOL_VERSION
    with channel_server(hello) as server:
        url = server.endpoint
        # a version it does not answer in: its range, in a version 1 decoder reads too
        r = p2p_ask(url, {"v": NEXT, "id": 1, "body": {"type": "hello", "requester": "n"}})
        assert r.id == 1 and isinstance(r.body, p2p_proto.P2PError)
        assert (r.body.code, r.body.min_v, r.body.max_v) == ("version", current - 1, current)
        # an operation of the future, with fields of the future
        pin = {"type": "pin_chunks", "requester": "n", "hashes": [b"x" * 32], "ttl_s": 5}
        r = p2p_ask(url, {"v": current, "id": 2, "body": pin, "trace": "t"})
        assert r.id == 2 and r.v == current and isinstance(r.body, p2p_proto.P2PError)
        assert r.body.code == "unknown_operation" and "pin_chunks" in r.body.message
        r = p2p_ask(url, {"v": 1, "id": 3, "body": pin})
        assert r.v == 1 and isinstance(r.body, p2p_proto.P2PError)
        assert r.body.code == "invalid_input"
        # a known operation with fields of the future: they are skipped
        future_hello = {"type": "hello", "requester": "n", "token": "", "priority": 9}
        r = p2p_ask(url, {"v": current, "id": 4, "body": future_hello, "trace": "t"})
        assert r.body == p2p_proto.HelloReply("owner", 7, {})
        # garbage is answered too, not dropped
        r = p2p_proto.decode_response(ask(url, b"\xc1 not msgpack"))
        assert isinstance(r.body, p2p_proto.P2PError)
        assert server.unknown == {"version": 1, "operation": 2}


def test_p2p_requester_meets_a_newer_owner_in_the_common_version() -> None:
    """An owner of N+1 that still answers N: the requester never has to move. One that
    answers only N+1 and N+2: refused, with both ranges in the reason."""
    newer = p2p_proto.P2PError("version", "too old", NEXT, NEXT + 1)

    def newer_only(self: Any, handler: Any, payload: bytes) -> p2p_proto.P2PResponse:
        self.errors += 1
        return p2p_proto.P2PResponse(NEXT, p2p_proto.decode_envelope(payload).id, newer)

    with channel_server(hello, answer=newer_only) as server:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        client = ChannelClient(ctx, server.endpoint)
        try:
            with pytest.raises(ChannelError, match="refused: version") as err:
                client.call(p2p_proto.Hello("n"), 5.0)
            assert err.value.cause == "refused"
            assert client.version == p2p_proto.P2P_PROTOCOL_VERSION and server.errors == 1
        finally:
            client.close()
            ctx.term()


def engine_ask(url: str, msg: dict[str, Any]) -> engine_proto.Response:
    return engine_proto.decode_response(ask(url, msgspec.msgpack.encode(msg)))


def test_engine_api_answers_a_newer_engine_at_once_and_counts() -> None:
    current = engine_proto.PROTOCOL_VERSION
    service = FakeService()
    with engine_api(service) as api:
        url = f"tcp://{HOST}:{api.bound_port}"
        r = engine_ask(url, {"v": NEXT, "id": 1, "body": {"type": "stats"}})
        assert isinstance(r.body, engine_proto.ErrorReply) and r.id == 1
        assert (r.body.code, r.body.min_v, r.body.max_v) == ("version", current - 1, current)
        prefetch = {"type": "prefetch", "ns": {"model_name": "m", "kv_rank": 0}, "hint": 3}
        r = engine_ask(url, {"v": current, "id": 2, "body": prefetch, "token": ""})
        assert isinstance(r.body, engine_proto.ErrorReply) and r.v == current
        assert r.body.code == "unknown_operation" and "prefetch" in r.body.message
        r = engine_ask(url, {"v": 1, "id": 3, "body": prefetch})
        assert isinstance(r.body, engine_proto.ErrorReply) and r.body.code == "invalid_input"
        # a known operation with fields of the future: served, the fields skipped
        r = engine_ask(url, {"v": current, "id": 4, "body": {"type": "stats", "since": 1}, "x": 1})
        assert r.body == engine_proto.StatsResult({"served": 1}) and r.v == current
        assert dict(api.stats().unknown) == {"version": 1, "operation": 2}
        assert service.asked == [engine_proto.GetStats()]  # nothing else reached it


def test_todays_engine_talks_to_a_newer_server_that_answers_its_version() -> None:
    """A server of N+1 answers N+1 and N: today's client (N) is answered in N at once."""
    with (
        engine_api(FakeService()) as api,
        CacheClient(f"tcp://{HOST}:{api.bound_port}", timeout_s=5) as client,
    ):
        assert client.stats() == {"served": 1} and client.version == engine_proto.PROTOCOL_VERSION

    def newer_only(self: Any, data: memoryview) -> bytes:
        env = engine_proto.decode_envelope(data)
        body = engine_proto.ErrorReply("version", "too old", NEXT, NEXT + 1)
        return engine_proto.encode(engine_proto.Response(NEXT, env.id, body))

    with (
        engine_api(FakeService(), newer_only) as api,
        CacheClient(f"tcp://{HOST}:{api.bound_port}", timeout_s=5) as client,
        pytest.raises(RequestRefused, match="version"),
    ):
        client.stats()
