"""LMCache's own server benchmark against `lmcache server` and against `kvatlas server`,
side by side in one run.

Both servers are started with the same flags, LMCache's P2P guide's (LMCache's also get
``--supported-transfer-mode auto --shm-name ... --no-l1-use-lazy``, which it needs for
its CPU transfer modes and kvatlas does not), on 127.0.0.1, and driven by the same
unmodified LMCache 0.5.6 client code from .venv-lmcache:

- **one node**: `lmcache bench server --mode cpu` (its baseline case: per request a cold
  LOOKUP + STORE of 512 tokens, then a warm LOOKUP + RETRIEVE of them, checksums
  compared), once per CPU transfer mode (``--transfer-mode engine_driven``: the client
  gathers into the server's SHM pool; ``lmcache_driven``: the server copies from the
  client's KV tensors mapped over POSIX SHM). Run through `bench/lmcache_bench_probe.py`,
  which calls the CLI's own entry point and also records each call's tokens and the
  client's CPU time. Store / retrieve throughput = KV bytes moved / the call's latency as
  LMCache's bench measures it; a run's figure is the median over its requests.
- **P2P**: two servers and a coordinator per target (LMCache: `lmcache coordinator` and
  NIXL, its default transport, UCX on loopback; kvatlas: `kvatlas coordinator`), once per
  link (``lmcache_side.LINKS``): ``wire``, what crosses hosts (UCX on TCP only; kvatlas'
  ``tcp``, its default), and ``same_host``, each one's shortcut for peers on one host (UCX
  picks cross-memory attach; kvatlas' ``shm``). `bench/lmcache_p2p_probe.py` (LMCache's MP
  client) stores a 4-chunk prefix through node A and retrieves it through node B: B's
  LOOKUP fetches it from A, RETRIEVE hands it to B's engine, bytes compared with A's. Only
  one fleet runs at a time (LMCache's NIXL servers keep a core busy each even when idle,
  which would slow whatever runs beside them); each fleet's idle CPU is measured before
  its load.

Rounds alternate which target goes first; every figure is the median over rounds, and
each ratio (kvatlas / LMCache) is the median of the per-round ratios, so that a noisy
moment of the shared 2-core machine hits one round of both rather than one target.

    python -m bench.lmcache_server_bench [--quick] [--rounds 5] [--requests 10]
        [--targets lmcache,kvatlas] [--modes engine_driven,lmcache_driven] [--no-p2p]
        [--links wire,same_host] [--no-single]

Prints markdown tables and writes bench/results/lmcache_server.json. A target that does
not start, or refuses the bench, is reported with the reason; the other still runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.lmcache_side import (
    LINKS,
    LMCACHE_VENV,
    TARGETS,
    Proc,
    Refused,
    Server,
    ServerSpec,
    lmcache_env,
    p2p_peer_counts,
    start_coordinator,
    start_server,
    tree_cpu_s,
)
from bench.machine import describe

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "lmcache_server.json"
BENCH_PROBE = HERE / "lmcache_bench_probe.py"
P2P_PROBE = HERE / "lmcache_p2p_probe.py"
MODES = ("engine_driven", "lmcache_driven")
NUM_TOKENS = 512
"""`lmcache bench server --num-tokens`: 513 tokens a request, 2 full chunks of 256."""
LAYERS, KV, HEADS, HEAD_SIZE, BLOCKS, BLOCK = 32, 2, 8, 128, 128, 16
SHAPE = f"({KV},{BLOCKS},{BLOCK},{HEADS},{HEAD_SIZE}):float16:{LAYERS}"
"""The bench's default KV shape (32 layers, 8 KV heads of 128, fp16: 128 KiB a token)
with 128 paged blocks instead of 1024, so that each client allocates 256 MiB, not 2 GiB."""
BYTES_PER_TOKEN = LAYERS * KV * HEADS * HEAD_SIZE * 2
MIB = 1 << 20
L1_GB = 1.0
WARMUP_REQUESTS = int(L1_GB * 1024 * MIB // (NUM_TOKENS * BYTES_PER_TOKEN)) + 2
"""One unrecorded run per server that fills its L1 once: LMCache's L1 pages are touched
first by its first stores (kvatlas touches its own at start), which is start-up cost, not
a store's."""
PROBE_TIMEOUT_S = 300.0
ENGINE_CALLS = ("prepare_store", "commit_store", "prepare_retrieve", "commit_retrieve")
"""The engine-driven calls the probe times, each a round trip to the server."""


def rates(lat_ms: list[float], tokens: list[int]) -> list[float]:
    """Bytes per second of each call that moved tokens."""
    return [t * BYTES_PER_TOKEN / (ms / 1e3) for ms, t in zip(lat_ms, tokens, strict=True) if t]


def med(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def single_node_run(
    server: Server, mode: str, start: int, requests: int, out: Path, log_dir: Path
) -> dict[str, Any]:
    """One `lmcache bench server` run through the probe; its figures, or an error."""
    argv = [
        str(LMCACHE_VENV / "bin" / "python"), str(BENCH_PROBE),
        "--server-pid", str(server.proc.pid), "--out", str(out), "--",
        "bench", "server", "--rpc-url", server.rpc_url, "--url", server.http_url,
        "--mode", "cpu", "--transfer-mode", mode, "--num-tokens", str(NUM_TOKENS),
        "--kvcache-shape-spec", SHAPE, "--start", str(start), "--end", str(start + requests),
        "--interval", "0.1", "--quiet",
    ]  # fmt: skip
    log = log_dir / f"bench-{server.target}-{mode}-{start}.log"
    with log.open("wb") as f:
        try:
            subprocess.run(
                argv, stdout=f, stderr=subprocess.STDOUT, env=lmcache_env(),
                timeout=PROBE_TIMEOUT_S, check=False,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            return {"error": f"lmcache bench server did not finish in {PROBE_TIMEOUT_S:.0f} s"}
    if not out.exists():
        return {"error": "no report: " + log.read_text(errors="replace")[-800:]}
    rep = json.loads(out.read_text())
    if rep["exit_code"] or not rep["completed_runs"]:
        why = rep.get("error") or log.read_text(errors="replace")[-800:]
        return {"error": f"exit {rep['exit_code']}: {why}"}
    text = log.read_text(errors="replace")
    lat, tok, cpu = rep["latencies_ms"], rep["op_tokens"], rep["op_cpu_ms"]
    calls = rep.get("call_wall_ms", {})
    faults = rep.get("op_minor_faults", {})

    def server_calls(*names: str) -> float | None:
        """Engine-driven: the medians of the server calls a transfer makes, summed."""
        meds = [med(calls.get(n, [])) for n in names]
        return None if None in meds else sum(m for m in meds if m is not None)

    n = rep["completed_runs"]
    checks = rep["checks"]
    return {
        "requests": n,
        "store_Bps": med(rates(lat.get("cold.store", []), tok.get("cold.store", []))),
        "retrieve_Bps": med(rates(lat.get("warm.retrieve", []), tok.get("warm.retrieve", []))),
        "store_p50_ms": med(lat.get("cold.store", [])),
        "retrieve_p50_ms": med(lat.get("warm.retrieve", [])),
        "lookup_p50_ms": med(lat.get("warm.lookup", [])),
        "warm_full_hits": checks.get("warm_full_hit", {}).get("passed", 0),
        "checksum_match": checks.get("checksum_match", {}).get("passed", 0),
        "checksum_mismatch": checks.get("checksum_match", {}).get("failed", 0),
        # lmcache-driven, the bench asks the server's HTTP /cache/checksums for them
        "checksum_unavailable": checks.get("checksum_available", {}).get("failed", 0),
        "client_cpu_store_ms": med(cpu.get("cold.store", [])),
        "client_cpu_retrieve_ms": med(cpu.get("warm.retrieve", [])),
        "server_calls_store_ms": server_calls("prepare_store", "commit_store"),
        "server_calls_retrieve_ms": server_calls("prepare_retrieve", "commit_retrieve"),
        # each call alone, and the client's minor page faults in a transfer: a slot of
        # the server's pool first touched by this client faults once per page
        **{f"call_{n}_ms": server_calls(n) for n in ENGINE_CALLS},
        "client_faults_store": med(faults.get("cold.store", [])),
        "client_faults_retrieve": med(faults.get("warm.retrieve", [])),
        "client_cpu_s_per_request": rep["load"]["client_cpu_s"] / n,
        "server_cpu_s_per_request": rep["load"]["server_cpu_s"] / n,
        "wall_s_per_request": rep["load"]["wall_s"] / n,
        # LMCache's engine-driven client says which way it moves KV: the server's SHM
        # pool, or pickled over ZeroMQ when the server offers no pool
        "engine_driven_via": "SHM"
        if "mode=SHM" in text
        else "pickle"
        if "mode=pickle" in text
        else "",
    }


def bench_single_node(
    targets: list[str], modes: list[str], rounds: int, requests: int, log_dir: Path
) -> dict[str, Any]:
    servers: dict[str, Server] = {}
    status: dict[str, str] = {}
    for t in targets:
        try:
            servers[t] = start_server(t, ServerSpec(f"bench-{t}", l1_gb=L1_GB), log_dir)
        except OSError as exc:
            status[t] = f"refused: {exc}"
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {m: {t: [] for t in targets} for m in modes}
    try:
        for t, s in list(servers.items()):
            try:
                s.proc.wait_ready()
                status[t] = "ok"
            except Refused as exc:
                status[t] = f"refused: {exc}"
                s.proc.stop()
                del servers[t]
        for t, s in servers.items():  # not counted: every page of the L1 once touched
            warm = single_node_run(  # lmcache-driven: the server copies, the client idles
                s, "lmcache_driven", 1, WARMUP_REQUESTS, log_dir / f"warmup-{t}.json", log_dir
            )
            print(f"  warm-up {t}: {brief(warm)}", flush=True)
        for mi, mode in enumerate(modes):
            for r in range(rounds):
                order = targets if r % 2 == 0 else targets[::-1]
                for t in order:
                    if t not in servers:
                        continue
                    start = 1000 + mi * 100_000 + r * requests
                    row = single_node_run(
                        servers[t], mode, start, requests,
                        log_dir / f"probe-{t}-{mode}-{r}.json", log_dir,
                    )  # fmt: skip
                    row["round"] = r
                    row["load_avg_1m"] = os.getloadavg()[0]
                    runs[mode][t].append(row)
                    print(f"  {mode} round {r} {t}: {brief(row)}", flush=True)
    finally:
        for s in servers.values():
            s.proc.stop()
    return {"status": status, "runs": runs}


def brief(row: dict[str, Any]) -> str:
    if "error" in row:
        return "ERROR " + str(row["error"])[:300].replace("\n", " | ")
    keys = [k for k in row if k.endswith("Bps") and row[k]]
    return ", ".join(f"{k} {row[k] / 1e9:.2f} GB/s" for k in keys)


def p2p_fleet_run(
    target: str, link: str, modes: list[str], repeats: int, log_dir: Path, tag: str
) -> dict[str, Any]:
    """One fleet (coordinator + A + B) of ``target`` whose peers read over ``link``: its
    idle CPU, then the P2P probe once per mode."""
    procs: list[Proc] = []
    out: dict[str, Any] = {}
    try:
        coord, url = start_coordinator(target, log_dir)
        procs.append(coord)
        coord.wait_ready()
        servers = []
        for name in ("a", "b"):
            spec = ServerSpec(
                f"node-{name}-{tag}", l1_gb=L1_GB, coordinator_url=url, p2p=True, link=link
            )
            s = start_server(target, spec, log_dir)
            procs.append(s.proc)
            servers.append(s)
        for s in servers:
            s.proc.wait_ready()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            counts = p2p_peer_counts(servers)
            if all(c != 0 for c in counts):
                break
            time.sleep(0.5)
        else:
            raise Refused(f"the servers never listed each other as P2P peers: {counts}")
        time.sleep(2.0)  # past start-up work (first heartbeats, adapters)
        c0, w0 = [tree_cpu_s(s.proc.pid) for s in servers], time.perf_counter()
        time.sleep(3.0)
        c1, w1 = [tree_cpu_s(s.proc.pid) for s in servers], time.perf_counter()
        out["idle_cpu_pct"] = [100 * (b - a) / (w1 - w0) for a, b in zip(c0, c1, strict=True)]
        for mode in modes:
            out[mode] = p2p_probe(servers[0], servers[1], mode, repeats, log_dir, tag)
    except Refused as exc:
        out["error"] = str(exc)
    finally:
        for p in reversed(procs):
            p.stop()
    return out


def p2p_probe(
    a: Server, b: Server, mode: str, repeats: int, log_dir: Path, tag: str
) -> dict[str, Any]:
    argv = [
        str(LMCACHE_VENV / "bin" / "python"), str(P2P_PROBE), "--a", a.rpc_url,
        "--b", b.rpc_url, "--mode", mode, "--shape", SHAPE, "--chunks", "4",
        "--repeats", str(repeats),
    ]  # fmt: skip
    log = log_dir / f"p2p-{a.target}-{mode}-{tag}.log"
    with log.open("wb") as err:
        try:
            done = subprocess.run(
                argv, stdout=subprocess.PIPE, stderr=err, env=lmcache_env(),
                timeout=PROBE_TIMEOUT_S, check=False,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            return {"error": f"the P2P probe did not finish in {PROBE_TIMEOUT_S:.0f} s"}
    rows = [json.loads(line) for line in done.stdout.decode().splitlines() if line.strip()]
    good = [r for r in rows if "error" not in r and r["p2p_bytes_match"]]
    if not good:
        why = next((r["error"] for r in rows if "error" in r), None)
        return {
            "error": why
            or "no repeat read A's bytes through B: "
            + (json.dumps(rows[-1]) if rows else log.read_text(errors="replace")[-800:]),
            "rows": rows,
        }
    nbytes = 4 * 256 * BYTES_PER_TOKEN

    def m(key: str) -> float:
        return float(statistics.median(r.get(key, 0.0) for r in good))

    return {
        "repeats": len(rows),
        "bytes_match": len(good),
        "p2p_Bps": statistics.median(
            nbytes / ((r["p2p_lookup_ms"] + r["p2p_retrieve_ms"]) / 1e3) for r in good
        ),
        "p2p_fetch_Bps": statistics.median(nbytes / (r["p2p_lookup_ms"] / 1e3) for r in good),
        "p2p_lookup_ms": m("p2p_lookup_ms"),
        "p2p_retrieve_ms": m("p2p_retrieve_ms"),
        "local_Bps": statistics.median(
            nbytes / ((r["local_lookup_ms"] + r["local_retrieve_ms"]) / 1e3)
            for r in good
            if r["local_bytes_match"]
        )
        if any(r["local_bytes_match"] for r in good)
        else None,
        "local_bytes_match": sum(r["local_bytes_match"] for r in good),
        "client_cpu_p2p_ms": m("p2p_lookup_client_cpu_ms") + m("p2p_retrieve_client_cpu_ms"),
        "rows": rows,
    }


def bench_p2p(
    targets: list[str],
    links: list[str],
    modes: list[str],
    rounds: int,
    repeats: int,
    log_dir: Path,
) -> dict[str, Any]:
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        link: {t: [] for t in targets} for link in links
    }
    for r in range(rounds):
        for link in links:
            for t in targets if r % 2 == 0 else targets[::-1]:
                row = p2p_fleet_run(t, link, modes, repeats, log_dir, f"r{r}{link}")
                row["round"] = r
                row["load_avg_1m"] = os.getloadavg()[0]
                runs[link][t].append(row)
                summary = row.get("error") or "; ".join(
                    f"{m}: " + (brief(row[m]) if "error" not in row[m] else row[m]["error"][:200])
                    for m in modes
                )
                idle = row.get("idle_cpu_pct")
                print(f"  p2p round {r} {link} {t}: {summary} (idle CPU {idle})", flush=True)
    return {"runs": runs}


def across_rounds(rows: list[dict[str, Any]], key: str) -> float | None:
    return med([r[key] for r in rows if "error" not in r and r.get(key) is not None])


def ratios_by_round(a: list[dict[str, Any]], b: list[dict[str, Any]], key: str) -> list[float]:
    """b[key] / a[key] in each round both ran, in round order."""
    by_round = {r["round"]: r for r in a if "error" not in r and r.get(key)}
    return [r[key] / by_round[r["round"]][key]
            for r in b if "error" not in r and r.get(key) and r["round"] in by_round]  # fmt: skip


def ratio_by_round(a: list[dict[str, Any]], b: list[dict[str, Any]], key: str) -> float | None:
    """Median over the rounds both ran of b[key] / a[key]."""
    return med(ratios_by_round(a, b, key))


def gbps(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e9:.2f} GB/s"


def num(x: float | None, fmt: str = ".1f") -> str:
    return "-" if x is None else format(x, fmt)


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f} ms"


def summarize(
    results: dict[str, Any], targets: list[str], modes: list[str], links: list[str]
) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    single = results.get("single_node")
    if single:
        for mode in modes:
            runs = single["runs"][mode]
            s: dict[str, Any] = {}
            for t in targets:
                rows = runs[t]
                s[t] = {
                    k: across_rounds(rows, k)
                    for k in ("store_Bps", "retrieve_Bps", "store_p50_ms", "retrieve_p50_ms",
                              "lookup_p50_ms", "client_cpu_store_ms", "client_cpu_retrieve_ms",
                              "server_calls_store_ms", "server_calls_retrieve_ms",
                              "client_cpu_s_per_request", "server_cpu_s_per_request",
                              "client_faults_store", "client_faults_retrieve",
                              *(f"call_{n}_ms" for n in ENGINE_CALLS))
                }  # fmt: skip
                s[t]["rounds_ok"] = sum("error" not in r for r in rows)
                s[t]["requests"] = sum(r.get("requests", 0) for r in rows)
                s[t]["warm_full_hits"] = sum(r.get("warm_full_hits", 0) for r in rows)
                s[t]["checksum_match"] = sum(r.get("checksum_match", 0) for r in rows)
                s[t]["checksum_mismatch"] = sum(r.get("checksum_mismatch", 0) for r in rows)
                s[t]["checksum_unavailable"] = sum(r.get("checksum_unavailable", 0) for r in rows)
                s[t]["errors"] = [r["error"][:500] for r in rows if "error" in r][:2]
                if single["status"].get(t, "ok") != "ok":
                    s[t]["errors"].insert(0, single["status"][t][:500])
            if "lmcache" in targets and "kvatlas" in targets:
                s["ratio_kvatlas_over_lmcache"] = {
                    k: ratio_by_round(runs["lmcache"], runs["kvatlas"], k)
                    for k in ("store_Bps", "retrieve_Bps")
                }
                s["ratios_by_round"] = {
                    k: ratios_by_round(runs["lmcache"], runs["kvatlas"], k)
                    for k in ("store_Bps", "retrieve_Bps")
                }
            summary[f"single_node.{mode}"] = s
    p2p = results.get("p2p") or {}
    for link, mode in [(link, mode) for link in links for mode in modes if p2p]:
        s = {}
        flat: dict[str, list[dict[str, Any]]] = {}
        for t in targets:
            flat[t] = [
                {**r[mode], "round": r["round"]} if mode in r else {"error": r.get("error", "")}
                for r in p2p["runs"][link][t]
            ]
            s[t] = {
                k: across_rounds(flat[t], k)
                for k in ("p2p_Bps", "p2p_fetch_Bps", "p2p_lookup_ms", "p2p_retrieve_ms",
                          "local_Bps", "client_cpu_p2p_ms")
            }  # fmt: skip
            s[t]["bytes_match"] = sum(r.get("bytes_match", 0) for r in flat[t])
            s[t]["local_bytes_match"] = sum(r.get("local_bytes_match", 0) for r in flat[t])
            s[t]["repeats"] = sum(r.get("repeats", 0) for r in flat[t])
            idle = [c for r in p2p["runs"][link][t] for c in r.get("idle_cpu_pct", [])]
            s[t]["idle_cpu_pct_per_server"] = med(idle)
            s[t]["errors"] = [r["error"][:500] for r in flat[t] if r.get("error")][:2]
        if "lmcache" in targets and "kvatlas" in targets:
            s["ratio_kvatlas_over_lmcache"] = {
                k: ratio_by_round(flat["lmcache"], flat["kvatlas"], k)
                for k in ("p2p_Bps", "p2p_fetch_Bps")
            }
        summary[f"p2p.{link}.{mode}"] = s
    return summary


def oneline(errors: list[str]) -> str:
    return " / ".join(errors).replace("\n", " ").replace("|", "/")[:300]


def print_tables(summary: dict[str, Any], targets: list[str]) -> None:
    for key, s in summary.items():
        if key == "load_avg_1m":
            print(
                f"\nmachine load average (1 min) as the runs began: {s['min']:.1f}-{s['max']:.1f}"
            )
            continue
        print(f"\n### {key}\n")
        if key.startswith("single_node"):
            print(
                "| target | store | retrieve | store p50 | retrieve p50 | warm full hits "
                "| checksums ok/bad/none | client CPU in store / retrieve "
                "| client CPU / request | server CPU / request "
                "| server's calls in store / retrieve |"
            )
            print("|---|---|---|---|---|---|---|---|---|---|---|")
            for t in targets:
                v = s[t]
                if not v["rounds_ok"]:
                    print(f"| {t} | failed: {oneline(v['errors'])} ||||||||||")
                    continue
                print(f"| {t} | {gbps(v['store_Bps'])} | {gbps(v['retrieve_Bps'])} "
                      f"| {num(v['store_p50_ms'])} ms | {num(v['retrieve_p50_ms'])} ms "
                      f"| {v['warm_full_hits']}/{v['requests']} "
                      f"| {v['checksum_match']}/{v['checksum_mismatch']}/"
                      f"{v['checksum_unavailable']} "
                      f"| {num(v['client_cpu_store_ms'])} / {num(v['client_cpu_retrieve_ms'])} ms "
                      f"| {ms(v['client_cpu_s_per_request'])} "
                      f"| {ms(v['server_cpu_s_per_request'])} "
                      f"| {num(v['server_calls_store_ms'])} / "
                      f"{num(v['server_calls_retrieve_ms'])} ms |")  # fmt: skip
            print(
                "\n| target | "
                + " | ".join(ENGINE_CALLS)
                + " | client page faults in store / retrieve |"
            )
            print("|---|" + "---|" * (len(ENGINE_CALLS) + 1))
            for t in targets:
                v = s[t]
                if v["rounds_ok"]:
                    print(f"| {t} | "
                          + " | ".join(f"{num(v[f'call_{n}_ms'], '.2f')} ms" for n in ENGINE_CALLS)
                          + f" | {num(v['client_faults_store'], '.0f')} / "
                          f"{num(v['client_faults_retrieve'], '.0f')} |")  # fmt: skip
        else:
            print(
                "| target | P2P: B's engine has A's prefix | fetch into B's L1 (lookup) "
                "| lookup | retrieve | same prefix, local hit | bytes match P2P/local "
                "| idle CPU / server | client CPU |"
            )
            print("|---|---|---|---|---|---|---|---|---|")
            for t in targets:
                v = s[t]
                if v["p2p_Bps"] is None:
                    print(f"| {t} | failed: {oneline(v['errors'])} ||||||||")
                    continue
                print(f"| {t} | {gbps(v['p2p_Bps'])} | {gbps(v['p2p_fetch_Bps'])} "
                      f"| {num(v['p2p_lookup_ms'])} ms | {num(v['p2p_retrieve_ms'])} ms "
                      f"| {gbps(v['local_Bps'])} "
                      f"| {v['bytes_match']}/{v['local_bytes_match']} of {v['repeats']} "
                      f"| {num(v['idle_cpu_pct_per_server'], '.0f')}% "
                      f"| {num(v['client_cpu_p2p_ms'])} ms |")  # fmt: skip
        ratio = s.get("ratio_kvatlas_over_lmcache")
        if ratio:
            print("\nkvatlas / LMCache (median of per-round ratios): "
                  + ", ".join(f"{k} {num(v, '.2f')}x" for k, v in ratio.items()))  # fmt: skip
        for k, rs in s.get("ratios_by_round", {}).items():
            print(f"  {k} by round: " + ", ".join(f"{x:.2f}x" for x in rs))


def _rows(phase: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Every run row of a phase's results (single node: per mode and target)."""
    if not phase:
        return []
    runs = phase["runs"]
    rows = []
    for v in runs.values():
        rows += [r for t in v.values() for r in t] if isinstance(v, dict) else list(v)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.lmcache_server_bench")
    ap.add_argument("--quick", action="store_true", help="1 round, 4 requests, 2 P2P repeats")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=10, help="requests per bench run")
    ap.add_argument("--p2p-rounds", type=int, default=3)
    ap.add_argument("--p2p-repeats", type=int, default=4, help="P2P fetches per fleet")
    ap.add_argument("--targets", default=",".join(TARGETS))
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--links", default=",".join(LINKS), help="P2P transports (see lmcache_side)")
    ap.add_argument("--no-p2p", action="store_true")
    ap.add_argument("--no-single", action="store_true")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.requests, args.p2p_rounds, args.p2p_repeats = 1, 4, 1, 2
    targets = [t for t in args.targets.split(",") if t]
    modes = [m for m in args.modes.split(",") if m]
    links = [x for x in args.links.split(",") if x]
    for name, got, known in (
        ("--targets", targets, TARGETS),
        ("--modes", modes, MODES),
        ("--links", links, LINKS),
    ):
        if not got or any(x not in known for x in got):
            ap.error(f"{name} takes a comma-separated subset of {','.join(known)}")
    if not (LMCACHE_VENV / "bin" / "lmcache").exists():
        print(f"skipped: no LMCache environment at {LMCACHE_VENV} (scripts/lmcache_env.sh)")
        return 0
    results: dict[str, Any] = {
        "machine": describe(),
        "config": {
            "shape": SHAPE, "bytes_per_token": BYTES_PER_TOKEN, "num_tokens": NUM_TOKENS,
            "rounds": args.rounds, "requests": args.requests, "p2p_rounds": args.p2p_rounds,
            "p2p_repeats": args.p2p_repeats, "p2p_bytes": 4 * 256 * BYTES_PER_TOKEN,
            "targets": targets, "modes": modes, "links": links,
        },
    }  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="kvatlas-lmcache-bench-") as tmp:
        log_dir = Path(tmp)
        if not args.no_single:
            print("one node: lmcache bench server --mode cpu", flush=True)
            results["single_node"] = bench_single_node(
                targets, modes, args.rounds, args.requests, log_dir
            )
        if not args.no_p2p:
            print("P2P: store through A, retrieve through B", flush=True)
            results["p2p"] = bench_p2p(
                targets, links, modes, args.p2p_rounds, args.p2p_repeats, log_dir
            )
    results["summary"] = summarize(results, targets, modes, links)
    loads = [
        r["load_avg_1m"]
        for phase in ("single_node", "p2p")
        for r in _rows(results.get(phase))
        if "load_avg_1m" in r
    ]
    results["summary"]["load_avg_1m"] = {"min": min(loads, default=0), "max": max(loads, default=0)}
    print_tables(results["summary"], targets)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
