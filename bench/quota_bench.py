"""What quotas cost the coordinator, in process: L2 ingest with the usage book beside the
directory, one eviction plan, and the quota and pin routes at a large directory.

    python -m bench.quota_bench [--keys 1000000] [--salts 8] [--requests 200]

- L2 STORE entries per second through `CoordinatorService.ingest.apply` (256-entry batches,
  the key-block form kvatlas' servers send), with the quota controller's book and
  without it (the controller's observer is the only difference);
- one `eviction_plan` over ``--keys`` L2 keys in ``--salts`` salts, every salt over its
  quota (ratio 0.2: a fifth of the keys planned, all of one salt whose quota is 0):
  the time the coordinator's state lock is held for it, the worst case of a sweep;
- the routes over a real coordinator's HTTP (one keep-alive client, sequential):
  ``PUT /quota/{salt}``, ``GET /quota`` (L2, from the book), ``GET /quota?tier=l1``
  (summed from the directory in steps), ``POST /cache/pins`` (4,096 tokens),
  ``GET /cache/pins``; p50 and p99 of ``--requests`` each (the L1 listing: a tenth).

Prints a markdown table; writes JSON to bench/results/quota.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import msgspec
import numpy as np

from bench.machine import describe
from kvatlas.coordinator.app import Coordinator
from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.metrics import CoordinatorMetrics
from kvatlas.coordinator.quota.controller import QuotaController
from kvatlas.coordinator.quota.metrics import QuotaMetrics
from kvatlas.coordinator.service import CoordinatorService
from kvatlas.core.coordinator.fleet import FleetState
from kvatlas.core.coordinator.quotas import OperatorState, SetQuota
from kvatlas.core.coordinator.salt_usage import SaltUsage, eviction_plan
from kvatlas.core.events import EventBatch, KeyBlock
from kvatlas.core.keys import Namespace, default_kv_rank
from kvatlas.core.types import EventType, Incarnation, InstanceId, Tier
from kvatlas.launch.procs import HOST

from .coordinator_bench import RESULTS

BATCH = 256
CHUNK_BYTES = 1 << 21


def batches(n: int, salts: int, tier: Tier = Tier.L2, seed: int = 3) -> list[EventBatch]:
    raw = np.random.default_rng(seed).bytes(32 * n)
    out = []
    for seq, start in enumerate(range(0, n, BATCH), 1):
        count = min(BATCH, n - start)
        ns = Namespace("smollm2", default_kv_rank(), 0, f"tenant-{seq % salts}")
        block = KeyBlock(ns, raw[32 * start : 32 * (start + count)], (CHUNK_BYTES,) * count)
        out.append(
            EventBatch(
                InstanceId("s1"),
                Incarnation(1),
                seq,
                EventType.STORE,
                tier,
                (),
                "disk",
                block=block,
            )
        )
    return out


def ingest_rate(bs: list[EventBatch], with_book: bool) -> float:
    svc = CoordinatorService(
        FleetState(30.0, 256), CoordinatorMetrics(), clock=time.time, timer=time.perf_counter
    )
    if with_book:
        QuotaController(svc, QuotaMetrics(svc.state.metrics.registry))
    n = sum(b.n_entries for b in bs)
    t0 = time.perf_counter()
    for b in bs:
        svc.ingest.apply([b], 0.0)
    return n / (time.perf_counter() - t0)


def plan_seconds(bs: list[EventBatch], salts: int) -> tuple[float, int]:
    usage = SaltUsage()
    for b in bs:
        usage.apply(b)
    ops = OperatorState()
    for i in range(salts):
        ops.apply(SetQuota(f"tenant-{i}", 0 if i == 0 else CHUNK_BYTES))
    t0 = time.perf_counter()
    plans = eviction_plan(usage, ops, 0.2, 1.0, {"s1"})
    return time.perf_counter() - t0, sum(len(p.keys) for p in plans)


def timed(n: int, call: Callable[[], httpx.Response]) -> dict[str, float]:
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        r = call()
        samples.append(time.perf_counter() - t0)
        assert r.status_code == 200, r.text
    samples.sort()
    return {
        "p50_ms": statistics.median(samples) * 1000,
        "p99_ms": samples[min(len(samples) - 1, int(0.99 * len(samples)))] * 1000,
        "requests": n,
    }


def routes(keys: int, salts: int, requests: int) -> dict[str, dict[str, float]]:
    # The sender never registers: it stays (provisional) for the instance timeout.
    config = CoordinatorConfig(host=HOST, port=0, eviction_check_interval=0, instance_timeout=3600)
    coord = Coordinator(config)
    svc = coord.service
    now = time.time()
    for b in batches(keys // 2, salts):
        svc.ingest.apply([b], now)
    for b in batches(keys // 2, salts, Tier.L1, seed=4):
        svc.ingest.apply([msgspec_replace_seq(b, b.seq + keys)], now)
    port = coord.bind()
    t = threading.Thread(target=coord.run, daemon=True)
    t.start()
    c = httpx.Client(base_url=f"http://{HOST}:{port}", timeout=60)
    try:
        while True:
            try:
                if c.get("/healthz").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.05)
        pin = {"model_name": "smollm2", "world_size": 1, "token_ids": list(range(4096))}
        out = {
            "PUT /quota/{salt}": timed(
                requests, lambda: c.put("/quota/tenant-1", json={"limit_gb": 1.5})
            ),
            "GET /quota": timed(requests, lambda: c.get("/quota")),
            "GET /quota?tier=l1": timed(
                max(5, requests // 10), lambda: c.get("/quota", params={"tier": "l1"})
            ),
            "POST /cache/pins (4,096 tokens)": timed(
                requests, lambda: c.post("/cache/pins", json=pin)
            ),
            "GET /cache/pins": timed(requests, lambda: c.get("/cache/pins")),
        }
    finally:
        c.close()
        coord.stop()
        t.join()
    return out


def msgspec_replace_seq(b: EventBatch, seq: int) -> EventBatch:
    return msgspec.structs.replace(b, seq=seq)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", type=int, default=1_000_000)
    ap.add_argument("--salts", type=int, default=8)
    ap.add_argument("--requests", type=int, default=200)
    a = ap.parse_args(argv)
    bs = batches(a.keys, a.salts)
    without = ingest_rate(bs, with_book=False)
    with_book = ingest_rate(bs, with_book=True)
    plan_s, planned = plan_seconds(bs, a.salts)
    http = routes(a.keys, a.salts, a.requests)
    result: dict[str, Any] = {
        "machine": describe(),
        "keys": a.keys,
        "salts": a.salts,
        "l2_ingest_entries_per_s": {"without_book": without, "with_book": with_book},
        "eviction_plan": {"seconds": plan_s, "keys_planned": planned},
        "routes": http,
    }
    print(f"L2 STORE ingest, {a.keys:,} entries: {without:,.0f}/s without the book,"
          f" {with_book:,.0f}/s with it")  # fmt: skip
    print(f"eviction_plan over {a.keys:,} keys in {a.salts} salts: {plan_s * 1000:.0f} ms"
          f" ({planned:,} keys planned)")  # fmt: skip
    print(f"\nroutes ({a.keys // 2:,} L2 + {a.keys // 2:,} L1 keys):\n")
    print("| route | p50 ms | p99 ms |\n|---|---:|---:|")
    for name, r in http.items():
        print(f"| `{name}` | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} |")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "quota.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
