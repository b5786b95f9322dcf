"""P2P benchmark through real processes on 127.0.0.1 (a coordinator and cache servers
started with their CLIs, CacheClients as engines):

- ``lookup_and_lock`` round trip (median, p99) on the control channel, with the unlock;
- time from a peer's death (SIGKILL in the middle of a slow load) to the requester's
  lookup returning with the fallback;
- end-to-end P2P fetch throughput of 4 MiB chunks through the server (directory lookup,
  lock, transfer, second checksum pass, commit), for tcp and shm.

    python -m bench.p2p_bench [--quick]

Prints a markdown table and writes bench/results/p2p.json. Bounded: ~1-2 minutes.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import zmq

from kvatlas.core.keys import Namespace
from kvatlas.server.p2p.channel import ChannelClient
from kvatlas.wire.p2p_proto import Locked, LookupAndLock, Unlock

# The cluster runner and the launcher it uses are the P2P tests' (tests/p2p, tests/support),
# importable with tests/ on the path as pytest puts it there.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from p2p.cluster import MODEL, chunk_data, cluster, prompt, wait_peers
from support.wait import wait_until

RESULTS = Path(__file__).resolve().parent / "results" / "p2p.json"
MIB = 1 << 20


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def bench_lock_rtt(tmp: Path, iterations: int) -> dict[str, Any]:
    with cluster(tmp, "node-a", "node-b") as (_coord, (a, b)):
        wait_peers([a, b])
        ca = a.client()
        tokens = prompt(8, seed=11)
        assert ca.store_chunks(tokens, chunk_data(8, 4096, seed=11)).stored == 8
        hashes = [bytes(h) for h in ca.hashes(tokens)]
        ns = Namespace(MODEL, ca.ns.kv_rank if ca.ns else 16777472)
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        chan = ChannelClient(ctx, f"tcp://127.0.0.1:{a.p2p_port}")
        lock_s, unlock_s = [], []
        try:
            for _ in range(iterations):
                t0 = time.perf_counter()
                ans = chan.call(LookupAndLock("bench", ns, hashes, 5.0), 5.0)
                t1 = time.perf_counter()
                assert isinstance(ans, Locked) and len(ans.chunks) == 8
                chan.call(Unlock("bench", [c.lease_id for c in ans.chunks]), 5.0)
                unlock_s.append(time.perf_counter() - t1)
                lock_s.append(t1 - t0)
        finally:
            chan.close()
            ctx.term()
    return {
        "chunks_per_lock": 8,
        "iterations": iterations,
        "lock_median_us": statistics.median(lock_s) * 1e6,
        "lock_p99_us": pct(lock_s, 0.99) * 1e6,
        "unlock_median_us": statistics.median(unlock_s) * 1e6,
    }


def bench_death_to_fallback(tmp: Path, repeats: int) -> dict[str, Any]:
    samples = []
    for r in range(repeats):
        extra = {"node-a": ["--p2p-fault-read-delay", "0.05"]}
        with cluster(tmp / f"death{r}", "node-a", "node-b", extra=extra) as (coord, (a, b)):
            wait_peers([a, b])
            ca, cb = a.client(), b.client()
            tokens = prompt(40, seed=20 + r)
            assert ca.store_chunks(tokens, chunk_data(40, 4096, seed=20 + r)).stored == 40
            wait_until(
                lambda ca=ca, t=tokens: coord.held(ca, t).get("node-a") == 40,
                what="the directory lists A's 40 chunks",
            )
            done: list[float] = []
            fallback: list[str] = []

            def lookup(
                cb: Any = cb, t: list[int] = tokens, d: list[float] = done, f: list[str] = fallback
            ) -> None:
                f.append(cb.lookup(t).p2p_fallback)
                d.append(time.monotonic())

            th = threading.Thread(target=lookup)
            th.start()
            wait_until(
                lambda b=b: b.status()["active_p2p_lookup_jobs"] == 1,
                what="B's load started",
                timeout=10,
            )
            time.sleep(0.3)
            killed = time.monotonic()
            a.popen.send_signal(signal.SIGKILL)
            th.join(60)
            assert done and fallback == ["peer_dead"], fallback
            samples.append(done[0] - killed)
    return {
        "repeats": repeats,
        "median_ms": statistics.median(samples) * 1e3,
        "max_ms": max(samples) * 1e3,
    }


def bench_throughput(tmp: Path, transport: str, chunks: int, rounds: int) -> dict[str, Any]:
    size = 4 * MIB
    l1 = (chunks * rounds * size * 1.3) / (1 << 30)
    with cluster(tmp / transport, "node-a", "node-b", transport=transport, l1_gb=l1) as (
        coord,
        (a, b),
    ):
        wait_peers([a, b])
        ca, cb = a.client(timeout_s=120), b.client(timeout_s=120)
        rates, times = [], []
        for r in range(rounds):
            tokens = prompt(chunks, seed=100 + r)
            stored = ca.store_chunks(tokens, chunk_data(chunks, size, seed=100 + r))
            assert stored.stored == chunks, (stored, a.status()["l1"])
            wait_until(
                lambda ca=ca, t=tokens: coord.held(ca, t).get("node-a") == chunks,
                what=f"the directory lists A's {chunks} chunks",
            )
            t0 = time.perf_counter()
            res = cb.lookup(tokens)
            dt = time.perf_counter() - t0
            assert res.peer_chunks == chunks, res
            times.append(dt)
            rates.append(chunks * size / dt / 1e9)
        bytes_read = b.status()["p2p"]["bytes_read"]
    return {
        "transport": transport,
        "chunk_bytes": size,
        "chunks_per_lookup": chunks,
        "rounds": rounds,
        "median_gbps": statistics.median(rates),
        "best_gbps": max(rates),
        "median_lookup_ms": statistics.median(times) * 1e3,
        "bytes_read": bytes_read,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.p2p_bench")
    ap.add_argument("--quick", action="store_true", help="fewer iterations")
    args = ap.parse_args(argv)
    iterations = 200 if args.quick else 1000
    repeats = 2 if args.quick else 3
    chunks, rounds = (8, 2) if args.quick else (16, 3)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        rtt = bench_lock_rtt(tmp / "rtt", iterations)
        death = bench_death_to_fallback(tmp, repeats)
        tput = [bench_throughput(tmp, t, chunks, rounds) for t in ("tcp", "shm")]
    result = {"lookup_and_lock": rtt, "death_to_fallback": death, "throughput": tput}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print("| measure | value |")
    print("|---|---|")
    print(f"| lookup_and_lock RTT median ({rtt['chunks_per_lock']} chunks) |"
          f" {rtt['lock_median_us']:.0f} us |")  # fmt: skip
    print(f"| lookup_and_lock RTT p99 | {rtt['lock_p99_us']:.0f} us |")
    print(f"| unlock RTT median | {rtt['unlock_median_us']:.0f} us |")
    print(f"| peer death -> fallback done, median (max) | {death['median_ms']:.0f}"
          f" ({death['max_ms']:.0f}) ms |")  # fmt: skip
    for t in tput:
        print(f"| P2P fetch {t['chunks_per_lookup']} x 4 MiB via server, {t['transport']} |"
              f" {t['median_gbps']:.2f} GB/s median, {t['best_gbps']:.2f} best"
              f" ({t['median_lookup_ms']:.0f} ms/lookup) |")  # fmt: skip
    print(f"\nwritten to {RESULTS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
