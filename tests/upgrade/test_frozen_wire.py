"""Today's code against the first release's wire (`support.frozen_wire_v1`), part by part.

Each wire both ways: what a version 1 peer sends is read and answered in version 1 (its
frozen decoder reads the answer), and what today's code sends a version 1 peer is what
that peer reads. The whole fleet is `test_mixed_fleet`; a newer peer is
`test_future_peer`.
"""

from __future__ import annotations

from collections.abc import Iterator

import msgspec
import pytest
import zmq

from kvatlas.connector.client import CacheClient
from kvatlas.core.events import Entry, EventBatch, KeyBlock
from kvatlas.core.keys import Namespace, ObjectKey
from kvatlas.core.types import ChunkHash, EventType, Incarnation, InstanceId, Tier
from kvatlas.launch.procs import HOST
from kvatlas.server.p2p.channel import ChannelClient
from kvatlas.transfer import tcp
from kvatlas.transfer.base import Endpoint
from kvatlas.wire import engine_proto, p2p_proto
from kvatlas.wire.events_api import decode_events, encode_events_msgpack
from kvatlas.wire.http_api import MSGPACK_CONTENT_TYPE
from kvatlas.wire.kafka_records import decode_record, encode_batch_msgpack
from kvatlas.wire.versions import VersionRange
from support.frozen_wire_v1 import engine_proto as v1_engine
from support.frozen_wire_v1 import events as v1_events
from support.frozen_wire_v1 import p2p_proto as v1_p2p
from support.frozen_wire_v1 import shapes as v1
from support.frozen_wire_v1 import tcp_frame as v1_tcp
from upgrade import v1_behaviour
from upgrade.peers import FakeService, ask, channel_server, engine_api

H = ChunkHash(bytes(range(32)))
NS = Namespace("m", 0)


# ---- P2P control ----------------------------------------------------------------------


def p2p_handler(body: p2p_proto.P2PRequestBody) -> p2p_proto.P2PResponseBody:
    if isinstance(body, p2p_proto.Hello):
        return p2p_proto.HelloReply("owner", 7, {"transport": "tcp"})
    if isinstance(body, p2p_proto.LookupAndLock):
        chunks = [
            p2p_proto.LockedChunk(h, 4096 * i, 4096, 99, i + 1) for i, h in enumerate(body.hashes)
        ]
        return p2p_proto.Locked("owner", 7, chunks)
    assert isinstance(body, p2p_proto.Unlock)
    return p2p_proto.Unlocked(len(body.lease_ids))


def test_a_v1_requester_is_answered_in_v1_by_todays_owner() -> None:
    with channel_server(p2p_handler) as server:
        requests: list[v1_p2p.P2PRequestBody] = [
            v1_p2p.Hello("old", "t"),
            v1_p2p.LookupAndLock("old", v1.Namespace("m", 0), [v1.ChunkHash(H)], 2.0),
            v1_p2p.Unlock("old", [1, 2]),
        ]
        answers = [
            v1_p2p.decode_response(ask(server.endpoint, v1_p2p.encode(v1_p2p.P2PRequest(1, i, r))))
            for i, r in enumerate(requests)
        ]
    assert [a.v for a in answers] == [1, 1, 1]
    hello, locked, unlocked = (a.body for a in answers)
    assert hello == v1_p2p.HelloReply("owner", 7, {"transport": "tcp"})
    assert locked == v1_p2p.Locked("owner", 7, [v1_p2p.LockedChunk(H, 0, 4096, 99, 1)])
    assert unlocked == v1_p2p.Unlocked(2)
    assert server.unknown == {"version": 0, "operation": 0}


def v1_owner_handler(body: v1_p2p.P2PRequestBody) -> v1_p2p.P2PResponseBody:
    assert isinstance(body, v1_p2p.Hello)
    return v1_p2p.HelloReply("old-owner", 3, {"transport": "tcp"})


def test_todays_requester_moves_to_v1_for_a_first_release_owner_and_keeps_it() -> None:
    """The owner answers exactly as the first release did: a bare ``version`` error."""
    with channel_server(v1_owner_handler, answer=v1_behaviour.channel_answer) as server:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        client = ChannelClient(ctx, server.endpoint)
        try:
            for _ in range(3):
                got = client.call(p2p_proto.Hello("new"), 5.0)
                assert got == p2p_proto.HelloReply("old-owner", 3, {"transport": "tcp"})
            # one refusal in all: the client asked in 1 from then on
            assert (client.version, client.version_moves, server.errors) == (1, 1, 1)
        finally:
            client.close()
            ctx.term()


# ---- engine API ----------------------------------------------------------------------


def test_a_v1_engine_is_answered_in_v1_by_todays_server() -> None:
    with engine_api(FakeService()) as api:
        raw = ask(
            f"tcp://{HOST}:{api.bound_port}",
            v1_engine.encode(v1_engine.Request(1, 5, v1_engine.GetStats())),
        )
    resp = v1_engine.decode_response(raw)
    assert (resp.v, resp.id, resp.body) == (1, 5, v1_engine.StatsResult({"served": 1}))


def test_todays_engine_moves_to_v1_for_a_first_release_server() -> None:
    with (
        engine_api(
            FakeService(v1_engine.StatsResult({"old": 1})), v1_behaviour.engine_answer
        ) as api,
        CacheClient(f"tcp://{HOST}:{api.bound_port}", timeout_s=5) as client,
    ):
        assert client.stats() == {"old": 1}
        assert client.stats() == {"old": 1}
        assert client.version == 1


# ---- events and Kafka records --------------------------------------------------------


def batches() -> Iterator[tuple[v1.EventBatch, EventBatch]]:
    """The same batches in the frozen shapes and in today's."""
    v1_key = v1.ObjectKey(H, "m", 0)
    key = ObjectKey(H, "m", 0)
    yield (
        v1.EventBatch(
            v1.InstanceId("old"), 5, 1, "store", "l1", (v1.Entry(v1_key, 10, (1, 2), 0),)
        ),
        EventBatch(
            InstanceId("old"),
            Incarnation(5),
            1,
            EventType.STORE,
            Tier.L1,
            (Entry(key, 10, (1, 2), 0),),
        ),
    )
    yield (
        v1.EventBatch(
            v1.InstanceId("old"),
            5,
            2,
            "store",
            "l1",
            (),
            block=v1.KeyBlock(v1.Namespace("m", 0), H * 2, (3, 4)),
        ),
        EventBatch(
            InstanceId("old"),
            Incarnation(5),
            2,
            EventType.STORE,
            Tier.L1,
            (),
            block=KeyBlock(NS, H * 2, (3, 4)),
        ),
    )
    yield (
        v1.EventBatch(
            v1.InstanceId("old"),
            5,
            3,
            "config",
            "l2",
            (),
            backend="disk",
            capacity_bytes=9,
            capacity_revision=1,
        ),
        EventBatch(
            InstanceId("old"),
            Incarnation(5),
            3,
            EventType.CONFIG,
            Tier.L2,
            (),
            backend="disk",
            capacity_bytes=9,
            capacity_revision=1,
        ),
    )


def test_first_release_event_bodies_and_records_decode_today() -> None:
    old, new = zip(*batches(), strict=True)
    got = decode_events(v1_events.encode_events_msgpack(list(old)), MSGPACK_CONTENT_TYPE, 100)
    assert got == list(new)
    json_old = [b for b in old if b.block is None]
    json_new = [b for b in new if b.block is None]
    assert (
        decode_events(v1_events.encode_events_json(json_old), "application/json", 100) == json_new
    )
    for o, n in zip(old, new, strict=True):
        assert decode_record(v1_events.encode_batch_msgpack(o), 100) == [n]


def test_todays_event_bodies_and_records_decode_in_the_first_release() -> None:
    old, new = zip(*batches(), strict=True)
    body = msgspec.msgpack.decode(encode_events_msgpack(list(new)), type=v1_events.CompactEvents)
    assert body.batches == list(old) and body.version == 2
    for o, n in zip(old, new, strict=True):  # the record's ``v`` is a field it skips
        assert msgspec.msgpack.decode(encode_batch_msgpack(n), type=v1.EventBatch) == o


# ---- tcp data plane ------------------------------------------------------------------


def test_tcp_requests_of_version_1_are_the_first_releases_bytes() -> None:
    new = tcp._request("b", "t", "7", 4096, 512, v=1)
    assert new == v1_tcp.encode(v1_tcp.Request("b", "t", "7", 4096, 512))
    assert tcp._decode(new).v == 1
    # a newer requester's trailing element is skipped by a first-release owner
    newer = tcp._request("b", "t", "7", 4096, 512, v=2)
    assert tcp._decode(newer).v == 2
    assert v1_tcp.decode(newer) == v1_tcp.Request("b", "t", "7", 4096, 512)


def test_an_endpoint_without_versions_is_read_as_the_first_release() -> None:
    bare = Endpoint(transport="tcp", url="tcp://127.0.0.1:9", region_size=1 << 20)
    assert tcp.advertised_versions(bare) == VersionRange(1, 1)
    later = Endpoint(
        transport="tcp", url="tcp://127.0.0.1:9", region_size=1, extra={"wire_versions": "3-4"}
    )
    assert tcp.advertised_versions(later) == VersionRange(3, 4)


@pytest.mark.parametrize(
    "versions", [p2p_proto.P2P_VERSIONS, engine_proto.ENGINE_VERSIONS, tcp.TCP_VERSIONS]
)
def test_the_versions_follow_the_house_rule(versions: VersionRange) -> None:
    assert versions.lo == max(1, versions.hi - 1)
