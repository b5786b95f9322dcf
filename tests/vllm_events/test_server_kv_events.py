"""``kvatlas server --kv-events-endpoint``: a real server process publishes its L1/L2 as
vLLM KV events, each chunk as the engine blocks it holds, hashed as vLLM hashes them. A
real coordinator's ``--vllm-kv-events`` ingest (joining late: its connect replay fills
what it missed) holds exactly the server's blocks per medium across stores, demotion to
L2, deletes, clears and a restart, and its lookups by token ids find them; vLLM's own
msgspec decoder (``KVEventBatch``) reads every published and replayed payload; the
block hashes equal those vLLM 0.34 itself computes and publishes for the same tokens
(its default algorithm and seed, salted or not); a chunk whose tokens no prompt showed
is withheld until one does; a full queue drops changes without blocking the store,
counts them, clears and resyncs; a batch lost on the wire is repaired from the replay
socket. NVIDIA Dynamo's own indexer reading a server: tests/dynamo/."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import zmq

from kvatlas.cli.server import build_parser, config_from_args
from kvatlas.connector.client import CacheClient
from kvatlas.coordinator.vllm.ingest import VllmIngest
from kvatlas.coordinator.vllm.sources import parse_sources
from kvatlas.core.device_blocks import MEDIA, BlockKey, EngineId, medium_bit
from kvatlas.core.errors import ConfigError, InvalidInput
from kvatlas.core.events import Entry
from kvatlas.core.keys import ObjectKey, chunk_hashes
from kvatlas.core.types import EventType, InstanceId, Tier
from kvatlas.core.vllm_hash import BlockHasher
from kvatlas.server.config import KvEventsConfig, ServerConfig
from kvatlas.server.kv_blocks import ChunkBlocks
from kvatlas.server.kv_events import KvEventsCollector, KvEventsPublisher
from kvatlas.wire.vllm_events import (
    END_SEQ,
    RemovedOut,
    StoredOut,
    encode_batch,
    replay_request,
)
from support.cache_fleet import CHUNK, L1_GB, MODEL, data, prompt
from support.coordinator import RunningCoordinator
from support.services import ServerProc, start_server_process
from support.wait import wait_until

from .test_vllm_ingest import _port

kv_events = pytest.importorskip(
    "vllm.distributed.kv_events", reason="vLLM not installed (scripts/bootstrap.sh)"
)
from vllm.config.cache import CacheConfig  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core import kv_cache_utils as kcu  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from support.vllm_publish import DroppingPub  # noqa: E402 (vLLM first)

CPU = medium_bit("CPU")
STORAGE = medium_bit("STORAGE")
assert MEDIA[1:] == ("CPU", "STORAGE")
L1, L2, STORE, DELETE = Tier.L1, Tier.L2, EventType.STORE, EventType.DELETE


def _start(tmp: Path, pub: int, replay: int, *extra: str) -> ServerProc:
    return start_server_process(
        tmp, "node-s",
        "--l1-size-gb", L1_GB, "--chunk-size", str(CHUNK),
        "--l2-path", str(tmp / "l2"), "--l2-size-gb", "0.05",
        "--kv-events-endpoint", f"tcp://127.0.0.1:{pub}",
        "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{replay}",
        "--kv-events-topic", "kv", *extra,
    )  # fmt: skip


def _client(s: ServerProc) -> CacheClient:
    c = CacheClient(s.engine_url, timeout_s=10, engine_id="eng")
    c.register(MODEL, "float16", (2, 2, 8), chunk_size=CHUNK)
    return c


def _show_and_store(engine: CacheClient, tokens: list[int], seed: int) -> None:
    """What kvatlas' connector does: a lookup by token ids (which shows the server the
    prompt's tokens), then a store of its chunks."""
    engine.lookup(tokens)
    chunks = len(tokens) // CHUNK
    assert engine.store_chunks(tokens, data(chunks, seed)).stored == chunks


class VllmReader:
    """A SUB socket whose every payload is decoded by vLLM's own ``KVEventBatch``."""

    def __init__(self, pub: int) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        self.sub.connect(f"tcp://127.0.0.1:{pub}")
        self.batches: list[tuple[int, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.sub.poll(50):
                topic, seq, payload = self.sub.recv_multipart()
                assert topic == b"kv"
                batch = msgspec.msgpack.decode(payload, type=kv_events.KVEventBatch)
                self.batches.append((int.from_bytes(seq, "big"), batch))

    def events(self, replay: int | None = None) -> list[Any]:
        """The events received, in order; with ``replay`` (the replay port) the batches
        sent before the subscription took are asked for first, as a vLLM subscriber that
        joins late does (a SUB socket misses what is published while it connects)."""
        got = list(self.batches)
        first = got[0][0] if got else None
        if replay is not None and first != 0:
            missed = [(s, b) for s, b in _replay(replay, 0) if first is None or s < first]
            got = missed + got
        return [e for _, b in got for e in b.events]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sub.close(linger=0)
        self.ctx.term()


def _replay(port: int, start: int) -> list[tuple[int, Any]]:
    """vLLM's replay request, each reply decoded by vLLM's own decoder."""
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    dealer.send_multipart(replay_request(start))
    out: list[tuple[int, Any]] = []
    try:
        while True:
            assert dealer.poll(10_000), "no replay answer"
            _, topic, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ:
                return out
            assert topic == b"kv"
            out.append(
                (
                    int.from_bytes(seq, "big"),
                    msgspec.msgpack.decode(payload, type=kv_events.KVEventBatch),
                )
            )
    finally:
        dealer.close(linger=0)
        ctx.term()


@pytest.fixture
def ports() -> tuple[int, int]:
    return _port(), _port()


@pytest.fixture
def server(tmp_path: Path, ports: tuple[int, int]) -> Iterator[ServerProc]:
    s = _start(tmp_path, *ports)
    yield s
    s.stop()


def test_server_tiers_reach_the_coordinator_and_vllm_decodes_them(
    tmp_path: Path,
    server: ServerProc,
    ports: tuple[int, int],
    start_coordinator: Callable[..., RunningCoordinator],
) -> None:
    reader = VllmReader(ports[0])
    engine = _client(server)
    try:
        first = prompt(3, seed=1)
        _show_and_store(engine, first, seed=1)
        hashes = engine.hashes(first)
        # chunks of 16 tokens, blocks of 16 (the default --kv-events-block-size): one
        # block per chunk, hashed as a vLLM engine with its defaults hashes it
        keys = BlockHasher().keys(first)
        assert len(keys) == 3
        spec = f"node-s=tcp://127.0.0.1:{ports[0]},replay=tcp://127.0.0.1:{ports[1]},topic=kv"
        rc = start_coordinator(vllm_kv_events=parse_sources([spec]))
        ingest = rc.coordinator.vllm
        assert ingest is not None

        def blocks() -> dict[BlockKey, int]:
            with ingest.lock:
                return ingest.index.blocks(ingest.sources[0].engine)

        # stored before the coordinator subscribed: the connect replay brings them
        wait_until(lambda: blocks() == dict.fromkeys(keys, CPU), what="the first chunks in L1")
        # the coordinator's lookups by token ids (vLLM's hashing) find them
        hits = ingest.lookup(first)
        assert [(h.engine, h.tokens, h.media) for h in hits] == [("node-s", 3 * CHUNK, ["CPU"])]
        # L1 holds 16 chunks: 16 more demote the first three to L2
        _show_and_store(engine, prompt(16, seed=2), seed=2)
        wait_until(
            lambda: (
                all(blocks().get(k) == STORAGE for k in keys)
                and sum(m == CPU for m in blocks().values()) == 16
            ),
            what="demotion to L2",
        )
        r = httpx.request(
            "DELETE", server.url + "/cache/objects", json={"keys": _wire_keys(hashes)}, timeout=10
        )
        assert r.status_code == 200 and r.json()["deleted"] == 3, r.text
        wait_until(lambda: not any(k in blocks() for k in keys), what="the deleted chunks gone")
        assert httpx.post(server.url + "/cache/clear", timeout=10).status_code == 200
        wait_until(lambda: blocks() == {}, what="L1 cleared")

        # vLLM's decoder: the stream opens with AllBlocksCleared, media are vLLM's names,
        # block hashes vLLM's ints, each block with its tokens and its parent
        wait_until(lambda: len(reader.events(ports[1])) >= 4, what="the reader's batches")
        live = reader.events(ports[1])
        stored = [e for e in live if isinstance(e, kv_events.BlockStored)]
        assert stored[0].block_hashes == keys and stored[0].medium == "CPU"
        assert stored[0].parent_block_hash is None
        assert stored[0].block_size == 16 and stored[0].token_ids == first[: 3 * CHUNK]
        assert any(e.medium == "STORAGE" for e in stored)
        assert {e.medium for e in live if isinstance(e, kv_events.BlockRemoved)} >= {"CPU"}
        everything = _replay(ports[1], 0)
        assert [s for s, _ in everything] == list(range(len(everything)))
        assert isinstance(everything[0][1].events[0], kv_events.AllBlocksCleared)
        assert [s for s, _ in _replay(ports[1], 3)] == list(range(3, len(everything)))

        # a restart: seq 0 again, AllBlocksCleared, and the chunks L2 kept withheld (the
        # new process has seen no prompt with their tokens) until a lookup shows them
        second = prompt(2, seed=3)
        _show_and_store(engine, second, seed=3)
        _show_and_store(engine, prompt(16, seed=4), seed=4)  # pushes them into L2
        second_keys = BlockHasher().keys(second)
        wait_until(lambda: all(blocks().get(k) == STORAGE for k in second_keys), what="them in L2")
        engine.close()
        assert server.stop() == 0, server.tail()
        # L1 restarts cold here: what is checked is L2's chunks, found again on disk
        # (tests/server/test_warm_restart.py covers an L1 kept across the restart)
        restarted = _start(tmp_path, *ports, "--no-l1-warm-restart")
        try:
            wait_until(
                lambda: ingest.stats()["node-s"]["restarts"] >= 1 and blocks() == {},
                what="the restarted server's stream, L2 withheld",
                timeout=60,
            )
            wait_until(
                restarted.metrics,
                lambda m: (
                    'kvatlas_server_kv_events_unpublished_chunks{instance_id="node-s"} 2.0' in m
                ),
                what="two chunks unpublished",
            )
            assert (
                'kvatlas_server_kv_events_cleared_total{instance_id="node-s"} 1.0'
                in restarted.metrics()
            )
            again = _client(restarted)
            again.lookup(second)  # shows their tokens (and brings them back into L1)
            wait_until(
                lambda: (
                    set(blocks()) == set(second_keys)
                    and all(m & STORAGE for m in blocks().values())
                ),
                what="the L2 chunks published once shown",
            )
            again.close()
        finally:
            restarted.stop()
        assert ingest.stats()["node-s"]["lost"] == 0
    finally:
        reader.close()


def _wire_keys(hashes: Sequence[bytes]) -> list[dict[str, Any]]:
    return [
        {"chunk_hash_hex": h.hex(), "model_name": MODEL, "kv_rank": 16777472, "cache_salt": ""}
        for h in hashes
    ]


def test_a_full_queue_drops_counts_clears_and_resyncs(ports: tuple[int, int]) -> None:
    resyncs: list[float] = []
    pub = KvEventsPublisher(
        KvEventsConfig(endpoint=f"tcp://127.0.0.1:{ports[0]}", max_queue=2),
        CHUNK,
        on_loss=lambda: resyncs.append(time.monotonic()),
    )
    tokens = prompt(5, seed=7)
    hashes = chunk_hashes(tokens, CHUNK)
    pub.learn_prompt(tokens, hashes)  # its chunks are published with their tokens
    keys = [ObjectKey(h, MODEL, 0) for h in hashes]
    t0 = time.monotonic()
    for i, k in enumerate(keys):  # the thread is not running: the queue fills at once
        pub.publish(EventType.STORE, Tier.L1, [Entry(k, 1)])
        # never waits for room (nothing makes any: it would wait forever): a change
        # that does not fit is dropped, and counted, by the call itself
        assert (pub.stats().queued, pub.stats().dropped_changes) == (min(i + 1, 2), max(0, i - 1))
    pub.publish(EventType.ACCESS, Tier.L1, [Entry(keys[0], 1)])  # not an event vLLM has
    assert time.monotonic() - t0 < 5.0  # generous, for a loaded machine
    assert pub.stats().dropped_changes == 3 and pub.stats().queued == 2
    pub.start()
    try:
        wait_until(lambda: bool(resyncs) and pub.stats().queued == 0, what="the resync")
        s = pub.stats()
        assert s.cleared == 2  # the stream's start, and after the drop
        assert s.blocks == 2 and s.blocks_stored == 2
        text = "".join(
            f"{m.name} {m.samples[0].value}\n" for m in KvEventsCollector("n", pub.stats).collect()
        )
        assert "kvatlas_server_kv_events_dropped_changes 3" in text
        # one chunk hash under two keys is one block, held while either is
        twin = ObjectKey(keys[0].chunk_hash, MODEL, 1)
        pub.publish(EventType.STORE, Tier.L1, [Entry(twin, 1)])
        pub.publish(EventType.DELETE, Tier.L1, [Entry(keys[0], 1)])
        # a change after it (once the two-change queue has room), whose block shows
        # when the thread has handled both in order
        wait_until(lambda: pub.stats().queued == 0, what="room in the queue")
        pub.publish(EventType.STORE, Tier.L1, [Entry(keys[2], 1)])
        wait_until(lambda: pub.stats().blocks_stored == 3, what="the delete handled")
        assert pub.stats().blocks_removed == 0
        pub.publish(EventType.DELETE, Tier.L1, [Entry(twin, 1)])
        wait_until(lambda: pub.stats().blocks_removed == 1, what="the block removed")
    finally:
        pub.stop()


def test_bad_flags_name_the_flag() -> None:
    on = "tcp://h:1"
    for cfg, reason in (
        (KvEventsConfig(endpoint="127.0.0.1:5557"), "--kv-events-endpoint must be tcp://"),
        (KvEventsConfig(replay_endpoint=on), "needs --kv-events-endpoint"),
        (KvEventsConfig(endpoint=on, replay_endpoint=on), "must differ"),
        (KvEventsConfig(endpoint=on, buffer_steps=0), "--kv-events-buffer-steps"),
        (KvEventsConfig(endpoint=on, block_size=48), "--kv-events-block-size 48 must divide"),
        (KvEventsConfig(endpoint=on, block_size=0), "--kv-events-block-size must be >= 1"),
        (KvEventsConfig(endpoint=on, hash_algo="md5"), "--kv-events-hash-algo must be one of"),
        (KvEventsConfig(endpoint=on, prompt_tokens=-1), "--kv-events-prompt-tokens"),
    ):
        with pytest.raises(ConfigError, match=reason):
            ServerConfig(instance_id=InstanceId("x"), kv_events=cfg).validate()
    # the engines' block size must divide the chunk size only when events are on
    ServerConfig(instance_id=InstanceId("x"), kv_events=KvEventsConfig(block_size=48)).validate()
    args = build_parser().parse_args(
        ["--instance-id", "x", "--chunk-size", "100", "--kv-events-endpoint", on]
    )
    with pytest.raises(ConfigError, match="--kv-events-block-size 16 must divide --chunk-size 100"):
        config_from_args(args, {})


def test_a_batch_lost_on_the_wire_is_replayed(ports: tuple[int, int]) -> None:
    """Our publisher's replay socket repairs a gap for our own subscriber: seq 2 never
    reaches the SUB socket (it stays in the replay buffer), nothing is lost."""
    pub = KvEventsPublisher(
        KvEventsConfig(
            endpoint=f"tcp://127.0.0.1:{ports[0]}", replay_endpoint=f"tcp://127.0.0.1:{ports[1]}"
        ),
        CHUNK,
    )
    pub.start()
    spec = f"srv=tcp://127.0.0.1:{ports[0]},replay=tcp://127.0.0.1:{ports[1]}"
    ingest = VllmIngest(parse_sources([spec]), replay_timeout_s=2.0, resync_s=0.3)
    ingest.start()
    try:
        wait_until(lambda: ingest.stats()["srv"]["last_seq"] == 0, what="the stream's first batch")
        assert pub._pub is not None
        pub._pub = DroppingPub(pub._pub, {2})  # type: ignore[assignment]
        tokens = prompt(4, seed=5)
        pub.learn_prompt(tokens, chunk_hashes(tokens, CHUNK))
        keys = [ObjectKey(h, MODEL, 0) for h in chunk_hashes(tokens, CHUNK)]
        for k in keys:
            sent = pub.stats().batches
            pub.publish(EventType.STORE, Tier.L1, [Entry(k, 1)])
            wait_until(lambda: pub.stats().batches > sent, what="one batch each")  # noqa: B023
        pub.publish(EventType.DELETE, Tier.L1, [Entry(keys[0], 1)])
        want = dict.fromkeys(BlockHasher().keys(tokens)[1:], CPU)

        def held() -> dict[BlockKey, int]:
            with ingest.lock:
                return ingest.index.blocks(EngineId("srv"))

        wait_until(lambda: held() == want, what="every change, the gap repaired")
        s = ingest.stats()["srv"]
        assert s["lost"] == 0 and s["replays"] >= 2 and s["last_seq"] == pub.stats().last_seq
    finally:
        ingest.stop()
        pub.stop()


@pytest.mark.parametrize("salt", [None, "tenant-7"])
def test_published_blocks_are_the_ones_vllm_publishes(
    salt: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """For the same tokens, a server with every flag at its default (64-token chunks
    here) publishes the blocks a vLLM 0.34 engine with its defaults publishes: vLLM's
    default algorithm and seed, its 16-token blocks, the ints its publisher sends
    (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``), a chunk's first block chained to the block
    before it. A salted prompt's hashes are vLLM's salted ones, sent without token ids."""
    d = KvEventsConfig()
    assert d.hash_algo == CacheConfig.__dataclass_fields__["prefix_caching_hash_algo"].default
    assert d.hash_seed == kcu.DEFAULT_NONE_HASH_SEED and d.block_size == 16
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    monkeypatch.delenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", raising=False)
    fn = get_hash_fn_by_name(d.hash_algo)
    kcu.init_none_hash(fn)
    rng = random.Random(salt)
    tokens = [rng.randrange(150_000) for _ in range(64 * 3 + 5)]
    request = Request(
        "r", tokens, SamplingParams(max_tokens=1), None, cache_salt=salt,
        block_hasher=kcu.get_request_block_hasher(16, fn),
    )  # fmt: skip
    converted = [kcu.maybe_convert_block_hash(h) for h in request.block_hashes]
    theirs = [h for h in converted if isinstance(h, int)]
    assert len(theirs) == len(converted) == 12

    blocks = ChunkBlocks(64, BlockHasher(d.hash_algo, d.hash_seed, d.block_size), 10**6)
    hashes = chunk_hashes(tokens, 64)
    assert blocks.learn(tokens, hashes, salt or "") == []
    keys = [ObjectKey(h, MODEL, 0, 0, salt or "") for h in hashes]
    first = blocks.apply(EventType.STORE, Tier.L1, [Entry(keys[0], 1)])
    rest = blocks.apply(EventType.STORE, Tier.L1, [Entry(k, 1) for k in keys[1:]])
    ids = tokens[: 3 * 64] if salt is None else []
    assert first == [StoredOut(theirs[:4], None, ids[:64], 16, None, "CPU", None)]
    assert rest == [StoredOut(theirs[4:], theirs[3], ids[64:], 16, None, "CPU", None)]
    # vLLM's own decoder reads them, data-parallel rank included
    batch = msgspec.msgpack.decode(encode_batch(0.0, first + rest), type=kv_events.KVEventBatch)
    assert batch.data_parallel_rank == 0
    assert [e.block_hashes for e in batch.events] == [theirs[:4], theirs[4:]]


def test_chunk_blocks_withhold_then_publish_demote_clear_and_forget() -> None:
    """`ChunkBlocks` alone, 32-token chunks of 16-token blocks: a chunk stored before a
    prompt shows its tokens is withheld, then published in every tier holding it; the
    rest of the prompt is published when stored; a demotion removes the blocks from CPU
    and publishes them again in STORAGE, tokens and parent included; after a clear the
    owner's republish goes out again; chunks no tier holds stay within the prompt-token
    budget, oldest first out, and a prompt longer than it is never kept."""
    hasher = BlockHasher(block_size=16)
    cb = ChunkBlocks(32, hasher, prompt_tokens=4 * 32)
    tokens = list(range(1000, 1000 + 3 * 32))
    hashes = chunk_hashes(tokens, 32)
    bk = [int(k) for k in hasher.keys(tokens)]

    def e(*chunks: int, h: Sequence[bytes] = hashes) -> list[Entry]:
        return [Entry(ObjectKey(h[i], MODEL, 0), 1) for i in chunks]

    def stored(a: int, b: int, medium: str, toks: Sequence[int] = tokens) -> StoredOut:
        """Blocks a..b-1 of ``toks``."""
        keys = [int(k) for k in hasher.keys(toks)]
        return StoredOut(
            keys[a:b], keys[a - 1] if a else None, list(toks[a * 16 : b * 16]), 16, None,
            medium, None,
        )  # fmt: skip

    assert cb.apply(STORE, L1, e(0)) == [] and cb.apply(STORE, L2, e(0)) == []
    c = cb.counts()
    assert (c.chunks_withheld, c.unpublished, c.blocks) == (2, 2, 0)
    assert cb.learn(tokens, hashes, "") == [stored(0, 2, "CPU"), stored(0, 2, "STORAGE")]
    c = cb.counts()
    assert (c.unpublished, c.blocks, c.prompt_tokens) == (0, 4, 3 * 32)
    assert cb.apply(STORE, L1, e(1, 2)) == [stored(2, 6, "CPU")]
    assert cb.counts().prompt_tokens == 0
    assert cb.apply(DELETE, L1, e(2)) == [RemovedOut(bk[4:], "CPU")]
    assert cb.counts().prompt_tokens == 32  # its blocks, kept for a store in another tier
    assert cb.apply(STORE, L2, e(2)) == [stored(4, 6, "STORAGE")]
    assert cb.counts().prompt_tokens == 0

    cb.clear()
    assert (cb.counts().blocks, cb.counts().prompt_tokens) == (0, 3 * 32)
    assert cb.apply(STORE, L1, e(0, 1)) == [stored(0, 4, "CPU")]
    # a prompt of 4 chunks fills the budget: chunk 2, older, is forgotten
    other = list(range(5000, 5000 + 4 * 32))
    assert cb.learn(other, chunk_hashes(other, 32), "") == []
    assert cb.counts().prompt_tokens == 4 * 32
    assert cb.apply(STORE, L2, e(2)) == []
    assert cb.apply(STORE, L1, e(0, 1, 2, 3, h=chunk_hashes(other, 32))) == [
        stored(0, 8, "CPU", other)
    ]
    # longer than the budget: never kept
    long = list(range(9000, 9000 + 5 * 32))
    assert cb.learn(long, chunk_hashes(long, 32), "") == []
    assert cb.counts().prompt_tokens == 0
    withheld = cb.counts().chunks_withheld
    assert cb.apply(STORE, L1, e(0, h=chunk_hashes(long, 32))) == []
    assert cb.counts().chunks_withheld == withheld + 1
    with pytest.raises(InvalidInput, match="3 chunk hashes for 64 tokens"):
        cb.learn(long[:64], chunk_hashes(long, 32)[:3], "")
