"""``kvatlas server --kv-events-endpoint``: a real server process publishes its L1/L2 as
vLLM KV events. A real coordinator's ``--vllm-kv-events`` ingest (joining late: its
connect replay fills what it missed) holds exactly the server's chunks per medium
across stores, demotion to L2, deletes, clears and a restart; vLLM's own msgspec
decoder (``KVEventBatch``) reads every published and replayed payload; a full queue
drops changes without blocking the store, counts them, clears and resyncs; a batch lost
on the wire is repaired from the replay socket."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import zmq

from kvatlas.connector.client import CacheClient
from kvatlas.coordinator.vllm_ingest import VllmIngest
from kvatlas.coordinator.vllm_sources import parse_sources
from kvatlas.core.device_blocks import MEDIA, BlockKey, EngineId, block_key, medium_bit
from kvatlas.core.events import Entry
from kvatlas.core.keys import ObjectKey
from kvatlas.core.types import EventType, Tier
from kvatlas.server.config import KvEventsConfig, ServerConfig
from kvatlas.server.kv_events import KvEventsCollector, KvEventsPublisher
from kvatlas.wire.vllm_events import END_SEQ, replay_request
from support.cache_fleet import CHUNK, L1_GB, MODEL, data, prompt
from support.coordinator import RunningCoordinator
from support.services import ServerProc, start_server_process
from support.wait import wait_until

from .test_vllm_ingest import DroppingPub, _port

kv_events = pytest.importorskip(
    "vllm.distributed.kv_events", reason="vLLM not installed (scripts/bootstrap.sh)"
)
CPU = medium_bit("CPU")
STORAGE = medium_bit("STORAGE")
assert MEDIA[1:] == ("CPU", "STORAGE")


def _start(tmp: Path, pub: int, replay: int) -> ServerProc:
    return start_server_process(
        tmp, "node-s",
        "--l1-size-gb", L1_GB, "--chunk-size", str(CHUNK),
        "--l2-path", str(tmp / "l2"), "--l2-size-gb", "0.05",
        "--kv-events-endpoint", f"tcp://127.0.0.1:{pub}",
        "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{replay}",
        "--kv-events-topic", "kv",
    )  # fmt: skip


def _client(s: ServerProc) -> CacheClient:
    c = CacheClient(s.engine_url, timeout_s=10, engine_id="eng")
    c.register(MODEL, "float16", (2, 2, 8), chunk_size=CHUNK)
    return c


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

    def events(self) -> list[Any]:
        return [e for _, b in self.batches for e in b.events]

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
        time.sleep(0.3)  # the reader's subscription takes; the coordinator joins later
        assert engine.store_chunks(first, data(3, 1)).stored == 3
        hashes = engine.hashes(first)
        keys = [block_key(h) for h in hashes]
        spec = f"node-s=tcp://127.0.0.1:{ports[0]},replay=tcp://127.0.0.1:{ports[1]},topic=kv"
        rc = start_coordinator(vllm_kv_events=parse_sources([spec]))
        ingest = rc.coordinator.vllm
        assert ingest is not None

        def blocks() -> dict[BlockKey, int]:
            with ingest.lock:
                return ingest.index.blocks(ingest.sources[0].engine)

        # stored before the coordinator subscribed: the connect replay brings them
        wait_until(lambda: blocks() == dict.fromkeys(keys, CPU), what="the first chunks in L1")
        # L1 holds 16 chunks: 16 more demote the first three to L2
        engine.store_chunks(prompt(16, seed=2), data(16, 2))
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
        # block hashes are the chunk hashes' bytes, token ids are whole blocks
        wait_until(lambda: len(reader.events()) >= 4, what="the reader's batches")
        live = reader.events()
        stored = [e for e in live if isinstance(e, kv_events.BlockStored)]
        assert stored[0].block_hashes == hashes and stored[0].medium == "CPU"
        assert stored[0].block_size == CHUNK and stored[0].token_ids in ([], first)
        assert any(e.medium == "STORAGE" for e in stored)
        assert {e.medium for e in live if isinstance(e, kv_events.BlockRemoved)} >= {"CPU"}
        everything = _replay(ports[1], 0)
        assert [s for s, _ in everything] == list(range(len(everything)))
        assert isinstance(everything[0][1].events[0], kv_events.AllBlocksCleared)
        assert [s for s, _ in _replay(ports[1], 3)] == list(range(3, len(everything)))

        # a restart: seq 0 again, AllBlocksCleared, then what L2 still holds
        held_l2 = {k for k, m in blocks().items() if m == STORAGE}
        engine.close()
        assert server.stop() == 0, server.tail()
        restarted = _start(tmp_path, *ports)
        try:
            wait_until(
                lambda: ingest.stats()["node-s"]["restarts"] >= 1 and set(blocks()) == held_l2,
                what="the restarted server's L2 only",
                timeout=60,
            )
            assert all(m == STORAGE for m in blocks().values())
            metrics = restarted.metrics()
            assert 'kvatlas_server_kv_events_cleared_total{instance="node-s"} 1.0' in metrics
        finally:
            restarted.stop()
        assert ingest.stats()["node-s"]["lost"] == 0
    finally:
        reader.close()


def _wire_keys(hashes: list[bytes]) -> list[dict[str, Any]]:
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
    keys = [ObjectKey(bytes([i]) * 32, MODEL, 0) for i in range(5)]
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
        time.sleep(0.3)
        assert pub.stats().blocks_removed == 0
        pub.publish(EventType.DELETE, Tier.L1, [Entry(twin, 1)])
        wait_until(lambda: pub.stats().blocks_removed == 1, what="the block removed")
    finally:
        pub.stop()


def test_bad_flags_name_the_flag() -> None:
    for cfg, reason in (
        (KvEventsConfig(endpoint="127.0.0.1:5557"), "--kv-events-endpoint must be tcp://"),
        (KvEventsConfig(replay_endpoint="tcp://h:1"), "needs --kv-events-endpoint"),
        (KvEventsConfig(endpoint="tcp://h:1", replay_endpoint="tcp://h:1"), "must differ"),
        (KvEventsConfig(endpoint="tcp://h:1", buffer_steps=0), "--kv-events-buffer-steps"),
    ):
        with pytest.raises(Exception, match=reason):
            ServerConfig(instance_id="x", kv_events=cfg).validate()  # type: ignore[arg-type]


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
        keys = [ObjectKey(bytes([i + 1]) * 32, MODEL, 0) for i in range(4)]
        for k in keys:
            pub.publish(EventType.STORE, Tier.L1, [Entry(k, 1)])
            time.sleep(0.15)  # one batch each
        pub.publish(EventType.DELETE, Tier.L1, [Entry(keys[0], 1)])
        want = {block_key(k.chunk_hash): CPU for k in keys[1:]}

        def held() -> dict[BlockKey, int]:
            with ingest.lock:
                return ingest.index.blocks(EngineId("srv"))

        wait_until(lambda: held() == want, what="every change, the gap repaired")
        s = ingest.stats()["srv"]
        assert s["lost"] == 0 and s["replays"] >= 2 and s["last_seq"] == pub.stats().last_seq
    finally:
        ingest.stop()
        pub.stop()
