"""Restarts: how soon a killed cache server serves hits again.

Two parts, each on 127.0.0.1:

1. ``big``: kvatlas' warm restart of a full L1 (``--l1-gb``, 8 GiB by default). The
   benchmark fills L1 through the engine API with distinct chunks (4 MiB each), SIGKILLs
   the server, starts it again with the same flags and measures the wall time from the
   new process's start until it answers ``/healthz`` and until a lookup hits and a
   retrieve returns the chunk's bytes; then it reads every chunk back and compares
   checksums. The server's own figures (chunks kept, seconds spent checking them) come
   from its ``/metrics``; the verification rate is set against this machine's memory
   read bandwidth and one-thread xxh3 rate, measured here over the same amount of
   memory.
2. ``side``: `lmcache server` against `kvatlas server`, each under LMCache's own client
   (``lmcache bench server`` through ``bench/lmcache_bench_probe.py``, engine-driven):
   requests stored, the server SIGKILLed and started again with the same flags, and the
   same requests sent again by a new client (the MP client's KV registration is per
   server process, for both). Reported: the time until the restarted server answers,
   and the share of the requests' tokens its lookups find (hits of the next requests).

    python -m bench.restart_bench [--rounds 3] [--l1-gb 8] [--requests 12] [--part big|side]

Writes bench/results/restart.json.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import xxhash

from bench.lmcache_server_bench import BENCH_PROBE, NUM_TOKENS, SHAPE
from bench.lmcache_side import (
    LMCACHE_VENV,
    TARGETS,
    Refused,
    Server,
    ServerSpec,
    lmcache_env,
    start_server,
)
from bench.machine import describe
from kvatlas.connector.client import CacheClient
from kvatlas.core.checksum import checksum
from kvatlas.launch.procs import HOST, Proc, free_ports
from kvatlas.server.storage.l1_journal import VERIFY_THREADS, discard_kept, kept_region_name

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "restart.json"
GIB, MIB = 1 << 30, 1 << 20
CHUNK_TOKENS = 256
CHUNK_BYTES = 4 * MIB
PROMPT_CHUNKS = 64


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


# ------------------------------------------------------------------------- part 1: big


def memory_rates(nbytes: int) -> dict[str, float]:
    """This machine's memory read bandwidth (numpy sums, on one thread and on as many
    threads as the server checks chunks with) and one-thread xxh3 rate, GB/s, medians of
    3 over ``nbytes`` of touched memory (at most 2 GiB)."""
    a = np.ones(min(nbytes, 2 * GIB), dtype=np.uint8)
    parts = np.array_split(a.view(np.uint64), VERIFY_THREADS)
    read, read_threads, hashed = [], [], []
    with ThreadPoolExecutor(VERIFY_THREADS) as pool:
        for _ in range(3):
            t = time.perf_counter()
            a.view(np.uint64).sum()
            read.append(a.nbytes / (time.perf_counter() - t) / 1e9)
            t = time.perf_counter()
            list(pool.map(np.sum, parts))
            read_threads.append(a.nbytes / (time.perf_counter() - t) / 1e9)
            t = time.perf_counter()
            xxhash.xxh3_64_intdigest(a.data)
            hashed.append(a.nbytes / (time.perf_counter() - t) / 1e9)
    return {
        "read_1thread_GBps": med(read),
        f"read_{VERIFY_THREADS}threads_GBps": med(read_threads),
        "xxh3_1thread_GBps": med(hashed),
    }


def start_kvatlas(work: Path, l1_gb: float, port: int, http_port: int) -> Proc:
    argv = [
        sys.executable, "-m", "kvatlas.cli.server", "--host", HOST, "--port", str(port),
        "--http-port", str(http_port), "--instance-id", "restart-bench",
        "--state-dir", str(work / "state"), "--l1-size-gb", f"{l1_gb:g}",
        "--chunk-size", str(CHUNK_TOKENS), "--lease-s", "30", "--log-level", "INFO",
    ]  # fmt: skip
    return Proc("kvatlas-server", argv, work / f"server-{time.monotonic_ns()}.log", http_port)


def prompt(i: int) -> list[int]:
    rng = np.random.default_rng(1_000 + i)
    return [int(t) for t in rng.integers(0, 50_000, PROMPT_CHUNKS * CHUNK_TOKENS)]


def chunk_bytes(base: np.ndarray, p: int, c: int) -> np.ndarray:
    base[:16] = np.frombuffer(np.array([p, c], dtype=np.int64).tobytes(), dtype=np.uint8)
    return base


def fill(client: CacheClient, prompts: int) -> dict[int, list[int]]:
    """Store ``prompts`` prompts of 64 distinct 4 MiB chunks; their checksums."""
    base = np.random.default_rng(7).integers(0, 255, CHUNK_BYTES, dtype=np.uint8)
    sums: dict[int, list[int]] = {}
    for p in range(prompts):
        tokens = prompt(p)
        sums[p] = []
        for c in range(PROMPT_CHUNKS):
            data = chunk_bytes(base, p, c)
            sums[p].append(checksum(data.data))
            stored = client.store_chunks(tokens[: (c + 1) * CHUNK_TOKENS], [data], first_chunk=c)
            assert stored.refused == 0, stored
        if p % 8 == 7:
            print(f"  filled {p + 1}/{prompts} prompts", flush=True)
    return sums


def metric(text: str, name: str) -> float:
    m = re.search(rf"^kvatlas_server_{name}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else float("nan")


def big_round(work: Path, l1_gb: float) -> dict[str, Any]:
    prompts = int(l1_gb * GIB * 0.97) // (PROMPT_CHUNKS * CHUNK_BYTES)
    work.mkdir(parents=True, exist_ok=True)
    port, http_port = free_ports(2)
    server = start_kvatlas(work, l1_gb, port, http_port).start()
    server.wait_http("/healthz", 120)
    url = f"tcp://{HOST}:{port}"
    with CacheClient(url, timeout_s=60, engine_id="bench") as c:
        c.register("bench", "float16", (2, 2, 8), chunk_size=CHUNK_TOKENS)
        sums = fill(c, prompts)
    server.kill()
    t0 = time.monotonic()
    server = start_kvatlas(work, l1_gb, port, http_port).start()
    try:
        server.wait_http("/healthz", 120)
        ready_s = time.monotonic() - t0
        with CacheClient(url, timeout_s=60, engine_id="bench") as c:
            c.register("bench", "float16", (2, 2, 8), chunk_size=CHUNK_TOKENS)
            first = c.retrieve_prefix(prompt(0)[:CHUNK_TOKENS])
            first_hit_s = time.monotonic() - t0
            assert len(first) == 1, (len(first), server.text()[-3000:])
            assert checksum(first[0].data) == sums[0][0], "first chunk differs"
            wrong = missing = 0
            for p in range(prompts):
                got = c.retrieve_prefix(prompt(p))
                missing += PROMPT_CHUNKS - len(got)
                wrong += sum(checksum(a.data) != s for a, s in zip(got, sums[p], strict=False))
        text = httpx.get(f"http://{HOST}:{http_port}/metrics", timeout=10).text
    finally:
        server.stop()
        discard_kept(kept_region_name("restart-bench", work / "state"))
    kept_bytes = metric(text, "l1_warm_bytes")
    verify_s = metric(text, "l1_warm_verify_seconds")
    return {
        "chunks_stored": prompts * PROMPT_CHUNKS,
        "chunks_kept": metric(text, "l1_warm_chunks"),
        "kept_GiB": kept_bytes / GIB,
        "ready_s": ready_s,
        "first_hit_s": first_hit_s,
        "verify_s": verify_s,
        "verify_GBps": kept_bytes / verify_s / 1e9 if verify_s else float("nan"),
        "chunks_wrong": wrong,
        "chunks_missing": missing,
    }


# ------------------------------------------------------------------------ part 2: side


def probe(server: Server, requests: int, out: Path, log: Path) -> dict[str, Any]:
    """``lmcache bench server`` (engine-driven) over requests [0, requests)."""
    argv = [
        str(LMCACHE_VENV / "bin" / "python"), str(BENCH_PROBE),
        "--server-pid", str(server.proc.pid), "--out", str(out), "--",
        "bench", "server", "--rpc-url", server.rpc_url, "--url", server.http_url,
        "--mode", "cpu", "--transfer-mode", "engine_driven", "--num-tokens", str(NUM_TOKENS),
        "--kvcache-shape-spec", SHAPE, "--start", "0", "--end", str(requests),
        "--interval", "0.05", "--quiet",
    ]  # fmt: skip
    with log.open("wb") as f:
        subprocess.run(
            argv, stdout=f, stderr=subprocess.STDOUT, env=lmcache_env(), timeout=300, check=False
        )
    rep: dict[str, Any] = json.loads(out.read_text())
    return rep


def side_round(target: str, requests: int, work: Path) -> dict[str, Any]:
    spec = ServerSpec(instance_id=f"restart-{target}", l1_gb=1.0, warm_restart=True)
    work.mkdir(parents=True, exist_ok=True)
    server = start_server(target, spec, work)
    try:
        server.proc.wait_ready()
        before = probe(server, requests, work / f"{target}-a.json", work / "probe.log")
        server.proc.stop(signal.SIGKILL)
        t0 = time.monotonic()
        server = start_server(target, spec, work)
        server.proc.wait_ready()
        ready_s = time.monotonic() - t0
        after = probe(server, requests, work / f"{target}-b.json", work / "probe.log")
    finally:
        server.proc.stop()
        discard_kept(kept_region_name(spec.instance_id, work / f"state-{spec.instance_id}"))
    found = after["op_tokens"].get("cold.lookup", [])
    return {
        "stored_before": before["checks"].get("cold_store_succeeded", {}).get("passed", 0),
        "ready_s": ready_s,
        "requests_after": len(found),
        "hit_share_after": sum(found) / (len(found) * NUM_TOKENS) if found else 0.0,
        "full_hits_after": sum(1 for n in found if n >= NUM_TOKENS),
    }


# ------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.restart_bench")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--l1-gb", type=float, default=8.0, help="L1 of the big part")
    ap.add_argument("--requests", type=int, default=12, help="requests of the side part")
    ap.add_argument("--part", choices=("big", "side", "all"), default="all")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    results: dict[str, Any] = {"machine": describe(), "config": vars(args) | {"out": str(args.out)}}
    with tempfile.TemporaryDirectory(prefix="kvatlas-restart-bench-") as tmp:
        work = Path(tmp)
        if args.part in ("big", "all"):
            results["memory"] = memory_rates(int(args.l1_gb * GIB))
            print(f"memory: {results['memory']}", flush=True)
            rows = []
            for r in range(args.rounds):
                print(f"big round {r + 1}/{args.rounds}: fill {args.l1_gb:g} GiB, kill, restart")
                rows.append(big_round(work / f"big-{r}", args.l1_gb))
                print(f"  {rows[-1]}", flush=True)
            results["big"] = rows
        if args.part in ("side", "all") and (LMCACHE_VENV / "bin" / "lmcache").exists():
            side: dict[str, list[dict[str, Any]]] = {t: [] for t in TARGETS}
            for r in range(args.rounds):
                for target in TARGETS:
                    print(f"side round {r + 1}/{args.rounds}: {target}", flush=True)
                    try:
                        row = side_round(target, args.requests, work / f"side-{r}")
                        side[target].append(row)
                    except (Refused, OSError, KeyError, subprocess.SubprocessError) as exc:
                        side[target].append({"error": str(exc)[-400:]})
                    print(f"  {side[target][-1]}", flush=True)
            results["side"] = side
    summarize(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(f"wrote {args.out}")
    return 0


def summarize(results: dict[str, Any]) -> None:
    big = results.get("big", [])
    if big:
        mem = results["memory"]
        print("\nwarm restart of a full L1 (medians of rounds)")
        for key in ("kept_GiB", "ready_s", "first_hit_s", "verify_s", "verify_GBps"):
            print(f"  {key:14s} {med([r[key] for r in big]):8.2f}")
        print(f"  memory        {mem}")
        print(f"  wrong / missing chunks: {sum(r['chunks_wrong'] for r in big)}"
              f" / {sum(r['chunks_missing'] for r in big)}")  # fmt: skip
    for target, rows in results.get("side", {}).items():
        ok = [r for r in rows if "error" not in r]
        if ok:
            ready = med([r["ready_s"] for r in ok])
            share = med([r["hit_share_after"] for r in ok])
            found = f"next requests' tokens found {share:.0%}"
            print(f"{target:8s} restart: answers after {ready:.2f} s, {found}")


if __name__ == "__main__":
    raise SystemExit(main())
