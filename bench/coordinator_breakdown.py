"""Where a coordinator lookup's server-side time goes, step by step, in process.

    python -m bench.coordinator_breakdown [--gc-keys 1000000] [--glibc-defaults]

The same steps the HTTP handler runs for `POST /directory/lookup`, timed one by one
(medians of 300 runs; the JSON array also by each parser this installation has, and as
msgspec's Python ints) for a 32,768-token prompt (JSON `token_ids`, `tokens_b64`, msgpack) and
for 128 keys, with 100 of the 128 chunks held by one instance. The HTTP round trip itself
is what `bench.coordinator_bench` adds on top. The process sets glibc's malloc
thresholds as the coordinator's does (`coordinator.host.allocator`; ``--glibc-defaults`` leaves
them, for comparison). Then the pause of one full garbage
collection with ``--gc-keys`` keys stored, as the coordinator process runs (its startup
objects frozen before the keys arrive) and without the freeze (CPU time, 7 runs).
"""

from __future__ import annotations

import argparse
import base64
import gc
import json
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import msgspec
import numpy as np

from kvatlas.coordinator.host.allocator import keep_freed_heap
from kvatlas.coordinator.views import holders_wire, lookup_json, prefix_response
from kvatlas.core.coordinator.fleet import FleetState
from kvatlas.core.events import Entry, EventBatch, KeyBlock
from kvatlas.core.keys import (
    CHAINS,
    Namespace,
    ObjectKey,
    chunk_hash_blob,
    chunk_hashes,
    default_kv_rank,
)
from kvatlas.core.types import EventType, Incarnation, InstanceId, Tier
from kvatlas.wire.directory_api import LookupRequest, decode_lookup, encode_lookup_msgpack
from kvatlas.wire.http_api import shared_namespace
from kvatlas.wire.json_tokens import PARSERS, token_ids_array

MODEL = "m"
A = InstanceId("a")
"""The one instance the in-process fleet hears from."""
JSON, MSGPACK = "application/json", "application/msgpack"
_ints = msgspec.json.Decoder(LookupRequest)


def _median_us(fn: Callable[[], Any], n: int = 300) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def _full_collection_ms() -> tuple[float, float]:
    """(min, median) CPU milliseconds of 7 full collections."""
    times = []
    for _ in range(7):
        t0 = time.thread_time()
        gc.collect()
        times.append((time.thread_time() - t0) * 1000)
    return min(times), statistics.median(times)


def _gc_pauses(keys: int) -> list[tuple[str, float, float]]:
    gc.collect()
    gc.freeze()  # what `Coordinator.run` does before serving
    fleet = FleetState()
    rank = default_kv_rank()
    per = 8192
    for seq, start in enumerate(range(0, keys, per), 1):
        ids = np.arange(start, min(keys, start + per), dtype=">u8").view(np.uint8)
        hashes = [bytes(h) * 4 for h in ids.reshape(-1, 8)]
        block = KeyBlock.of(Namespace(MODEL, rank), hashes, 4096)
        fleet.ingest(
            EventBatch(A, Incarnation(1), seq, EventType.STORE, Tier.L1, (), block=block), 0.0
        )
    frozen = _full_collection_ms()
    gc.unfreeze()
    return [
        (f"full garbage collection, {keys:,} keys, startup frozen", *frozen),
        (f"full garbage collection, {keys:,} keys, nothing frozen", *_full_collection_ms()),
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.coordinator_breakdown")
    ap.add_argument("--gc-keys", type=int, default=1_000_000, help="keys stored for the GC pause")
    ap.add_argument(
        "--glibc-defaults", action="store_true", help="leave glibc's malloc thresholds as they are"
    )
    args = ap.parse_args(argv)
    if not args.glibc_defaults:
        keep_freed_heap()
    fleet = FleetState()
    rank = default_kv_rank()
    tokens = list(range(7, 7 + 32768))
    hashes = chunk_hashes(tokens)
    held = tuple(Entry(ObjectKey(h, MODEL, rank), 1 << 20) for h in hashes[:100])
    fleet.ingest(EventBatch(A, Incarnation(1), 1, EventType.STORE, Tier.L1, held), 0.0)
    ns = Namespace(MODEL, rank)
    raw = np.asarray(tokens, dtype="<u4").tobytes()
    json_body = json.dumps({"token_ids": tokens, "model_name": MODEL}).encode()
    b64_body = json.dumps(
        {"tokens_b64": base64.b64encode(raw).decode(), "model_name": MODEL}
    ).encode()
    msgpack_body = encode_lookup_msgpack(LookupRequest(tokens_b64=raw, model_name=MODEL))
    keys_body = json.dumps(
        {
            "keys": [
                {"chunk_hash_hex": h.hex(), "model_name": MODEL, "kv_rank": rank} for h in hashes
            ]
        }
    ).encode()
    res = fleet.directory.lookup_prefix(hashes, ns)
    hexes = [h.hex() for h in hashes]
    holders = holders_wire(res, 256)
    req_keys = decode_lookup(keys_body, JSON).keys or []
    blob = b"".join(hashes)
    cols = fleet.directory.lookup_blob(blob, ns)
    steps: list[tuple[str, Callable[[], Any]]] = [
        ("decode body, 32,768 `token_ids` (JSON ints)", lambda: decode_lookup(json_body, JSON)),
        *(
            (f"(its array alone, {name} parser)", partial(token_ids_array, json_body, parse))
            for name, parse in PARSERS.items()
        ),
        ("(its array as Python ints: msgspec's exact decode)", lambda: _ints.decode(json_body)),
        ("decode body, `tokens_b64` (base64 in msgspec)", lambda: decode_lookup(b64_body, JSON)),
        ("decode body, msgpack (raw tokens)", lambda: decode_lookup(msgpack_body, MSGPACK)),
        ("hash 32,768 tokens into 128 chunk keys", lambda: chunk_hashes(raw)),
        *(
            (f"(the chain alone as one blob, {name} chain)",
             partial(chunk_hash_blob, raw, 256, chain=chain))
            for name, chain in CHAINS.items()
        ),
        ("directory prefix lookup, 128 chunks", lambda: fleet.directory.lookup_prefix(hashes, ns)),
        ("response: JSON written by `lookup_json`, 128 chunks",
         lambda: lookup_json([h.hex() for h in hashes], ns, res, holders)),
        ("(same response through msgspec Structs, for comparison)",
         lambda: msgspec.json.encode(prefix_response(res, 256))),
        ("decode body, 128 keys (JSON)", lambda: decode_lookup(keys_body, JSON)),
        ("keys: check they share one namespace", lambda: shared_namespace(req_keys)),
        ("keys: one hex decode of all hashes",
         lambda: bytes.fromhex("".join([k.chunk_hash_hex for k in req_keys]))),
        ("directory lookup of the 128-hash blob", lambda: fleet.directory.lookup_blob(blob, ns)),
        ("response: JSON written by `lookup_json`, 128 keys",
         lambda: lookup_json(hexes, ns, cols, [])),
    ]  # fmt: skip
    rows = [(name, _median_us(fn)) for name, fn in steps]
    print("\n| step (server side, in process) | median |\n|---|---|")
    for name, us in rows:
        print(f"| {name} | {us:,.0f} us |")
    print("\n| garbage collection (CPU time) | min | median |\n|---|---|---|")
    for name, low, mid in _gc_pauses(args.gc_keys):
        print(f"| {name} | {low:.1f} ms | {mid:.1f} ms |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
