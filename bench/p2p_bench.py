"""P2P benchmark through real processes on 127.0.0.1 (a coordinator and two cache servers
started with their CLIs by ``kvatlas.evaluation.fleet.Fleet``, CacheClients as engines).

The prefix scenario, per transport (tcp, shm, mooncake, nixl): node B gets a
64-chunk prefix of SmolLM2's shape (30 layers x 3 KV heads x 64, fp32, 256-token chunks:
11.25 MiB a chunk, 720 MiB in all) that only node A holds. A fresh prompt (fresh random
bytes) per repeat, medians of the repeats:

- fetch: B's ``lookup`` that pulls the prefix into B's L1 (directory, ``lookup_and_lock``,
  reserve, transfer with the checksum verified as the bytes land, commit, unlock);
- end to end: fetch + the engine holding the verified bytes, through the engine's own load
  path (``KVConnector.fetch_prefix``, as the reference engine calls it): the leased
  chunks as views over its mapping of B's L1, zero-copy. The server
  verified every byte as it landed from A (the trust boundary), so the engine hashes
  them again only with ``--engine-verify`` (the connector's ``verify_checksums``);
- the one copy into a model's cache, timed on its own after that: the reference engine
  makes it inside its prefill (the first attention update copies the views into the
  model's cache), so it is reported next to end to end, as "+ copy", not inside it;
- the per-step breakdown: the server's own timings (``LookupResult.p2p_ms``), the
  engine-API round trip around them, the engine's access, the copy, the release;
- what the processes did meanwhile: CPU time (user + system) of A's and B's servers during
  the fetch, and the minor page faults B's server took then (its L1 slots and its mapping
  of A's region are populated before, so a fetch should take few) and the engine took
  during its copy; CPU time next to the wall time says how many cores a step kept busy;
- every byte checked: the copy of what B's engine held is compared with A's L1 after
  each repeat;
- baselines measured in the same run, interleaved with the repeats: one raw loopback TCP
  stream between two processes (``sendall`` / ``recv_into``, no protocol, no checksum),
  ``np.copyto`` (memcpy), one xxh3 pass, and ``copy_and_checksum`` (the fused pass) over
  the same number of bytes.

Mooncake listens on 0.0.0.0, so its fleet runs in a private network namespace
(``unshare -rn``); a transport that cannot run here is reported with the reason.

The other measures: the ``lookup_and_lock`` round trip (median, p99) with the unlock, and
the time from a peer's death (SIGKILL in the middle of a slow load) to the requester's
lookup returning with the fallback.

    python -m bench.p2p_bench [--quick] [--only prefix|control] [--transports tcp,shm,...]
        [--chunks 64] [--repeats 3] [--engine-verify]

Prints markdown tables and writes bench/results/p2p.json. Memory: two L1 regions of
~770 MiB plus the engine's 720 MiB of buffers and ~360 MiB of baselines at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import zmq

from bench.machine import describe
from bench.transfer_bench import RawSocket
from kvatlas.connector.client import CacheClient
from kvatlas.connector.kv_connector import KVConnector
from kvatlas.core.checksum import checksum, copy_and_checksum
from kvatlas.core.keys import HashContract, Namespace
from kvatlas.evaluation.fleet import Fleet, FleetConfig
from kvatlas.server.p2p.channel import ChannelClient
from kvatlas.transfer.factory import TRANSPORTS, make_transport
from kvatlas.wire.directory_api import LookupRequest
from kvatlas.wire.p2p_proto import Locked, LookupAndLock, Unlock

RESULTS = Path(__file__).resolve().parent / "results" / "p2p.json"
MIB = 1 << 20
MODEL = "smollm2-135m"
LAYOUT = (30, 3, 64)
CHUNK_TOKENS = 256
CHUNK_BYTES = 2 * LAYOUT[0] * LAYOUT[1] * LAYOUT[2] * 4 * CHUNK_TOKENS
"""K and V of 256 tokens in fp32: 11.25 MiB."""
NETNS = frozenset({"mooncake"})
BASELINE_BYTES = 180 * MIB
"""The baselines run over buffers this big, as many times as the prefix needs."""
STEPS = ("local_lookup", "directory", "lock", "reserve", "transfer", "commit", "unlock")


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def _fleet_config(transport: str, l1_mb: float, **kw: Any) -> FleetConfig:
    return FleetConfig(
        nodes=2,
        l1_size_mb=l1_mb,
        p2p_transfer_engine=transport,
        p2p_lookup_timeout_s=10.0,
        p2p_load_timeout_s=60.0,
        heartbeat_interval_s=0.5,
        instance_timeout_s=10.0,
        event_flush_interval_s=0.05,
        snapshot=False,
        start_timeout_s=120.0,
        **kw,
    )


def _client(fleet: Fleet, i: int, timeout_s: float = 120.0) -> CacheClient:
    c = CacheClient(fleet.servers[i].engine_url, timeout_s=timeout_s, engine_id=f"bench-{i}")
    c.register(MODEL, "float32", LAYOUT, chunk_size=CHUNK_TOKENS)
    return c


def _wait_directory(fleet: Fleet, tokens: list[int], chunks: int, timeout_s: float = 30) -> None:
    """Until the directory lists node-0 as holding the ``chunks`` leading chunks."""
    deadline = time.monotonic() + timeout_s
    req = LookupRequest(token_ids=tokens, model_name=MODEL)
    while time.monotonic() < deadline:
        resp = fleet.lookup(req)
        held = {h.instance_id: h.chunks for h in (resp.prefix_holders if resp else [])}
        if held.get("node-0", 0) >= chunks:
            return
        time.sleep(0.02)
    raise RuntimeError(f"the directory did not list node-0's {chunks} chunks in time")


def _store(client: CacheClient, tokens: list[int], chunks: int, rng: np.random.Generator) -> None:
    """Fresh random bytes for every chunk, stored a few chunks at a time (bounded memory)."""
    batch = 8
    for first in range(0, chunks, batch):
        n = min(batch, chunks - first)
        arrays = [
            rng.integers(0, 2**63, CHUNK_BYTES // 8, dtype=np.int64).view(np.uint8)
            for _ in range(n)
        ]
        res = client.store_chunks(tokens, arrays, first_chunk=first)
        if res.stored != n:
            raise RuntimeError(f"node A stored {res.stored} of {n} chunks: {res}")


class Baselines:
    """The machine's limits over ``nbytes``, timed in this process: a raw loopback stream,
    memcpy, one xxh3 pass and the fused copy + xxh3."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.raw = RawSocket(BASELINE_BYTES)
        self.raw.region.prefault()  # as the servers' L1 regions are
        rng = np.random.default_rng(3)
        self.src = rng.integers(0, 2**63, BASELINE_BYTES // 8, dtype=np.int64).view(np.uint8)
        self.dst = np.ones(BASELINE_BYTES, dtype=np.uint8)
        self.samples: dict[str, list[float]] = {
            "stream": [], "memcpy": [], "xxh3": [], "copy_xxh3": []
        }  # fmt: skip

    def _passes(self, one: Callable[[], None]) -> float:
        t0 = time.perf_counter()
        done = 0
        while done < self.nbytes:
            one()
            done += BASELINE_BYTES
        return (time.perf_counter() - t0) * 1000 * self.nbytes / done

    def measure(self) -> None:
        chunk = CHUNK_BYTES
        span = BASELINE_BYTES - BASELINE_BYTES % chunk
        src, dst = self.src, self.dst

        def memcpy() -> None:
            for o in range(0, span, chunk):
                np.copyto(dst[o : o + chunk], src[o : o + chunk])

        def xxh3() -> None:
            for o in range(0, span, chunk):
                checksum(src[o : o + chunk].data)

        def fused() -> None:
            for o in range(0, span, chunk):
                copy_and_checksum(src[o : o + chunk], dst[o : o + chunk])

        self.samples["stream"].append(self._passes(lambda: self.raw.run(chunk)))
        self.samples["memcpy"].append(self._passes(memcpy) * BASELINE_BYTES / span)
        self.samples["xxh3"].append(self._passes(xxh3) * BASELINE_BYTES / span)
        self.samples["copy_xxh3"].append(self._passes(fused) * BASELINE_BYTES / span)

    def medians_ms(self) -> dict[str, float]:
        return {k: statistics.median(v) for k, v in self.samples.items() if v}

    def close(self) -> None:
        self.raw.close()


def bench_prefix(transport: str, chunks: int, repeats: int, verify: bool) -> dict[str, Any]:
    """The prefix scenario for one transport; raises when it cannot run."""
    nbytes = chunks * CHUNK_BYTES
    l1_mb = nbytes / MIB + 48
    rng = np.random.default_rng(15)
    base = Baselines(nbytes)
    runs: list[dict[str, Any]] = []
    try:
        with Fleet(_fleet_config(transport, l1_mb)) as fleet:
            fleet.start()
            fleet.wait_p2p_peers(60.0)
            ca, engine = _client(fleet, 0), _engine(fleet, 1, verify)
            # The model's cache the engine copies into, touched once so that no repeat
            # pays its page faults.
            out = np.ones((chunks, CHUNK_BYTES), dtype=np.uint8)
            try:
                for r in range(repeats):
                    tokens = rng.integers(100, 45000, chunks * CHUNK_TOKENS).tolist()
                    _store(ca, tokens, chunks, rng)
                    _wait_directory(fleet, tokens, chunks)
                    runs.append(_one_fetch(fleet, ca, engine, tokens, out))
                    base.measure()
                    print(
                        f"[p2p-bench] {transport} repeat {r + 1}: fetch"
                        f" {runs[-1]['fetch_ms']:.0f} ms, end to end {runs[-1]['e2e_ms']:.0f} ms,"
                        f" + copy {runs[-1]['e2e_copy_ms']:.0f} ms",
                        flush=True,
                    )
            finally:
                ca.close()
                engine.close()
    finally:
        base.close()
    fetch = statistics.median(r["fetch_ms"] for r in runs)
    e2e = statistics.median(r["e2e_ms"] for r in runs)
    e2e_copy = statistics.median(r["e2e_copy_ms"] for r in runs)
    steps = sorted({k for r in runs for k in r["steps_ms"]})
    return {
        "transport": transport,
        "chunks": chunks,
        "chunk_bytes": CHUNK_BYTES,
        "repeats": repeats,
        "engine_verify": verify,
        "fetch_ms": fetch,
        "fetch_gbps": nbytes / fetch / 1e6,
        "e2e_ms": e2e,
        "e2e_copy_ms": e2e_copy,
        "steps_ms": {k: statistics.median(r["steps_ms"].get(k, 0.0) for r in runs) for k in steps},
        "procs": {k: statistics.median(r["procs"][k] for r in runs) for k in runs[0]["procs"]},
        "baselines_ms": base.medians_ms(),
        "runs": runs,
    }


def _counters(pid: int | None) -> tuple[float, int]:
    """CPU ms (user + system) and minor page faults of process ``pid`` so far."""
    if pid is None:
        return 0.0, 0
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12])
    return ticks * 1000 / os.sysconf("SC_CLK_TCK"), int(fields[7])


def _engine(fleet: Fleet, i: int, verify: bool) -> KVConnector:
    """Node ``i``'s engine side as the reference engine builds it (no model: no torch)."""
    contract = HashContract(MODEL, CHUNK_TOKENS, kv_dtype="float32", kv_layout=LAYOUT)
    client = CacheClient(fleet.servers[i].engine_url, timeout_s=120.0, engine_id=f"engine-{i}")
    engine = KVConnector(contract, client, timeout_s=120.0, verify_checksums=verify)
    if not engine.register():
        raise RuntimeError(f"node {i}'s cache server did not register the engine")
    return engine


def _one_fetch(
    fleet: Fleet,
    ca: CacheClient,
    engine: KVConnector,
    tokens: list[int],
    out: npt.NDArray[np.uint8],
) -> dict[str, Any]:
    chunks = len(out)
    pid_a, pid_b = fleet.servers[0].pid, fleet.servers[1].pid
    a0, b0 = _counters(pid_a), _counters(pid_b)
    t0 = time.perf_counter()
    prefix = engine.fetch_prefix(tokens)
    t1 = time.perf_counter()
    a1, b1, e1 = _counters(pid_a), _counters(pid_b), _counters(os.getpid())
    try:
        st = prefix.stats
        if st.fallback is not None or st.hit_chunks != chunks or st.peer_chunks != chunks:
            raise RuntimeError(
                f"B's engine got {st.hit_chunks} chunks ({st.peer_chunks} from A):"
                f" {st.fallback} {st.detail}"
            )
        for i, view in enumerate(prefix.chunks):
            np.copyto(out[i], view)
        t2 = time.perf_counter()
        e2 = _counters(os.getpid())
    finally:
        prefix.release()
    t3 = time.perf_counter()
    _check_bytes(ca, tokens, out)
    e2e_ms = (t1 - t0) * 1000
    access_ms = st.verify_s * 1000  # the views, and the engine's own hash if asked
    fetch_ms = e2e_ms - access_ms
    steps = dict(st.server_ms)
    steps["engine_rpc"] = fetch_ms - sum(st.server_ms.values())
    steps["engine_access"] = access_ms
    steps["model_copy"] = (t2 - t1) * 1000
    steps["release"] = (t3 - t2) * 1000
    return {
        "fetch_ms": fetch_ms,
        "e2e_ms": e2e_ms,
        "e2e_copy_ms": (t2 - t0) * 1000,
        "steps_ms": steps,
        "procs": {
            "a_cpu_ms": a1[0] - a0[0],
            "b_cpu_ms": b1[0] - b0[0],
            "b_faults": b1[1] - b0[1],
            "engine_copy_faults": e2[1] - e1[1],
        },
    }


def _check_bytes(ca: CacheClient, tokens: list[int], out: npt.NDArray[np.uint8]) -> None:
    """Every byte B's engine holds equals A's chunk."""
    with ca.read_leases(ca.hashes(tokens)) as locs:
        for i, loc in enumerate(locs):
            if loc is None or not np.array_equal(ca.view(loc.offset, loc.size), out[i]):
                raise RuntimeError(f"chunk {i}: B's bytes differ from A's")


def prefix_in_netns(transport: str, chunks: int, repeats: int, verify: bool) -> dict[str, Any]:
    args = [sys.executable, "-m", "bench.p2p_bench", "--child", "--only", "prefix"]
    args += ["--transports", transport, "--chunks", str(chunks), "--repeats", str(repeats)]
    args += ["--engine-verify"] if verify else []
    proc = subprocess.run(
        ["unshare", "-rn", "sh", "-c", 'ip link set lo up && exec "$@"', "sh", *args],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("CHILD "):
            result: dict[str, Any] = json.loads(line[6:])[0]
            return result
    tail = "\n".join(ln for ln in proc.stderr.splitlines() if not ln.startswith("I1"))
    return {
        "transport": transport,
        "error": f"netns run failed (rc {proc.returncode}): {tail[-600:]}",
    }


def run_prefix(
    transport: str, chunks: int, repeats: int, verify: bool, child: bool
) -> dict[str, Any]:
    try:
        make_transport(transport)
    except Exception as exc:
        return {"transport": transport, "error": f"skipped: {exc}"}
    if transport in NETNS and not child:
        return prefix_in_netns(transport, chunks, repeats, verify)
    try:
        return bench_prefix(transport, chunks, repeats, verify)
    except Exception as exc:  # one failing transport must not hide the others
        return {"transport": transport, "error": repr(exc)}


# ------------------------------------------------------------------ control-plane measures


def bench_lock_rtt(iterations: int) -> dict[str, Any]:
    with Fleet(_fleet_config("tcp", 64.0)) as fleet:
        fleet.start()
        fleet.wait_p2p_peers(60.0)
        ca = _client(fleet, 0)
        tokens = list(range(8 * CHUNK_TOKENS))
        data = [np.full(4096, i, dtype=np.uint8) for i in range(8)]
        assert ca.store_chunks(tokens, data).stored == 8
        hashes = ca.hashes(tokens)
        ns = ca.ns or Namespace(MODEL, 16777472)
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        chan = ChannelClient(ctx, f"tcp://127.0.0.1:{fleet.servers[0].p2p_port}")
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
            ca.close()
    return {
        "chunks_per_lock": 8,
        "iterations": iterations,
        "lock_median_us": statistics.median(lock_s) * 1e6,
        "lock_p99_us": pct(lock_s, 0.99) * 1e6,
        "unlock_median_us": statistics.median(unlock_s) * 1e6,
    }


def bench_death_to_fallback(repeats: int) -> dict[str, Any]:
    samples = []
    slow_owner = (("--p2p-fault-read-delay-s", "0.05"),)
    for r in range(repeats):
        with Fleet(_fleet_config("tcp", 64.0, server_args=slow_owner)) as fleet:
            fleet.start()
            fleet.wait_p2p_peers(60.0)
            ca, cb = _client(fleet, 0), _client(fleet, 1)
            tokens = [r * 1_000_000 + i for i in range(40 * CHUNK_TOKENS)]
            data = [np.full(4096, i, dtype=np.uint8) for i in range(40)]
            assert ca.store_chunks(tokens, data).stored == 40
            _wait_directory(fleet, tokens, 40)
            done: list[float] = []
            fallback: list[str] = []

            def lookup(
                cb: CacheClient = cb,
                t: list[int] = tokens,
                d: list[float] = done,
                f: list[str] = fallback,
            ) -> None:
                f.append(cb.lookup(t).p2p_fallback)
                d.append(time.monotonic())

            th = threading.Thread(target=lookup)
            th.start()
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                st = fleet.server_status(1)
                if st is not None and st.active_p2p_lookup_jobs == 1:
                    break
                time.sleep(0.01)
            time.sleep(0.3)
            killed = time.monotonic()
            fleet.kill(fleet.servers[0])
            th.join(60)
            assert done and fallback == ["peer_dead"], fallback
            samples.append(done[0] - killed)
            ca.close()
            cb.close()
    return {
        "repeats": repeats,
        "median_ms": statistics.median(samples) * 1e3,
        "max_ms": max(samples) * 1e3,
    }


# ------------------------------------------------------------------ report


def prefix_table(rows: Sequence[dict[str, Any]]) -> str:
    ok = [r for r in rows if "error" not in r]
    lines = [
        "| transport | fetch | fetch GB/s | end to end | + copy into a model's cache |"
        " stream (same run) | memcpy (same run) | fetch / stream | fetch / memcpy |"
        " end to end / stream |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['transport']} | {r['error']} | | | | | | | | |")
            continue
        b = r["baselines_ms"]
        lines.append(
            f"| {r['transport']} | {r['fetch_ms']:.0f} ms | {r['fetch_gbps']:.2f} |"
            f" {r['e2e_ms']:.0f} ms | {r['e2e_copy_ms']:.0f} ms | {b['stream']:.0f} ms |"
            f" {b['memcpy']:.0f} ms | {r['fetch_ms'] / b['stream']:.2f} |"
            f" {r['fetch_ms'] / b['memcpy']:.2f} | {r['e2e_ms'] / b['stream']:.2f} |"
        )
    if ok:
        keys = [*STEPS, "engine_rpc", "engine_access", "model_copy", "release"]
        extra = sorted({k for r in ok for k in r["steps_ms"]} - set(keys))
        lines += _by_transport(
            "Per-step breakdown (medians, ms):", "step", ok, [*keys, *extra],
            lambda r, k: f"{r['steps_ms'].get(k, 0.0):.1f}",
        )  # fmt: skip
        lines += _by_transport(
            "Baselines over the same bytes, same run (medians, ms):", "baseline", ok,
            ["stream", "memcpy", "xxh3", "copy_xxh3"],
            lambda r, k: f"{r['baselines_ms'].get(k, 0.0):.0f}",
        )  # fmt: skip
        lines += _by_transport(
            "The processes during the fetch (medians; the copy: the engine's):", "counter", ok,
            ["a_cpu_ms", "b_cpu_ms", "b_faults", "engine_copy_faults"],
            lambda r, k: f"{r['procs'][k]:.0f}",
        )  # fmt: skip
    return "\n".join(lines)


def _by_transport(
    title: str,
    what: str,
    rows: Sequence[dict[str, Any]],
    keys: Sequence[str],
    cell: Callable[[dict[str, Any], str], str],
) -> list[str]:
    """A titled markdown table: a line per key, a column per transport's row."""
    lines = ["", title, "", f"| {what} | " + " | ".join(r["transport"] for r in rows) + " |"]
    lines.append("|---|" + "---|" * len(rows))
    lines += [f"| {k} | " + " | ".join(cell(r, k) for r in rows) + " |" for k in keys]
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.p2p_bench", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--quick", action="store_true", help="fewer iterations and repeats")
    ap.add_argument("--only", choices=("prefix", "control"), help="run one part only")
    ap.add_argument("--transports", default=",".join(TRANSPORTS), help="prefix scenario's")
    ap.add_argument("--chunks", type=int, default=64, help="chunks of 11.25 MiB in the prefix")
    ap.add_argument("--repeats", type=int, default=3, help="fresh prompts per transport")
    ap.add_argument(
        "--engine-verify",
        action="store_true",
        help="the engine hashes the leased chunks again (the connector's verify_checksums)",
    )
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    transports = [t for t in args.transports.split(",") if t]
    if args.child:
        out = [
            run_prefix(t, args.chunks, args.repeats, args.engine_verify, child=True)
            for t in transports
        ]
        print("CHILD " + json.dumps(out), flush=True)
        return 0
    result: dict[str, Any] = {"machine": describe()}
    if args.only != "control":
        result["prefix"] = [
            run_prefix(t, args.chunks, args.repeats, args.engine_verify, child=False)
            for t in transports
        ]
    if args.only != "prefix":
        result["lookup_and_lock"] = bench_lock_rtt(200 if args.quick else 1000)
        result["death_to_fallback"] = bench_death_to_fallback(2 if args.quick else 3)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    if "prefix" in result:
        print(
            f"\nPrefix of {args.chunks} x {CHUNK_BYTES / MIB:g} MiB from a peer, median of"
            f" {args.repeats} fresh prompts:\n"
        )
        print(prefix_table(result["prefix"]))
    if "lookup_and_lock" in result:
        rtt, death = result["lookup_and_lock"], result["death_to_fallback"]
        print("\n| measure | value |\n|---|---|")
        print(f"| lookup_and_lock RTT median ({rtt['chunks_per_lock']} chunks) |"
              f" {rtt['lock_median_us']:.0f} us |")  # fmt: skip
        print(f"| lookup_and_lock RTT p99 | {rtt['lock_p99_us']:.0f} us |")
        print(f"| unlock RTT median | {rtt['unlock_median_us']:.0f} us |")
        print(f"| peer death -> fallback done, median (max) | {death['median_ms']:.0f}"
              f" ({death['max_ms']:.0f}) ms |")  # fmt: skip
    print(f"\nwritten to {RESULTS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
