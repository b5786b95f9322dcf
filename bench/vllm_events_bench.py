"""The device tier's ingest and lookups: vLLM KV events per second and
lookup latency with 1M blocks indexed.

    python -m bench.vllm_events_bench [--blocks 1000000] [--batches 2000]

- decode + apply: vLLM-shaped ``KVEventBatch`` payloads (maps with ``"type"``, 64-bit
  int hashes (vLLM's default), random token ids, 16 blocks per ``BlockStored``, as vLLM
  0.34 encodes them) through
  `kvatlas.wire.vllm_events.decode_message`, the engine's `EngineStream` and the
  `DeviceIndex`, in one thread: blocks/s and batches/s.
- over ZeroMQ: the same payloads from a PUB socket on loopback into the coordinator's
  `VllmIngest` (its SUB thread), timed to the last seq applied.
- lookups with ``--blocks`` blocks in the index (8 engines): an 8,192-token prompt (512
  blocks of 16) held by one engine: its content keys computed, then matched: median and
  p99 of the hashing, the index walk, and both.
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import statistics
import time
from typing import Any

import msgspec
import zmq

from bench.machine import describe
from kvatlas.coordinator.vllm.ingest import VllmIngest
from kvatlas.coordinator.vllm.sources import parse_source
from kvatlas.core.coordinator.block_table import prompt_keys
from kvatlas.core.coordinator.engine_stream import EngineStream
from kvatlas.core.device_blocks import DeviceIndex, EngineId, Stored, block_key
from kvatlas.core.vllm_hash import BlockHasher
from kvatlas.wire.vllm_events import decode_message

BLOCKS_PER_EVENT = 16
EVENTS_PER_BATCH = 4


def _payloads(n: int, rng: random.Random) -> list[list[bytes]]:
    enc = msgspec.msgpack.Encoder()
    out = []
    for seq in range(n):
        events = [
            {
                "type": "BlockStored",
                "block_hashes": [rng.getrandbits(64) for _ in range(BLOCKS_PER_EVENT)],
                "parent_block_hash": None,
                "token_ids": [rng.randrange(150_000) for _ in range(BLOCKS_PER_EVENT * 16)],
                "block_size": 16,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
            }
            for _ in range(EVENTS_PER_BATCH)
        ]
        out.append([b"kv-events", seq.to_bytes(8, "big"), enc.encode([time.time(), events])])
    return out


def bench_apply(frames: list[list[bytes]]) -> dict[str, float]:
    index, stream, engine = DeviceIndex(), EngineStream(), EngineId("e")
    t0 = time.perf_counter()
    for f in frames:
        batch = decode_message(f)
        for _seq, events in stream.live(batch.seq, batch.events, batch.fingerprint).apply:
            index.apply(engine, events)
    dt = time.perf_counter() - t0
    blocks = len(frames) * EVENTS_PER_BATCH * BLOCKS_PER_EVENT
    assert index.count(engine) == blocks
    return {"batches_per_s": len(frames) / dt, "blocks_per_s": blocks / dt}


def bench_zmq(frames: list[list[bytes]]) -> dict[str, float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.set_hwm(len(frames) + 10)
    pub.bind(f"tcp://127.0.0.1:{port}")
    ingest = VllmIngest(parse_source(f"e=tcp://127.0.0.1:{port}"), resync_s=3600)
    ingest.start()
    try:
        # The SUB joins (a probe batch at seq 0 arrives), then the timed stream follows.
        end = time.monotonic() + 30
        while ingest.stats()["e"]["last_seq"] < 0:
            if time.monotonic() > end:
                raise RuntimeError("the subscriber never joined")
            pub.send_multipart(frames[0])
            time.sleep(0.05)
        t0 = time.perf_counter()
        for f in frames[1:]:
            pub.send_multipart(f)
        last = len(frames) - 1
        while ingest.stats()["e"]["last_seq"] != last:
            if time.monotonic() > end + 60:
                raise RuntimeError(f"stalled at {ingest.stats()['e']}")
            time.sleep(0.001)
        dt = time.perf_counter() - t0
        got = ingest.stats()["e"]
        assert got["lost"] == 0, got
    finally:
        ingest.stop()
        pub.close(linger=0)
        ctx.term()
    n = len(frames) - 1
    return {"batches_per_s": n / dt, "blocks_per_s": n * EVENTS_PER_BATCH * BLOCKS_PER_EVENT / dt}


def _pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]


def bench_lookup(total_blocks: int, rng: random.Random, rounds: int) -> dict[str, Any]:
    """Content keys of the prompt (the XXH3 chain over its tokens), then each engine's
    table walked."""
    hasher = BlockHasher("sha256_cbor", block_size=16)
    engines = [EngineId(f"e{i}") for i in range(8)]
    index = DeviceIndex()
    prompt = [rng.randrange(150_000) for _ in range(8192)]
    held = hasher.keys(prompt)
    index.apply(engines[3], [Stored(tuple(held), "GPU", 16, True, tokens=prompt)])
    per = (total_blocks - len(held)) // len(engines)
    for e in engines:
        for _ in range(per // BLOCKS_PER_EVENT):
            keys = tuple(block_key(rng.getrandbits(64)) for _ in range(BLOCKS_PER_EVENT))
            tokens = [rng.randrange(150_000) for _ in range(BLOCKS_PER_EVENT * 16)]
            index.apply(e, [Stored(keys, "GPU", 16, True, tokens=tokens)])
    hash_us, walk_us, both_us = [], [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        keys_ = prompt_keys(prompt, 16)
        t1 = time.perf_counter()
        best = max(engines, key=lambda e: index.leading(e, keys_)[0])
        t2 = time.perf_counter()
        assert best == engines[3]
        hash_us.append((t1 - t0) * 1e6)
        walk_us.append((t2 - t1) * 1e6)
        both_us.append((t2 - t0) * 1e6)
    return {
        "blocks_indexed": index.total_blocks(),
        "engines": len(engines),
        "prompt_tokens": len(prompt),
        "hash_us_p50": statistics.median(hash_us),
        "hash_us_p99": _pct(hash_us, 0.99),
        "walk_us_p50": statistics.median(walk_us),
        "walk_us_p99": _pct(walk_us, 0.99),
        "lookup_us_p50": statistics.median(both_us),
        "lookup_us_p99": _pct(both_us, 0.99),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=1_000_000)
    ap.add_argument("--batches", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=200)
    args = ap.parse_args()
    rng = random.Random(31)
    frames = _payloads(args.batches, rng)
    result = {
        "machine": describe(),
        "decode_apply": bench_apply(frames),
        "zmq_ingest": bench_zmq(frames),
        "lookup": bench_lookup(args.blocks, rng, args.rounds),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
