"""Issue #38 item 5: the ingest counts each batch once, the first connection gets its
full replay, a gap replay notices a restarted publisher, the memo's miss metric is
spelled as documented. vLLM's own `ZmqEventPublisher` publishes, as in
``test_vllm_ingest``."""

from __future__ import annotations

import time
from typing import Any

import zmq
from prometheus_client import CollectorRegistry, generate_latest

from kvatlas.coordinator.vllm.ingest import VllmIngest
from kvatlas.coordinator.vllm.sources import parse_source
from kvatlas.core.coordinator.block_table import prompt_keys
from kvatlas.core.coordinator.engine_stream import EngineStream
from kvatlas.core.device_blocks import DeviceIndex, EngineId
from kvatlas.wire.vllm_events import END_SEQ, decode_message, replay_request
from support.wait import wait_until

from .test_vllm_ingest import BLOCK, HASHER, _batch, _port, _prompt, _publisher, _stored, kv_events


def _spec(ports: tuple[int, int]) -> str:
    return (
        f"e1=tcp://127.0.0.1:{ports[0]},replay=tcp://127.0.0.1:{ports[1]},"
        f"topic=kv-events,block_size={BLOCK},hash=sha256_cbor"
    )


def test_an_idle_engine_counts_its_last_batch_once() -> None:
    """The idle check re-reads the last batch every ``resync_s``: neither its skipped
    events nor a malformed message after it are counted again, and the checks are
    resyncs, not replays."""
    ports = _port(), _port()
    pub = _publisher(*ports)
    ing = VllmIngest(parse_source(_spec(ports)), replay_timeout_s=1.0, resync_s=0.2)
    try:
        odd = {"type": "BlockStored", "block_hashes": HASHER.digests(_prompt(1)),
               "token_ids": _prompt(1), "block_size": BLOCK, "shiny_new_field": 1}  # fmt: skip
        pub.publish(
            kv_events.EventBatch(
                ts=time.time(),
                events=[
                    odd,
                    {"type": "SomeFutureEvent"},
                    {"type": "BlockRemoved", "block_hashes": 7},
                ],
            )
        )
        wait_until(lambda: len(pub._buffer) == 1, what="the publisher to buffer seq 0")
        # A payload that does not decode, buffered after it (replayed by every check).
        pub._buffer.append((next(pub._seq_gen), b"\xc1"))
        ing.start()
        wait_until(lambda: ing.stats()["e1"]["last_seq"] == 0, what="seq 0")
        wait_until(lambda: ing.stats()["e1"]["resyncs"], lambda n: n >= 4, what="4 idle checks")
        s = ing.stats()["e1"]
        assert (s["unknown_fields"], s["unknown_types"], s["malformed_events"]) == (1, 1, 1)
        assert s["malformed_messages"] == 1
        assert s["replays"] == 1  # the connection's; the idle checks are resyncs
        assert s["batches"] == 1
    finally:
        ing.stop()
        pub.shutdown()


class _SlowConnect(zmq.Socket):  # type: ignore[type-arg]
    """A socket whose connect returns only once the connection has had time to be made:
    a monitor attached after it would have missed the connection's event."""

    def connect(self, addr: str) -> Any:
        out = super().connect(addr)
        time.sleep(0.5)
        return out


class _SlowContext(zmq.Context):  # type: ignore[type-arg]
    _socket_class = _SlowConnect


def test_the_first_connection_asks_for_the_full_replay() -> None:
    """Batches published before the subscriber connects come only by the replay the
    first connection asks for; no idle check (``resync_s`` 60 s) would ask in time."""
    ports = _port(), _port()
    pub = _publisher(*ports)
    ing = VllmIngest(
        parse_source(_spec(ports)), replay_timeout_s=1.0, resync_s=60.0, context=_SlowContext()
    )
    try:
        for i in range(3):
            pub.publish(_batch(_stored(_prompt(i))))
        wait_until(lambda: len(pub._buffer) == 3, what="the publisher to buffer 3 batches")
        ing.start()
        wait_until(lambda: ing.stats()["e1"]["last_seq"] == 2, what="the first replay", timeout=5)
        assert ing.stats()["e1"]["replays"] == 1
    finally:
        ing.stop()
        pub.shutdown()


def _replay(ctx: zmq.Context[Any], port: int, start: int) -> list[list[bytes]]:
    """vLLM's answer to a replay request from ``start``: its messages, in order."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    try:
        dealer.send_multipart(replay_request(start))
        out: list[list[bytes]] = []
        while True:
            assert dealer.poll(5000), "no answer from the replay socket"
            frames = dealer.recv_multipart()[1:]
            if frames[1] == END_SEQ:
                return out
            out.append(frames)
    finally:
        dealer.close()


def test_a_gap_replay_reveals_a_restart_whose_first_batches_were_lost() -> None:
    """Engine A's seqs 0-5 applied; it restarts as B, whose seqs 0-6 the subscriber never
    sees live; B's seq 7 opens a gap. The replay asked from the last applied seq (5)
    brings B's 5, which differs: a restart, A's blocks dropped and B replayed in full.
    (Asked from 6, B's 6 and 7 would land on A's blocks.) The stream is driven by hand
    with vLLM's messages, read from its replay socket, so the lost batches are lost."""
    ctx: zmq.Context[Any] = zmq.Context()
    ports = _port(), _port()
    e = EngineId("e")
    stream, index = EngineStream(), DeviceIndex()

    def step(out: Any) -> Any:
        if out.restarted:
            index.drop(e)
        for _, events in out.apply:
            index.apply(e, events)
        return out

    def feed(frames: list[bytes], live: bool) -> Any:
        b = decode_message(frames)
        return step((stream.live if live else stream.replayed)(b.seq, b.events, b.fingerprint))

    def answer(start: int) -> None:
        stream.replay_sent()
        for frames in _replay(ctx, ports[1], start):
            out = feed(frames, live=False)
            if out.replay_from is not None:
                answer(out.replay_from)
        step(stream.replay_end())

    try:
        a = _publisher(*ports)
        try:
            for i in range(6):
                a.publish(_batch(_stored(_prompt(i))))
            wait_until(lambda: len(a._buffer) == 6, what="A's 6 batches")
            for frames in _replay(ctx, ports[1], 0):
                feed(frames, live=True)
        finally:
            a.shutdown()
        assert stream.last == 5
        b = _publisher(*ports)
        try:
            for i in range(8):
                b.publish(_batch(_stored(_prompt(100 + i))))
            wait_until(lambda: len(b._buffer) == 8, what="B's 8 batches")
            seven = _replay(ctx, ports[1], 7)[0]
            out = feed(seven, live=True)
            assert out.replay_from == 5  # the last applied seq, checked again
            answer(out.replay_from)
        finally:
            b.shutdown()
        assert stream.last == 7 and not stream.replaying
        keys = {k for i in range(6) for k in HASHER.keys(_prompt(i))}
        assert not keys & set(index.blocks(e)), "a block of the engine before its restart survived"
        for i in range(8):
            assert index.leading(e, prompt_keys(_prompt(100 + i), HASHER.block_size))[0] == 4
    finally:
        ctx.term()


def test_the_device_tier_metrics_are_spelled_as_documented() -> None:
    ing = VllmIngest(parse_source(_spec((_port(), _port()))))
    registry = CollectorRegistry()
    ing.attach(registry)
    try:
        text = generate_latest(registry).decode()
    finally:
        ing.stop()
    assert "kvatlas_vllm_events_hash_mismatches_total" in text
    assert "kvatlas_vllm_events_unchained_blocks_total" in text
    assert "kvatlas_vllm_device_table_bytes" in text
    assert "misss" not in text
    assert "kvatlas_vllm_events_resyncs_total" in text
