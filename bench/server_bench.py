"""Cache server benchmark: engine <-> server through the shared L1 region.

``python -m bench.server_bench [--quick]`` starts a real ``kvatlas server`` process (and a
real coordinator for the event rate), runs bounded measurements from this process acting
as the engine, prints a markdown table and writes JSON to bench/results/.

Measured:
- store / retrieve throughput of 4 MiB chunks (reserve, np.copyto into the slot, xxh3
  checksum, commit; lookup+lease, copy out, verify), next to a plain ``np.copyto`` between
  two buffers of the same total size in the same run;
- control round trip: ``lookup`` of 128 keys, median and p99;
- events per second the server reports to the coordinator while the engine stores small
  chunks at full speed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from kvatlas.connector.client import CacheClient
from kvatlas.launch.procs import HOST, Proc, free_port, free_ports, launch, python_module
from kvatlas.wire.server_status import decode_status

MIB = 1 << 20
CHUNK_TOKENS = 256
RESULTS = Path(__file__).parent / "results"


def start_server(state: Path, l1_gb: float, coordinator: str | None) -> tuple[Proc, int, int]:
    port, http_port = free_ports(2)
    args = [
        sys.executable, "-m", "kvatlas.cli.server", "--host", HOST,
        "--port", str(port), "--http-port", str(http_port), "--instance-id", f"bench-{port}",
        "--l1-size-gb", str(l1_gb), "--state-dir", str(state), "--log-level", "WARNING",
        "--event-flush-interval-s", "0.2", "--no-l1-warm-restart",
    ]  # fmt: skip
    if coordinator:
        args += ["--coordinator-url", coordinator, "--coordinator-heartbeat-interval-s", "1"]
    return launch(args, name="server", http_port=http_port), port, http_port


def tokens_for(n_chunks: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 50_000, n_chunks * CHUNK_TOKENS, dtype=np.uint32)


def bench_copy(chunks: list[np.ndarray], rounds: int) -> float:
    dst = [np.empty_like(c) for c in chunks]
    for s, d in zip(chunks, dst, strict=True):  # fault the pages in, as the region is
        np.copyto(d, s)
    total = 0.0
    for _ in range(rounds):
        t0 = time.perf_counter()
        for s, d in zip(chunks, dst, strict=True):
            np.copyto(d, s)
        total += time.perf_counter() - t0
    return sum(c.nbytes for c in chunks) * rounds / total


def bench_store_retrieve(
    c: CacheClient, chunks: list[np.ndarray], rounds: int, seed: int = 1000
) -> dict[str, float]:
    n = len(chunks)
    nbytes = sum(x.nbytes for x in chunks)
    store_s = retr_s = retr_nv_s = 0.0
    out = [np.zeros_like(x) for x in chunks]
    for o in out:  # fault the destination's pages in, as bench_copy does for its own
        o.fill(1)
    for r in range(rounds):
        toks = tokens_for(n, seed=seed + r)
        t0 = time.perf_counter()
        res = c.store_chunks(toks, chunks)
        store_s += time.perf_counter() - t0
        assert res.stored == n, res
        t0 = time.perf_counter()
        got = c.retrieve_prefix(toks, out, verify=True)
        retr_s += time.perf_counter() - t0
        assert len(got) == n
        t0 = time.perf_counter()
        got = c.retrieve_prefix(toks, out, verify=False)
        retr_nv_s += time.perf_counter() - t0
        assert np.array_equal(out[-1], chunks[-1])
    total = nbytes * rounds
    return {
        "store_Bps": total / store_s,
        "retrieve_verified_Bps": total / retr_s,
        "retrieve_unverified_Bps": total / retr_nv_s,
    }


def bench_rtt(c: CacheClient, iters: int) -> dict[str, float]:
    toks = tokens_for(128, seed=7)
    hashes = c.hashes(toks)
    for _ in range(20):
        c.lookup(hashes=hashes)
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        c.lookup(hashes=hashes)
        samples.append(time.perf_counter() - t0)
    samples.sort()
    return {
        "lookup128_median_us": statistics.median(samples) * 1e6,
        "lookup128_p99_us": samples[int(len(samples) * 0.99) - 1] * 1e6,
    }


def bench_events(tmp: Path, seconds: float) -> dict[str, float]:
    cport = free_port()
    argv = python_module(
        "kvatlas.cli.coordinator", "--host", HOST, "--port", str(cport), "--log-level", "WARNING"
    )
    with launch(argv, name="coordinator", http_port=cport) as coord:
        proc, port, http_port = start_server(tmp / "state-ev", 0.25, coord.url)
        try:
            status = f"http://127.0.0.1:{http_port}/status"
            with CacheClient(f"tcp://127.0.0.1:{port}", timeout_s=10) as c:
                c.register("bench", "float16", (1, 1, 1), chunk_size=CHUNK_TOKENS)
                small = [np.zeros(4096, np.uint8)] * 64
                stored = 0
                t0 = time.perf_counter()
                seed = 0
                while time.perf_counter() - t0 < seconds:
                    seed += 1
                    stored += c.store_chunks(tokens_for(64, seed=seed), small).stored
                elapsed = time.perf_counter() - t0
            deadline = time.monotonic() + 30
            while True:
                ev = decode_status(httpx.get(status, timeout=5).content).events
                if ev.pending == 0 and ev.buffered_batches == 0:
                    break
                if time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            drained = time.perf_counter() - t0
            return {
                "engine_store_chunks_per_s": stored / elapsed,
                "events_sent": float(ev.sent_events),
                "events_per_s": ev.sent_events / drained,
                "event_batches_sent": float(ev.sent_batches),
                "events_dropped": float(ev.dropped_events),
            }
        finally:
            proc.stop(grace_s=30.0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.server_bench")
    ap.add_argument("--quick", action="store_true", help="smaller, for a smoke run")
    args = ap.parse_args(argv)
    n_chunks, rounds, rtt_iters, ev_s = (16, 2, 200, 2.0) if args.quick else (64, 4, 1000, 5.0)
    rng = np.random.default_rng(0)
    chunks = [rng.integers(0, 255, 4 * MIB, dtype=np.uint8) for _ in range(n_chunks)]
    results: dict[str, Any] = {"chunk_bytes": 4 * MIB, "chunks_per_round": n_chunks}
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        results["np_copyto_Bps"] = bench_copy(chunks, rounds)
        l1_gb = max(0.25, n_chunks * 4 * MIB * 1.2 / (1 << 30))
        proc, port, _ = start_server(tmp / "state", l1_gb, None)
        try:
            with CacheClient(f"tcp://127.0.0.1:{port}", timeout_s=30) as c:
                c.register("bench", "float16", (1, 1, 1), chunk_size=CHUNK_TOKENS)
                bench_store_retrieve(c, chunks, 1, seed=1)  # fault in the region's pages
                results.update(bench_store_retrieve(c, chunks, rounds))
                results.update(bench_rtt(c, rtt_iters))
        finally:
            proc.stop(grace_s=30.0)
        results.update(bench_events(tmp, ev_s))
    copy = results["np_copyto_Bps"]
    rows = [
        ("np.copyto, same process (baseline)", f"{copy / 1e9:.2f} GB/s", "100%"),
        *(
            (label, f"{results[k] / 1e9:.2f} GB/s", f"{results[k] / copy:.0%}")
            for label, k in (
                ("store 4 MiB chunks (copy + xxh3 + commit)", "store_Bps"),
                ("retrieve, checksum verified", "retrieve_verified_Bps"),
                ("retrieve, unverified", "retrieve_unverified_Bps"),
            )
        ),
        ("lookup of 128 keys, median", f"{results['lookup128_median_us']:.0f} us", ""),
        ("lookup of 128 keys, p99", f"{results['lookup128_p99_us']:.0f} us", ""),
        ("engine stores (4 KiB chunks)", f"{results['engine_store_chunks_per_s']:.0f}/s", ""),
        ("events reported to the coordinator", f"{results['events_per_s']:.0f}/s", ""),
    ]
    print("| measure | value | vs copy |\n|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} |")
    results["machine"] = {"cpus": os.cpu_count(), "python": platform.python_version()}
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"server_bench-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(results, indent=2))
    print(f"\nwritten to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
