"""In-process benchmarks of the pure core, side by side with a naive baseline.

    python -m bench.core_bench [--keys 1000000]

- STORE entries applied per second (one core), kvatlas directory vs a naive
  dict[ObjectKey, dict[owner, Placement]] directory (the shape of a straightforward
  Python coordinator); and the same batches in the key block form servers send.
- Hashing a 32,768-token prompt into 128 chunk keys.
- Prefix lookup of 128 keys with N keys in the directory: median and p99.
- Memory per key (one placement) at N keys, traced with tracemalloc.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
import tracemalloc
from pathlib import Path

import msgspec
import numpy as np

from bench.machine import describe
from kvatlas.core.coordinator.directory import KeyDirectory
from kvatlas.core.coordinator.placements import Placement
from kvatlas.core.events import Entry, EventBatch, KeyBlock
from kvatlas.core.keys import ObjectKey, chunk_hashes, default_kv_rank
from kvatlas.core.types import EventType, Incarnation, InstanceId, Tier

BATCH = 256


class NaiveDirectory:
    """The baseline: one dict entry per key holding Placement objects."""

    def __init__(self) -> None:
        self.map: dict[ObjectKey, dict[tuple[str, int, Tier, str], Placement]] = {}

    def apply(self, b: EventBatch) -> None:
        owner = (b.instance_id, b.incarnation, b.tier, b.backend)
        for e in b.entries:
            self.map.setdefault(e.key, {})[owner] = Placement(
                b.instance_id, b.incarnation, b.tier, b.backend, e.size_bytes, b.shared
            )


def make_batches(n: int, seed: int = 1) -> tuple[list[EventBatch], list[bytes]]:
    rng = np.random.default_rng(seed)
    raw = rng.bytes(32 * n)
    hashes = [raw[i : i + 32] for i in range(0, len(raw), 32)]
    kv = default_kv_rank()
    batches = []
    for b, start in enumerate(range(0, n, BATCH)):
        entries = tuple(
            Entry(ObjectKey(h, "smollm2", kv), 1 << 21) for h in hashes[start : start + BATCH]
        )
        batches.append(
            EventBatch(
                InstanceId("node-a"), Incarnation(1), b + 1, EventType.STORE, Tier.L1, entries
            )
        )
    return batches, hashes


def as_blocks(batches: list[EventBatch]) -> list[EventBatch]:
    """The same batches with their entries in a key block."""
    return [
        msgspec.structs.replace(b, entries=(), block=KeyBlock.from_entries(b.entries))
        for b in batches
    ]


def apply_rate(directory: KeyDirectory | NaiveDirectory, batches: list[EventBatch]) -> float:
    gc.collect()
    t0 = time.perf_counter()
    for b in batches:
        directory.apply(b)
    return sum(b.n_entries for b in batches) / (time.perf_counter() - t0)


def traced_bytes_per_key(
    factory: type[KeyDirectory] | type[NaiveDirectory], batches: list[EventBatch]
) -> float:
    gc.collect()
    tracemalloc.start()
    d = factory()
    for b in batches:
        d.apply(b)
    used, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return used / sum(len(b.entries) for b in batches)


def main(argv: list[str] | None = None) -> dict[str, object]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", type=int, default=1_000_000)
    ap.add_argument("--baseline-keys", type=int, default=200_000)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)

    print(f"[core] building {args.keys:,} STORE entries ...", flush=True)
    batches, hashes = make_batches(args.keys)
    base_batches = batches[: args.baseline_keys // BATCH]

    block_batches = as_blocks(batches)
    rates, base_rates, block_rates = [], [], []
    for r in range(args.repeats):
        print(f"[core] apply rate, repeat {r + 1}/{args.repeats}", flush=True)
        rates.append(apply_rate(KeyDirectory(), batches))
        base_rates.append(apply_rate(NaiveDirectory(), base_batches))
        block_rates.append(apply_rate(KeyDirectory(), block_batches))
    del block_batches
    d = KeyDirectory()
    for b in batches:
        d.apply(b)

    print("[core] hashing a 32,768-token prompt", flush=True)
    tokens = np.random.default_rng(2).integers(0, 49152, 32768, dtype=np.uint32)
    token_list = tokens.tolist()
    hash_us = statistics.median(_time_us(lambda: chunk_hashes(tokens)) for _ in range(200))
    hash_list_us = statistics.median(_time_us(lambda: chunk_hashes(token_list)) for _ in range(50))

    print("[core] prefix lookups of 128 keys", flush=True)
    ns = batches[0].entries[0].key.namespace
    lat = []
    for i in range(3000):
        start = (i * 128) % (args.keys - 128)
        q = hashes[start : start + 128]
        lat.append(_time_us(lambda q=q: d.lookup_prefix(q, ns)))
    lat.sort()

    print("[core] snapshot: capture (under the coordinator's lock) and encode", flush=True)
    captures, encodes = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        cap = d.capture()
        t1 = time.perf_counter()
        cap.encode()
        captures.append(t1 - t0)
        encodes.append(time.perf_counter() - t1)
    del cap

    print("[core] memory per key", flush=True)
    mem = traced_bytes_per_key(KeyDirectory, batches)
    base_mem = traced_bytes_per_key(NaiveDirectory, base_batches)

    result: dict[str, object] = {
        "machine": describe(),
        "keys": args.keys,
        "store_entries_per_s": statistics.median(rates),
        "baseline_store_entries_per_s": statistics.median(base_rates),
        "store_block_entries_per_s": statistics.median(block_rates),
        "hash_32k_tokens_us": hash_us,
        "hash_32k_tokens_from_list_us": hash_list_us,
        "prefix_lookup_128_p50_us": lat[len(lat) // 2],
        "prefix_lookup_128_p99_us": lat[int(len(lat) * 0.99)],
        "snapshot_capture_ms": statistics.median(captures) * 1000,
        "snapshot_encode_ms": statistics.median(encodes) * 1000,
        "bytes_per_key": mem,
        "baseline_bytes_per_key": base_mem,
    }
    rows = [
        (
            "STORE entries applied / s (one core)",
            f"{result['store_entries_per_s']:,.0f}",
            f"{result['baseline_store_entries_per_s']:,.0f}",
            ">= 1,000,000",
        ),
        (
            "STORE entries applied / s, key block form (one core)",
            f"{result['store_block_entries_per_s']:,.0f}",
            "",
            "",
        ),
        ("hash 32,768 tokens -> 128 keys (uint32 array)", f"{hash_us:.0f} us", "", "<= 300 us"),
        ("hash 32,768 tokens -> 128 keys (Python list)", f"{hash_list_us:.0f} us", "", ""),
        (
            f"prefix lookup of 128 keys, {args.keys:,} keys, p50",
            f"{result['prefix_lookup_128_p50_us']:.0f} us",
            "",
            "",
        ),
        (
            f"prefix lookup of 128 keys, {args.keys:,} keys, p99",
            f"{result['prefix_lookup_128_p99_us']:.0f} us",
            "",
            "<= 100 us",
        ),
        (f"memory per key at {args.keys:,} keys", f"{mem:.0f} B", f"{base_mem:.0f} B", "<= 200 B"),
        (
            f"snapshot of {args.keys:,} keys: capture (state locked) / encode (unlocked)",
            f"{result['snapshot_capture_ms']:.0f} / {result['snapshot_encode_ms']:.0f} ms",
            "",
            "",
        ),
    ]
    print("\n| measure | kvatlas | naive dict baseline | target |\n|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    out = Path("bench/results")
    out.mkdir(parents=True, exist_ok=True)
    (out / "core.json").write_text(json.dumps(result, indent=2))
    return result


def _time_us(fn: object) -> float:
    t0 = time.perf_counter()
    fn()  # type: ignore[operator]
    return (time.perf_counter() - t0) * 1e6


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    main()
