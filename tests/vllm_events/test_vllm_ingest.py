"""vLLM's own `ZmqEventPublisher` publishes real `KVEventBatch`es to the coordinator's
ingest over loopback TCP: a full replay on connect, a forced gap repaired by replay, a
publisher restart (seq backwards), `AllBlocksCleared`, malformed frames; no block lost.

The publisher binds only wildcard endpoints (``_is_bind_endpoint``); the harness subclass
makes it bind 127.0.0.1 too, so nothing listens beyond loopback. Everything else is
vLLM's code."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest
import zmq

from kvatlas.coordinator.vllm.ingest import VllmIngest
from kvatlas.coordinator.vllm.sources import parse_source
from kvatlas.core.vllm_hash import BlockHasher
from kvatlas.launch.procs import free_port
from support.wait import wait_until

kv_events = pytest.importorskip(
    "vllm.distributed.kv_events", reason="vLLM not installed (scripts/bootstrap.sh)"
)
from support.vllm_publish import DroppingPub, LoopbackPublisher  # noqa: E402 (vLLM first)

BLOCK = 16
HASHER = BlockHasher("sha256_cbor", "vllm-none-hash", BLOCK)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _publisher(pub_port: int, replay_port: int, rank: int = 0) -> Any:
    """vLLM's publisher; a restarted one waits while ZeroMQ's I/O thread still releases
    the previous one's ports (`close` is asynchronous)."""
    wait_until(lambda: _free(pub_port + rank) and _free(replay_port + rank), what="the ports")
    return LoopbackPublisher(
        rank,
        endpoint=f"tcp://127.0.0.1:{pub_port}",
        replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
        topic="kv-events",
    )


def _prompt(i: int, blocks: int = 4) -> list[int]:
    return [i * 1000 + t for t in range(blocks * BLOCK)]


def _stored(tokens: list[int], as_int: bool = False, medium: str | None = "GPU") -> Any:
    digests = HASHER.digests(tokens)
    hashes: list[Any] = (
        [int.from_bytes(d, "big") & (2**64 - 1) for d in digests] if as_int else digests
    )
    return kv_events.BlockStored(
        block_hashes=hashes,
        parent_block_hash=None,
        token_ids=tokens,
        block_size=BLOCK,
        lora_id=None,
        medium=medium,
        lora_name=None,
    )


def _batch(*events: Any) -> Any:
    return kv_events.KVEventBatch(ts=time.time(), events=list(events))


def _held(ingest: VllmIngest, engine: str, tokens: list[int]) -> int:
    for hit in ingest.lookup(tokens):
        if hit.engine == engine:
            return hit.tokens
    return 0


@pytest.fixture
def ports() -> tuple[int, int]:
    return _port(), _port()


@pytest.fixture
def ingest_for(ports: tuple[int, int]) -> Iterator[Callable[[str], VllmIngest]]:
    made: list[VllmIngest] = []

    def make(extra: str = "") -> VllmIngest:
        spec = (
            f"e1=tcp://127.0.0.1:{ports[0]},replay=tcp://127.0.0.1:{ports[1]},"
            f"topic=kv-events,block_size={BLOCK},hash=sha256_cbor{extra}"
        )
        ing = VllmIngest(parse_source(spec), replay_timeout_s=1.0, resync_s=0.3)
        made.append(ing)
        ing.start()
        return ing

    yield make
    for ing in made:
        ing.stop()


def test_full_replay_on_connect_then_live(
    ports: tuple[int, int], ingest_for: Callable[[str], VllmIngest]
) -> None:
    pub = _publisher(*ports)
    try:
        # Published before anyone listens: only the replay can deliver these.
        for i in range(5):
            pub.publish(_batch(_stored(_prompt(i), as_int=i % 2 == 1)))
        wait_until(lambda: len(pub._buffer) == 5, what="the publisher to buffer 5 batches")
        ing = ingest_for("")
        wait_until(lambda: ing.stats()["e1"]["last_seq"] == 4, what="the replay of seqs 0-4")
        for i in range(5):
            assert _held(ing, "e1", _prompt(i)) == 4 * BLOCK
        # A prompt sharing the first two blocks only.
        partial = _prompt(0)[: 2 * BLOCK] + _prompt(9)[: 2 * BLOCK]
        assert _held(ing, "e1", partial) == 2 * BLOCK
        pub.publish(
            _batch(
                kv_events.BlockRemoved(block_hashes=HASHER.digests(_prompt(0))[2:], medium="GPU")
            )
        )
        wait_until(lambda: _held(ing, "e1", _prompt(0)) == 2 * BLOCK, what="the removal")
        assert ing.stats()["e1"]["lost"] == 0
    finally:
        pub.shutdown()


def test_forced_gap_repaired_by_replay(
    ports: tuple[int, int], ingest_for: Callable[[str], VllmIngest]
) -> None:
    pub = _publisher(*ports)
    try:
        ing = ingest_for("")
        pub.publish(_batch(_stored(_prompt(0))))
        wait_until(lambda: ing.stats()["e1"]["last_seq"] == 0, what="seq 0")
        pub._pub = DroppingPub(pub._pub, {1, 2, 3})
        for i in range(1, 8):
            pub.publish(_batch(_stored(_prompt(i))))
        wait_until(lambda: ing.stats()["e1"]["last_seq"] == 7, what="seqs up to 7")
        for i in range(8):
            assert _held(ing, "e1", _prompt(i)) == 4 * BLOCK, i
        s = ing.stats()["e1"]
        assert s["lost"] == 0
        assert s["replays"] >= 2  # the one on connect, the gap's
        assert s["blocks_stored"] == 8 * 4
    finally:
        pub.shutdown()


def test_restart_drops_then_replays(
    ports: tuple[int, int], ingest_for: Callable[[str], VllmIngest]
) -> None:
    pub = _publisher(*ports)
    ing = ingest_for("")
    try:
        for i in range(6):
            pub.publish(_batch(_stored(_prompt(i))))
        wait_until(lambda: ing.stats()["e1"]["last_seq"] == 5, what="seqs 0-5")
    finally:
        pub.shutdown()
    # The engine comes back on the same ports: its seq counter starts again at 0.
    pub = _publisher(*ports)
    try:
        # Fewer batches than the first publisher's: whichever of them the subscriber
        # sees live, or none (published before it reconnected), the restart shows (a
        # live seq going back, a replayed seq 0 that differs, an idle check's seq 5 gone).
        fresh = [_prompt(100 + i) for i in range(3)]
        for p in fresh:
            pub.publish(_batch(_stored(p)))
        wait_until(
            lambda: ing.stats()["e1"],
            lambda s: s["restarts"] >= 1 and s["last_seq"] == len(fresh) - 1,
            what="the restart seen and the new stream's seqs 0-2 applied",
        )
        for p in fresh:
            assert _held(ing, "e1", p) == 4 * BLOCK
        for j in range(6):
            assert _held(ing, "e1", _prompt(j)) == 0, "a block of the old incarnation survived"
        assert ing.stats()["e1"]["lost"] == 0
    finally:
        pub.shutdown()


def test_all_blocks_cleared_and_offload_medium(
    ports: tuple[int, int], ingest_for: Callable[[str], VllmIngest]
) -> None:
    pub = _publisher(*ports)
    try:
        ing = ingest_for("")
        cpu = kv_events.BlockStored(
            block_hashes=HASHER.digests(_prompt(7)),
            parent_block_hash=None,
            token_ids=[],
            block_size=BLOCK,
            lora_id=None,
            medium="CPU",
            lora_name=None,
        )
        pub.publish(_batch(_stored(_prompt(1)), cpu, _stored(_prompt(7))))
        wait_until(lambda: ing.stats()["e1"]["last_seq"] == 0, what="seq 0")
        hit = next(h for h in ing.lookup(_prompt(7)) if h.engine == "e1")
        # The CPU copy came first, without token ids: the GPU store's chain keys it too.
        assert hit.tokens == 4 * BLOCK and hit.media == ["GPU"] and hit.tiers == [4, 0, 0]
        gone = kv_events.BlockRemoved(block_hashes=HASHER.digests(_prompt(7)), medium="GPU")
        pub.publish(_batch(gone))
        wait_until(lambda: ing.stats()["e1"]["last_seq"] == 1, what="seq 1")
        hit = next(h for h in ing.lookup(_prompt(7)) if h.engine == "e1")
        assert hit.tokens == 4 * BLOCK and hit.media == ["CPU"] and hit.tiers == [0, 4, 0]
        pub.publish(_batch(kv_events.AllBlocksCleared()))
        wait_until(lambda: ing.stats()["e1"]["blocks"] == 0, what="the clear")
        assert _held(ing, "e1", _prompt(1)) == 0
        assert ing.stats()["e1"]["cleared"] == 1
    finally:
        pub.shutdown()


def test_malformed_frames_and_unknown_events_are_skipped_and_counted(
    ports: tuple[int, int], ingest_for: Callable[[str], VllmIngest]
) -> None:
    ctx = zmq.Context()
    # An XPUB: the subscriber's subscription is observable (it reads it back).
    pubsock = ctx.socket(zmq.XPUB)
    pubsock.bind(f"tcp://127.0.0.1:{ports[0]}")
    try:
        ing = ingest_for("")
        ing_no = ing.stats()["e1"]
        assert ing_no["last_seq"] == -1
        enc = msgspec.msgpack.Encoder()
        good_old = ["BlockStored", HASHER.digests(_prompt(3)), None, _prompt(3), BLOCK, None, "GPU"]
        newer = {
            "type": "BlockStored",
            "block_hashes": HASHER.digests(_prompt(4)),
            "token_ids": _prompt(4),
            "block_size": BLOCK,
            "shiny_new_field": 1,
        }
        messages = [
            [b"kv-events", b"\x00" * 3, b"x"],  # short seq frame
            [b"kv-events", (0).to_bytes(8, "big"), b"\xc1"],  # not msgpack
            [b"kv-events", (0).to_bytes(8, "big")],  # two frames
            [
                b"kv-events",
                (0).to_bytes(8, "big"),
                enc.encode(
                    [
                        1.0,
                        [
                            good_old,
                            newer,
                            ["SomeFutureEvent", 1],
                            {"type": "BlockRemoved", "block_hashes": "nope"},
                            7,
                        ],
                    ]
                ),
            ],
        ]
        # The subscription has reached the PUB socket (nothing published before it is
        # delivered); no replay socket answers, so the ingest gives up on its replay.
        wait_until(
            lambda: pubsock.poll(0) and pubsock.recv(),
            lambda frame: frame == b"\x01kv-events",
            what="the subscriber's subscription to kv-events",
        )
        for m in messages:
            pubsock.send_multipart(m)
        wait_until(lambda: ing.stats()["e1"]["last_seq"] == 0, what="seq 0")
        s = ing.stats()["e1"]
        assert s["last_seq"] == 0
        assert s["malformed_messages"] >= 3
        assert s["unknown_types"] == 1 and s["malformed_events"] == 2 and s["unknown_fields"] == 1
        assert _held(ing, "e1", _prompt(3)) == 4 * BLOCK
        assert _held(ing, "e1", _prompt(4)) == 4 * BLOCK
    finally:
        pubsock.close(linger=0)
        ctx.term()


def _two_free_ports() -> int:
    """A port free with the next one (rank 1's offset), below the ephemeral range so no
    outgoing connection takes either meanwhile."""
    return wait_until(free_port, lambda p: _free(p + 1), what="two free ports")


def test_data_parallel_ranks_offset_ports(ingest_for: Callable[[str], VllmIngest]) -> None:
    base_pub = _two_free_ports()
    base_replay = wait_until(
        _two_free_ports, lambda p: abs(p - base_pub) > 1, what="a second pair of ports"
    )
    sources = parse_source(
        f"e=tcp://127.0.0.1:{base_pub},replay=tcp://127.0.0.1:{base_replay},dp_size=2,"
        f"topic=kv-events,block_size={BLOCK},hash=sha256_cbor"
    )
    assert [s.engine for s in sources] == ["e/dp0", "e/dp1"]
    pubs = [_publisher(base_pub, base_replay, rank) for rank in (0, 1)]
    ing = VllmIngest(sources, replay_timeout_s=1.0, resync_s=0.3)
    ing.start()
    try:
        pubs[1].publish(_batch(_stored(_prompt(11))))
        pubs[0].publish(_batch(_stored(_prompt(10))))
        wait_until(lambda: all(s["last_seq"] == 0 for s in ing.stats().values()), what="both ranks")
        assert _held(ing, "e/dp1", _prompt(11)) == 4 * BLOCK
        assert _held(ing, "e/dp0", _prompt(11)) == 0
        assert ing.lookup(_prompt(10))[0].engine == "e/dp0"
    finally:
        ing.stop()
        for p in pubs:
            p.shutdown()
