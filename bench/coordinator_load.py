"""The load of the coordinator benchmark: ingest bodies and their senders, sequential
lookups with the client's and the server's timeline of each, and the in-process timings
of the token readers and the hash chain.

Owns building the workloads (keys, event batches, bodies) and measuring them over
loopback; each scenario is bounded in time and in count. Must not: start or stop a
process (``coordinator_bench`` does, through ``coordinator_procs``).
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import threading
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np

from bench.http_conns import BlockingConn, Conn, encode_request
from kvatlas.coordinator.host.allocator import keep_freed_heap
from kvatlas.core.events import Entry, EventBatch, KeyBlock
from kvatlas.core.keys import Namespace, ObjectKey, chain_memo, chunk_hash_blob, default_kv_rank
from kvatlas.core.types import EventType, Incarnation, InstanceId, Tier
from kvatlas.wire.events_api import encode_events_json, encode_events_msgpack

_token_digits: ModuleType | None
try:
    from kvatlas.wire import _token_digits
except ImportError:  # built without a C compiler: no block readers to compare
    _token_digits = None

MODEL = "bench-model"
RANK = default_kv_rank(1)
NS = Namespace(MODEL, RANK)

CLIENT_STEPS = ("send_ms", "wait_ms", "read_ms", "unaccounted_ms")
"""The client's side of each request's timeline (see `lookups`)."""
CPU_STEPS = ("client_cpu_ms", "client_queued_ms", "server_cpu_ms", "server_queued_ms")
"""With --cpu-timeline: each side's time on a CPU during a lookup (client: its thread,
kernel work on its behalf included; server: its event loop's thread), and time it was
runnable but queued behind another thread of this VM."""


def pct(lat: list[float], q: float) -> float:
    return float(np.percentile(np.array(lat), q)) * 1000 if lat else float("nan")


# ---- workloads -----------------------------------------------------------------------


def hashes(start: int, n: int) -> list[bytes]:
    ids = np.arange(start, start + n, dtype=">u8")
    raw = np.repeat(ids.view(np.uint8).reshape(n, 8), 4, axis=0).reshape(n, 32)
    return [bytes(r) for r in raw]


def batch(iid: str, seq: int, keys: list[bytes], size: int = 4096) -> EventBatch:
    return EventBatch(
        InstanceId(iid),
        Incarnation(1),
        seq,
        EventType.STORE,
        Tier.L1,
        tuple(Entry(ObjectKey(h, MODEL, RANK), size) for h in keys),
    )


def block_batch(iid: str, seq: int, keys: list[bytes], size: int = 4096) -> EventBatch:
    """The form the servers' sinks send: every entry in one key block."""
    return EventBatch(
        InstanceId(iid),
        Incarnation(1),
        seq,
        EventType.STORE,
        Tier.L1,
        (),
        block=KeyBlock.of(NS, keys, size),
    )


def _bodies(conn_id: int, pool: int, per_req: int, fmt: str, base: int) -> list[bytes]:
    """``pool`` distinct bodies of ``per_req`` batches of 256 new keys for one connection.

    ``fmt``: "json", "msgpack" (key blocks, what servers send) or "msgpack-entries".
    """
    out = []
    seq = 0
    iid = f"bench-{fmt}-x{per_req}-{conn_id}"  # fresh seqs for every scenario
    make = block_batch if fmt == "msgpack" else batch
    for i in range(pool):
        batches: list[EventBatch] = []
        for _ in range(per_req):
            seq += 1
            start = base + (conn_id * pool * per_req + i * per_req + len(batches)) * 256
            batches.append(make(iid, seq, hashes(start, 256)))
        out.append(encode_events_json(batches) if fmt == "json" else encode_events_msgpack(batches))
    return out


async def ingest(
    port: int, fmt: str, per_req: int, conns: int, seconds: float, base: int
) -> dict[str, Any]:
    ctype = "application/json" if fmt == "json" else "application/msgpack"
    # Enough distinct bodies for the scenario's length at the rate each form reaches here.
    rate = {"json": 800_000, "msgpack": 3_000_000}.get(fmt, 1_500_000)
    budget_events = int(rate * seconds)
    pool = max(4, budget_events // (256 * per_req * conns))
    bodies = [_bodies(c, pool, per_req, fmt, base) for c in range(conns)]
    lat: list[float] = []
    done = [0]
    stop_at = time.perf_counter() + seconds

    async def worker(c: int) -> None:
        conn = await Conn.open(port)
        for body in bodies[c]:
            if time.perf_counter() > stop_at:
                break
            t0 = time.perf_counter()
            status, data = await conn.post("/events", body, ctype)
            lat.append(time.perf_counter() - t0)
            if status != 200 or json.loads(data)["applied"] != per_req:
                raise RuntimeError(f"not applied: {status} {data[:200]!r}")
            done[0] += 1
        conn.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(c) for c in range(conns)))
    took = time.perf_counter() - t0
    events = done[0] * per_req * 256
    return {
        "events_per_s": events / took,
        "requests": done[0],
        "p50_ms": pct(lat, 50),
        "p99_ms": pct(lat, 99),
        "events": events,
        "seconds": took,
    }


async def preload(port: int, n: int) -> None:
    conn = await Conn.open(port)
    per = 8192
    for seq, start in enumerate(range(0, n, per), 1):
        body = encode_events_msgpack(
            [block_batch("preload", seq, hashes(10**12 + start, min(per, n - start)))]
        )
        status, data = await conn.post("/events", body, "application/msgpack")
        assert status == 200, data
    conn.close()


def _schedstat(pid: int, tid: int) -> tuple[int, int]:
    """A thread's nanoseconds on a CPU and runnable but queued (kernel scheduler stats:
    neither counts the time the hypervisor took the CPU away)."""
    with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
        ran, queued = f.read().split()[:2]
    return int(ran), int(queued)


def lookups(
    port: int,
    body: bytes | list[bytes],
    seconds: float,
    max_n: int = 20000,
    ctype: str = "application/json",
    method: str = "POST",
    path: str = "/directory/lookup",
    cpu_of: int | None = None,
) -> dict[str, Any]:
    """Sequential lookups for ``seconds`` after 50 for warm-up; ``body``: one body sent
    again and again, or a list of bodies sent in turn (round and round). ``cpu_of``: the
    server's pid, to time both sides' CPU around each lookup (`CPU_STEPS`)."""
    conn = BlockingConn(port)
    me, my_thread = os.getpid(), threading.get_native_id()
    bodies = body if isinstance(body, list) else [body]
    requests = [encode_request(method, path, b, ctype) for b in bodies]
    lat: list[float] = []
    timeline: list[dict[str, float]] = []
    stop_at = time.perf_counter() + seconds
    for i in range(50):  # warm-up
        conn.send(requests[i % len(requests)])
    begun = time.perf_counter()
    sent = 50
    while time.perf_counter() < stop_at and len(lat) < max_n:
        request = requests[sent % len(requests)]
        sent += 1
        if cpu_of is not None:
            client0, server0 = _schedstat(me, my_thread), _schedstat(cpu_of, cpu_of)
        t0 = time.perf_counter()
        conn.timing = {}
        status, data = conn.send(request)
        end = time.perf_counter()
        took = end - t0
        cpu: dict[str, float] = {}
        if cpu_of is not None:
            client1, server1 = _schedstat(me, my_thread), _schedstat(cpu_of, cpu_of)
            cpu = {
                "client_cpu_ms": (client1[0] - client0[0]) / 1e6,
                "client_queued_ms": (client1[1] - client0[1]) / 1e6,
                "server_cpu_ms": (server1[0] - server0[0]) / 1e6,
                "server_queued_ms": (server1[1] - server0[1]) / 1e6,
            }
        lat.append(took)
        assert status == 200, data[:200]
        if "app" in conn.timing:
            # The client's side of the timeline: its send (until the kernel holds the
            # request), its wait for the status line, and its read of the rest; and
            # what of the wait the server does not account for (recv + app): the
            # kernel's delivery both ways and the wake-ups of both processes.
            wait = (conn.first_at - conn.sent_at) * 1000
            timeline.append(
                {
                    "at_s": t0 - begun,
                    "client_ms": took * 1000,
                    "send_ms": (conn.sent_at - t0) * 1000,
                    "wait_ms": wait,
                    "read_ms": (end - conn.first_at) * 1000,
                    "unaccounted_ms": took * 1000
                    - conn.timing.get("recv", 0.0)
                    - conn.timing["app"],
                    **conn.timing,
                    **cpu,
                }
            )
    conn.close()
    out: dict[str, Any] = {"n": len(lat), "p50_ms": pct(lat, 50), "p99_ms": pct(lat, 99)}
    out["_each_ms"] = lat  # for the p99 of all rounds pooled; not written out
    if timeline:  # the coordinator's own time per lookup and its steps (Server-Timing)
        server = [t["app"] / 1000 for t in timeline]
        out |= {"server_p50_ms": pct(server, 50), "server_p99_ms": pct(server, 99)}
        out["_server_each_ms"] = server
        out["steps"] = {
            name: {
                "p50_ms": pct([t[name] / 1000 for t in timeline], 50),
                "p99_ms": pct([t[name] / 1000 for t in timeline], 99),
            }
            for name in timeline[0]
            if name not in ("at_s", "client_ms", *CLIENT_STEPS, *CPU_STEPS)
        }
        out["client_steps"] = {
            name: {
                "p50_ms": pct([t[name] / 1000 for t in timeline], 50),
                "p99_ms": pct([t[name] / 1000 for t in timeline], 99),
            }
            for name in CLIENT_STEPS
        }
        # The tail, request by request: where the slowest 1% spent their time.
        slowest = sorted(timeline, key=lambda t: t["client_ms"])[-max(1, len(timeline) // 100) :]
        out["slowest"] = [{k: round(v, 3) for k, v in t.items()} for t in slowest]
        if cpu_of is not None:
            out["cpu"] = {
                name: {
                    "p50_ms": pct([t[name] / 1000 for t in timeline], 50),
                    "slowest_mean_ms": statistics.mean(t[name] for t in slowest),
                }
                for name in CPU_STEPS
            }
    return out


async def mixed(port: int, lookup_body: bytes, seconds: float, base: int) -> dict[str, Any]:
    lookup_task = asyncio.create_task(
        asyncio.to_thread(lookups, port, lookup_body, seconds + 1, 10**9)
    )
    await asyncio.sleep(0.2)
    got = await ingest(port, "json", 1, 2, seconds, base)
    lk = await lookup_task
    return {
        "ingest_p99_ms": got["p99_ms"],
        "ingest_p50_ms": got["p50_ms"],
        "ingest_events_per_s": got["events_per_s"],
        "lookup_p99_ms": lk["p99_ms"],
        "lookups": lk["n"],
    }


def in_process(repeats: int = 300) -> dict[str, Any]:
    """The two steps of a 32k-token JSON lookup this round changed, timed in this process
    side by side (interleaved, medians over ``repeats``; with the coordinator's malloc
    settings): the JSON token readers (SSE2 and AVX-512 block readers on the same
    bodies) and the hash chain without a memo, through a memo that misses (prompts not
    seen before) and through one that finds every link."""
    keep_freed_heap()
    out: dict[str, Any] = {}
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 2**17, 32768).astype("<u4") for _ in range(repeats + 2)]
    bodies = [
        json.dumps({"token_ids": p.tolist(), "model_name": MODEL}).encode() for p in prompts[:8]
    ]
    spans = [(b, b.index(b"[") + 1, b.index(b"]")) for b in bodies]
    readers: dict[str, Callable[[bytes, int, int], object]] = {}
    layout = getattr(_token_digits, "parse_layout", None)
    if layout is not None:
        readers["sse2"] = layout
        if getattr(_token_digits, "HAVE_AVX512", False):
            readers["avx512"] = lambda b, s, e: layout(b, s, e, True)
    times: dict[str, list[float]] = {name: [] for name in readers}
    for i in range(repeats):
        for name, read in readers.items():
            body, start, end = spans[i % len(spans)]
            t0 = time.perf_counter()
            read(body, start, end)
            times[name].append(time.perf_counter() - t0)
    out["token_readers_us"] = {k: statistics.median(v) * 1e6 for k, v in times.items()}
    memo = chain_memo(256, 32 << 20, os.urandom(32))
    if memo is not None:
        raw = [p.tobytes() for p in prompts]
        seen = raw[-1]
        for _ in range(3):  # admitted on the second miss, found from the third
            chunk_hash_blob(seen, 256, memo=memo)
        chain_times: dict[str, list[float]] = {"no memo": [], "memo, missed": [], "memo, found": []}
        for fresh in raw[:repeats]:
            for name, tokens, with_memo in (
                ("no memo", fresh, None),
                ("memo, missed", fresh, memo),
                ("memo, found", seen, memo),
            ):
                t0 = time.perf_counter()
                chunk_hash_blob(tokens, 256, memo=with_memo)
                chain_times[name].append(time.perf_counter() - t0)
        out["chain_us"] = {k: statistics.median(v) * 1e6 for k, v in chain_times.items()}
    return out
