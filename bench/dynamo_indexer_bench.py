"""kvatlas' device tier beside NVIDIA Dynamo 1.6.1's standalone KV indexer, both fed the
same vLLM KV events at once, in one run (issue #38).

    python -m bench.dynamo_indexer_bench [--blocks 1000000] [--engines 8] [--rounds 3]
        [--lookups 2000] [--probes 256]

Per repeat, fresh processes on 127.0.0.1:

- ``--engines`` vLLM engines, each vLLM 0.34's own `ZmqEventPublisher` (PUB socket and
  replay ROUTER) in this process, its thread encoding and sending every batch (one
  process keeps up: the publishers are done well before either indexer, see
  ``published_s``). vLLM binds only wildcard endpoints; the subclass here binds
  127.0.0.1 as given;
- ``kvatlas coordinator`` with one ``--vllm-kv-events wN=PUB,replay=ROUTER`` per engine,
  asked ``POST /directory/device-lookup``;
- ``python -m dynamo.indexer --workers N=PUB,...`` from .venv-dynamo
  (scripts/dynamo_env.sh; its ``--threads`` left at the default, 4; ``--workers`` takes
  no replay endpoint), asked ``POST /query``. Dynamo binds every interface; nothing
  else here does.

The workload, built before anything is timed: prompts made of shared prefixes (48
system prompts and documents of 256-2,048 tokens, picked with Zipf-like weights) and
unique tails, a quarter of them a further turn of a conversation the engine served
before. An engine publishes what vLLM's block pool would: the prefix's blocks the first
time it serves that prefix, then only the new blocks, their parent the last cached one.
Block hashes are vLLM's own (`hash_block_tokens` with its default ``sha256``, the seed
``vllm-none-hash``), sent as vLLM sends them by default (``VLLM_KV_EVENTS_USE_INT_BLOCK_
HASHES``: the low 64 bits as an integer), with ``token_ids``, ``parent_block_hash``,
``block_size`` 16, 16 blocks per `BlockStored`, 4 `BlockStored` per `KVEventBatch`. One
engine also holds an 8,192-token prompt (512 blocks), the lookup timed.

Measured per indexer: CPU seconds of its process (utime + stime of ``/proc/PID/stat``,
threads and children included) from the first batch published until it has applied the
last (every engine's last batch stores one common prompt; a lookup of it every 20 ms
sees all engines hold it, each indexer polled on its own thread: the latency of those
lookups is reported too); that wall time; its resident memory (VmRSS) then; the answers
for ``--probes`` prompts (published ones whole, cut mid-block, with one token changed,
their prefix with a new tail, new ones) per engine against what vLLM's prefix cache
would hit (the leading blocks whose hashes the engine published); then the latency of
``--lookups`` lookups of the 8,192-token prompt and of an empty prompt (the client's
and HTTP edge's floor), on one keep-alive connection each with pre-encoded requests
(`bench.http_conns.BlockingConn`), kvatlas and Dynamo alternating, which goes first
changing every lookup. The CPU the machine's other processes took meanwhile is
``/proc/stat`` busy time less this process's and both indexers'.

Figures are medians over repeats; each ratio (kvatlas / Dynamo) is the median of the
repeats' ratios. Prints a markdown table and writes bench/results/dynamo_indexer.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import re
import resource
import statistics
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec

from bench.http_conns import BlockingConn, encode_request
from bench.lmcache_side import tree_cpu_s
from bench.machine import describe
from kvatlas.launch.procs import Proc, free_ports, launch, python_module

_env = dict(os.environ)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from vllm.distributed.kv_events import BlockStored, KVEventBatch, ZmqEventPublisher
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import (
        DEFAULT_NONE_HASH_SEED,
        BlockHash,
        get_none_hash_seed,
        hash_block_tokens,
        init_none_hash,
        maybe_convert_block_hash,
    )
# vLLM's import chain sets environment variables; the indexers must not inherit them.
for _name in set(os.environ) - set(_env):
    del os.environ[_name]
os.environ.update(_env)

ROOT = Path(__file__).resolve().parents[1]
DYNAMO_VENV = Path(os.environ.get("KVATLAS_DYNAMO_VENV", ROOT / ".venv-dynamo"))
RESULTS = ROOT / "bench" / "results" / "dynamo_indexer.json"
MODEL = "m"
BLOCK = 16
BLOCKS_PER_EVENT = 16
EVENTS_PER_BATCH = 4
VOCAB = 150_000
PREFIXES = 48
FOLLOW_UP = 0.25
"""Share of requests that are a further turn of a conversation the engine served."""
PROBE_BLOCKS = 512
END_BLOCKS = 16
POLL_S = 0.02
START_TIMEOUT_S = 120.0

_vocab = list(range(VOCAB))
"""Token ids drawn from one list share their int objects: 16M tokens cost 8 bytes each."""


class LoopbackPublisher(ZmqEventPublisher):
    """vLLM's publisher, binding 127.0.0.1 (vLLM connects to non-wildcard hosts)."""

    @staticmethod
    def _is_bind_endpoint(endpoint: str) -> bool:
        return True


# ------------------------------------------------------------------------- workload


@dataclass(eq=False)
class Conversation:
    engine: int
    blocks: list[list[int]]
    """Token ids per full block (prefix blocks shared with every user of the prefix)."""
    hashes: list[BlockHash]
    """vLLM's block hash of each block."""
    prefix_blocks: int


@dataclass(eq=False)
class Engine:
    batches: list[Any] = field(default_factory=list)
    stored: set[int] = field(default_factory=set)
    """The block hashes it published (as sent): what its prefix cache holds."""
    conversations: list[Conversation] = field(default_factory=list)
    prefixes: set[int] = field(default_factory=set)
    blocks: int = 0


@dataclass(eq=False)
class Workload:
    engines: list[Engine]
    probe: list[int]
    """The 8,192-token prompt, held by engine `probe_engine`."""
    probe_engine: int
    end: Any
    """The `BlockStored` every engine publishes last."""
    end_tokens: list[int]
    blocks: int


def fresh(rng: random.Random, n: int) -> list[list[int]]:
    return [rng.choices(_vocab, k=BLOCK) for _ in range(n)]


def chain(parent: BlockHash | None, blocks: Sequence[Sequence[int]]) -> list[BlockHash]:
    out = []
    for b in blocks:
        parent = hash_block_tokens(sha256, parent, b)
        out.append(parent)
    return out


def as_sent(h: BlockHash) -> int:
    sent = maybe_convert_block_hash(h)
    assert isinstance(sent, int), "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0 in the environment"
    return sent


def stored_events(
    parent: BlockHash | None, blocks: list[list[int]], hashes: list[BlockHash]
) -> list[Any]:
    """vLLM's `BlockStored` events for new blocks after ``parent``, 16 blocks each."""
    out = []
    for i in range(0, len(blocks), BLOCKS_PER_EVENT):
        hs = hashes[i : i + BLOCKS_PER_EVENT]
        out.append(
            BlockStored(
                block_hashes=[as_sent(h) for h in hs],
                parent_block_hash=as_sent(parent) if parent is not None else None,
                token_ids=[t for b in blocks[i : i + BLOCKS_PER_EVENT] for t in b],
                block_size=BLOCK,
                lora_id=None,
                medium="GPU",
                lora_name=None,
            )
        )
        parent = hs[-1]
    return out


def build_workload(total: int, n_engines: int, rng: random.Random) -> Workload:
    step = BLOCKS_PER_EVENT
    prefixes = []
    for _ in range(PREFIXES):
        blocks = fresh(rng, rng.randint(1, 8) * step)
        prefixes.append((blocks, chain(None, blocks)))
    weights = [1 / (i + 1) for i in range(PREFIXES)]
    probe_engine = min(3, n_engines - 1)
    engines = [Engine() for _ in range(n_engines)]
    budget = total // n_engines

    def serve(e: int, eng: Engine, events: list[Any], p: int, tail: int) -> Conversation:
        pre_blocks, pre_hashes = prefixes[p]
        if p not in eng.prefixes:
            eng.prefixes.add(p)
            events += stored_events(None, pre_blocks, pre_hashes)
            eng.blocks += len(pre_blocks)
        blocks = fresh(rng, tail)
        hashes = chain(pre_hashes[-1], blocks)
        events += stored_events(pre_hashes[-1], blocks, hashes)
        eng.blocks += tail
        conv = Conversation(e, pre_blocks + blocks, pre_hashes + hashes, len(pre_blocks))
        eng.conversations.append(conv)
        return conv

    probe: list[int] = []
    for e, eng in enumerate(engines):
        events: list[Any] = []
        while eng.blocks < budget:
            if e == probe_engine and not probe and eng.blocks >= budget // 2:
                p = next(i for i in range(PREFIXES) if len(prefixes[i][0]) <= 128)
                conv = serve(e, eng, events, p, PROBE_BLOCKS - len(prefixes[p][0]))
                probe = [t for b in conv.blocks for t in b]
            elif eng.conversations and rng.random() < FOLLOW_UP:
                conv = rng.choice(eng.conversations)
                blocks = fresh(rng, rng.randint(1, 4) * step)
                hashes = chain(conv.hashes[-1], blocks)
                events += stored_events(conv.hashes[-1], blocks, hashes)
                eng.blocks += len(blocks)
                eng.conversations.append(
                    Conversation(e, conv.blocks + blocks, conv.hashes + hashes, conv.prefix_blocks)
                )
            else:
                p = rng.choices(range(PREFIXES), weights)[0]
                serve(e, eng, events, p, rng.randint(1, 4) * step)
        for ev in events:
            eng.stored.update(ev.block_hashes)
        eng.batches = [
            KVEventBatch(ts=time.time(), events=events[i : i + EVENTS_PER_BATCH])
            for i in range(0, len(events), EVENTS_PER_BATCH)
        ]
    end_blocks = fresh(rng, END_BLOCKS)
    end_hashes = chain(None, end_blocks)
    (end,) = stored_events(None, end_blocks, end_hashes)
    for eng in engines:
        eng.stored.update(end.block_hashes)
    return Workload(
        engines,
        probe,
        probe_engine,
        end,
        [t for b in end_blocks for t in b],
        sum(eng.blocks for eng in engines),
    )


def truth(w: Workload, tokens: list[int]) -> list[int]:
    """Per engine, the leading tokens vLLM's prefix cache holds: the leading full blocks
    whose hashes the engine published."""
    hashes = [as_sent(h) for h in chain(None, _blocks_of(tokens))]
    out = []
    for eng in w.engines:
        n = 0
        while n < len(hashes) and hashes[n] in eng.stored:
            n += 1
        out.append(n * BLOCK)
    return out


def _blocks_of(tokens: list[int]) -> list[list[int]]:
    return [tokens[i : i + BLOCK] for i in range(0, len(tokens) - BLOCK + 1, BLOCK)]


def probes(w: Workload, n: int, rng: random.Random) -> list[tuple[str, list[int]]]:
    """The prompts whose answers are checked: kinds in turn, the 8,192-token one first."""
    convs = [c for eng in w.engines for c in eng.conversations]
    out = [("probe", w.probe)]
    for i in range(n - 1):
        c = rng.choice(convs)
        toks = [t for b in c.blocks for t in b]
        kind = ("whole", "cut", "changed", "prefix", "new")[i % 5]
        if kind == "whole":
            toks += rng.choices(_vocab, k=rng.randrange(1, BLOCK))
        elif kind == "cut":
            toks = toks[: rng.randrange(1, len(toks))]
        elif kind == "changed":
            at = rng.randrange(len(toks))
            toks[at] = (toks[at] + 1) % VOCAB
        elif kind == "prefix":
            toks = [t for b in c.blocks[: c.prefix_blocks] + fresh(rng, 3) for t in b]
        else:
            toks = [t for b in fresh(rng, rng.randint(2, 40)) for t in b]
        out.append((kind, toks))
    return out


# ------------------------------------------------------------------------- processes


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def machine_busy() -> tuple[float, float]:
    """CPU seconds the whole machine's processes have spent (user, nice and system time,
    what a process's utime and stime count; interrupts left out), and the seconds its
    hypervisor stole, so far."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    tick = os.sysconf("SC_CLK_TCK")
    user, nice, system, _idle, _iowait, _irq, _softirq, steal = f[:8]
    return (user + nice + system) / tick, steal / tick


def own_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


@dataclass(eq=False)
class Indexer:
    """One indexer process under test and how the bench asks it."""

    name: str
    proc: Proc
    path: str
    body: Callable[[list[int]], bytes]
    answer: Callable[[bytes], dict[int, int]]
    """A lookup's answer as matched tokens per engine (1-based), zeros left out."""

    def request(self, tokens: list[int]) -> bytes:
        return encode_request("POST", self.path, self.body(tokens), "application/json")

    def cpu(self) -> float:
        return tree_cpu_s(self.proc.pid)

    def stop(self) -> None:
        self.proc.stop(grace_s=10.0)


def _kvatlas_answer(body: bytes) -> dict[int, int]:
    hits = msgspec.json.decode(body)["engines"]
    return {int(h["engine"][1:]): h["tokens"] for h in hits if h["tokens"]}


def _dynamo_answer(body: bytes) -> dict[int, int]:
    scores = msgspec.json.decode(body)["scores"]
    return {int(w): sum(ranks.values()) for w, ranks in scores.items() if sum(ranks.values())}


def start_kvatlas(pubs: list[tuple[str, str]]) -> Indexer:
    (port,) = free_ports(1)
    seed = get_none_hash_seed()
    argv = python_module(
        "kvatlas.cli.coordinator", "--host", "127.0.0.1", "--port", str(port),
        "--log-level", "WARNING",
    )  # fmt: skip
    for i, (pub, replay) in enumerate(pubs, 1):
        src = f"w{i}={pub},replay={replay},block_size={BLOCK},hash=sha256"
        argv += [
            "--vllm-kv-events",
            src + (f",seed={seed}" if seed != DEFAULT_NONE_HASH_SEED else ""),
        ]
    proc = launch(argv, name="kvatlas-coordinator", http_port=port, timeout=START_TIMEOUT_S)
    return Indexer(
        "kvatlas",
        proc,
        "/directory/device-lookup",
        lambda toks: msgspec.json.encode({"token_ids": toks}),
        _kvatlas_answer,
    )


def start_dynamo(pubs: list[tuple[str, str]]) -> Indexer:
    (port,) = free_ports(1)
    workers = ",".join(f"{i}={pub}" for i, (pub, _replay) in enumerate(pubs, 1))
    argv = [
        str(DYNAMO_VENV / "bin" / "python"), "-m", "dynamo.indexer", "--port", str(port),
        "--block-size", str(BLOCK), "--model-name", MODEL, "--workers", workers,
    ]  # fmt: skip
    proc = launch(
        argv, name="dynamo-indexer", http_port=port, http_path="/health", timeout=START_TIMEOUT_S
    )
    return Indexer(
        "dynamo",
        proc,
        "/query",
        lambda toks: msgspec.json.encode({"token_ids": toks, "model_name": MODEL}),
        _dynamo_answer,
    )


def ask(conn: BlockingConn, request: bytes) -> bytes:
    status, body = conn.send(request)
    if status != 200:
        raise RuntimeError(f"lookup answered {status}: {body[:300]!r}")
    return body


def kvatlas_counts(ix: Indexer) -> dict[str, float]:
    """kvatlas' own counts of the ingest, summed over engines (its /metrics)."""
    out: dict[str, float] = {}
    text = httpx.get(ix.proc.url + "/metrics", timeout=10).text
    for m in re.finditer(r"^kvatlas_vllm_(events_\w+?|device_\w+?)(?:_total)?\{[^}]*\} (\S+)$",
                         text, re.M):  # fmt: skip
        out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    table = re.search(r"^kvatlas_vllm_device_table_bytes (\S+)$", text, re.M)
    if table:
        out["device_table_bytes"] = float(table.group(1))
    return out


# ------------------------------------------------------------------------- one repeat


def join(w: Workload, pubs: list[Any], ixs: list[Indexer], conns: list[BlockingConn]) -> int:
    """Publish a one-block prompt on every engine until both indexers see it on all of
    them (a SUB that connects late misses what came before; Dynamo's ``--workers`` has
    no replay). Returns the batches it took per engine."""
    rng = random.Random(7)
    deadline = time.monotonic() + 60
    for attempt in itertools.count(1):
        tokens = rng.choices(_vocab, k=BLOCK)
        (ev,) = stored_events(None, [tokens], chain(None, [tokens]))
        for eng, pub in zip(w.engines, pubs, strict=True):
            eng.stored.update(ev.block_hashes)
            pub.publish(KVEventBatch(ts=time.time(), events=[ev]))
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            time.sleep(0.05)
            seen = [ix.answer(ask(c, ix.request(tokens))) for ix, c in zip(ixs, conns, strict=True)]
            if all(len(s) == len(w.engines) for s in seen):
                return attempt
        if time.monotonic() > deadline:
            raise RuntimeError("the indexers never saw every engine's events")
    raise AssertionError("unreachable")


@dataclass(eq=False)
class Poller:
    """One indexer's wait for the last block: a lookup of the prompt every engine stores
    last, every `POLL_S` on its own connection and thread, so that a lookup one indexer
    is slow to answer while it ingests does not delay the other's."""

    ix: Indexer
    conn: BlockingConn
    request: bytes
    engines: int
    t0: float
    cpu0: float
    done_s: float | None = None
    cpu_s: float | None = None
    lookup_ms: list[float] = field(default_factory=list)
    """Latency of each lookup of the 256-token prompt meanwhile (the ingest under way)."""

    def run(self, deadline: float) -> None:
        while time.perf_counter() < deadline:
            time.sleep(POLL_S)
            t = time.perf_counter()
            got = self.ix.answer(ask(self.conn, self.request))
            now = time.perf_counter()
            self.lookup_ms.append((now - t) * 1e3)
            if len(got) == self.engines and all(v == END_BLOCKS * BLOCK for v in got.values()):
                self.done_s, self.cpu_s = now - self.t0, self.ix.cpu() - self.cpu0
                return


def ingest(
    w: Workload, pubs: list[Any], ixs: list[Indexer], conns: list[BlockingConn], timeout: float
) -> dict[str, Any]:
    time.sleep(1.0)
    idle0 = [ix.cpu() for ix in ixs]
    time.sleep(1.0)
    idle = [ix.cpu() - c for ix, c in zip(ixs, idle0, strict=True)]
    busy0, steal0, own0 = *machine_busy(), own_cpu()
    cpu0 = [ix.cpu() for ix in ixs]
    t0 = time.perf_counter()
    for group in itertools.zip_longest(*(eng.batches for eng in w.engines)):
        for pub, batch in zip(pubs, group, strict=True):
            if batch is not None:
                pub.publish(batch)
    for pub in pubs:
        pub.publish(KVEventBatch(ts=time.time(), events=[w.end]))
    pollers = [
        Poller(ix, conn, ix.request(w.end_tokens), len(w.engines), t0, c)
        for ix, conn, c in zip(ixs, conns, cpu0, strict=True)
    ]
    threads = [
        threading.Thread(target=p.run, args=(t0 + timeout,), name=f"poll-{p.ix.name}")
        for p in pollers
    ]
    for t in threads:
        t.start()
    published: float | None = None
    while published is None and time.perf_counter() - t0 < timeout:
        # vLLM's publisher thread marks a batch done once its PUB socket has taken it.
        if all(p._event_queue.unfinished_tasks == 0 for p in pubs):
            published = time.perf_counter() - t0
        time.sleep(0.005)
    for t in threads:
        t.join()
    busy, steal = machine_busy()
    ours = own_cpu() - own0 + sum(ix.cpu() - c for ix, c in zip(ixs, cpu0, strict=True))
    out: dict[str, Any] = {
        "published_s": published,
        "bench_cpu_s": own_cpu() - own0,
        "others_cpu_s": busy - busy0 - ours,
        "steal_s": steal - steal0,
        "wall_s": time.perf_counter() - t0,
    }
    for p, idle_s in zip(pollers, idle, strict=True):
        out[p.ix.name] = {
            "ingest_wall_s": p.done_s,
            "ingest_cpu_s": p.cpu_s,
            "blocks_per_s": w.blocks / p.done_s if p.done_s else None,
            "idle_cpu_pct": 100 * idle_s,
            "rss_bytes": rss_bytes(p.ix.proc.pid),
            "polls": len(p.lookup_ms),
            "poll_ms_p50": statistics.median(p.lookup_ms) if p.lookup_ms else None,
            "poll_ms_max": max(p.lookup_ms, default=None),
        }
    return out


def check(
    w: Workload, probe_set: list[tuple[str, list[int]]], ixs: list[Indexer],
    conns: list[BlockingConn],
) -> dict[str, Any]:  # fmt: skip
    out: dict[str, Any] = {}
    want = [truth(w, toks) for _kind, toks in probe_set]
    for ix, conn in zip(ixs, conns, strict=True):
        wrong = 0
        examples: list[dict[str, Any]] = []
        for (kind, toks), expect in zip(probe_set, want, strict=True):
            got = ix.answer(ask(conn, ix.request(toks)))
            for e, tokens in enumerate(expect, 1):
                if got.get(e, 0) != tokens:
                    wrong += 1
                    if len(examples) < 5:
                        examples.append({"kind": kind, "engine": e, "want": tokens,
                                         "got": got.get(e, 0)})  # fmt: skip
        out[ix.name] = {"wrong": wrong, "answers": len(probe_set) * len(w.engines),
                        "examples": examples}  # fmt: skip
    out["engines_hit_per_probe"] = statistics.mean(sum(1 for t in x if t) for x in want)
    return out


def pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]


def latency(
    w: Workload, ixs: list[Indexer], conns: list[BlockingConn], lookups: int
) -> dict[str, Any]:
    reqs = {
        "probe": [ix.request(w.probe) for ix in ixs],
        "empty": [ix.request([]) for ix in ixs],
    }
    for i, (ix, conn) in enumerate(zip(ixs, conns, strict=True)):
        got = ix.answer(ask(conn, reqs["probe"][i]))
        if got.get(w.probe_engine + 1) != len(w.probe):
            raise RuntimeError(f"{ix.name} does not hold the probe on its engine: {got}")
        for _ in range(20):
            ask(conn, reqs["probe"][i])
            ask(conn, reqs["empty"][i])
    out: dict[str, Any] = {ix.name: {} for ix in ixs}
    busy0, own0 = machine_busy()[0], own_cpu()
    cpu_all0 = [ix.cpu() for ix in ixs]
    for what, rq in reqs.items():
        times: list[list[float]] = [[] for _ in ixs]
        cpu0 = [ix.cpu() for ix in ixs]
        for n in range(lookups):
            order = range(len(ixs)) if n % 2 == 0 else reversed(range(len(ixs)))
            for i in order:
                t = time.perf_counter()
                ask(conns[i], rq[i])
                times[i].append(time.perf_counter() - t)
        for i, ix in enumerate(ixs):
            out[ix.name][f"{what}_ms_p50"] = statistics.median(times[i]) * 1e3
            out[ix.name][f"{what}_ms_p99"] = pct(times[i], 0.99) * 1e3
            out[ix.name][f"{what}_cpu_ms"] = (ix.cpu() - cpu0[i]) / lookups * 1e3
    ours = own_cpu() - own0 + sum(ix.cpu() - c for ix, c in zip(ixs, cpu_all0, strict=True))
    out["others_cpu_s"] = machine_busy()[0] - busy0 - ours
    return out


def one_repeat(w: Workload, args: argparse.Namespace, rng: random.Random) -> dict[str, Any]:
    ports = free_ports(2 * len(w.engines))
    endpoints = [(f"tcp://127.0.0.1:{a}", f"tcp://127.0.0.1:{b}")
                 for a, b in zip(ports[::2], ports[1::2], strict=True)]  # fmt: skip
    pubs = [LoopbackPublisher(0, endpoint=p, replay_endpoint=r) for p, r in endpoints]
    ixs: list[Indexer] = []
    conns: list[BlockingConn] = []
    result: dict[str, Any] = {"load_avg_1m": os.getloadavg()[0]}
    try:
        ixs.append(start_kvatlas(endpoints))
        ixs.append(start_dynamo(endpoints))
        conns = [BlockingConn(ix.proc.http_port) for ix in ixs]
        result["join_batches"] = join(w, pubs, ixs, conns)
        print("  ingesting ...", flush=True)
        result["ingest"] = ingest(w, pubs, ixs, conns, args.timeout)
        for ix in ixs:
            r = result["ingest"][ix.name]
            print(f"  {ix.name}: {r['ingest_cpu_s'] or 0:.2f} CPU s, "
                  f"{r['ingest_wall_s'] or 0:.2f} s to the last block, "
                  f"{r['rss_bytes'] / 2**20:.0f} MiB", flush=True)  # fmt: skip
        result["answers"] = check(w, probes(w, args.probes, rng), ixs, conns)
        wrong = ", ".join(f"{ix.name} {result['answers'][ix.name]['wrong']}" for ix in ixs)
        print(f"  wrong answers: {wrong}", flush=True)
        result["latency"] = latency(w, ixs, conns, args.lookups)
        for ix in ixs:
            r = result["latency"][ix.name]
            print(f"  {ix.name}: lookup p50 {r['probe_ms_p50']:.3f} p99 {r['probe_ms_p99']:.3f} ms,"
                  f" empty p50 {r['empty_ms_p50']:.3f} ms", flush=True)  # fmt: skip
        result["kvatlas_counts"] = kvatlas_counts(ixs[0])
        if len(ixs) > 1:
            log = ixs[1].proc.text()
            result["dynamo_gap_lines"] = log.count("Gap detected")
    finally:
        for c in conns:
            c.close()
        for ix in ixs:
            ix.stop()
            ix.proc.log.unlink(missing_ok=True)
        for p in pubs:
            p.shutdown()
    result["load_avg_1m_after"] = os.getloadavg()[0]
    return result


# ------------------------------------------------------------------------- report

FIGURES = (
    # (label, where in a repeat, unit scale, format)
    ("ingest CPU (s)", ("ingest", "ingest_cpu_s"), 1, ".2f"),
    ("to the last block applied (s)", ("ingest", "ingest_wall_s"), 1, ".2f"),
    ("ingest rate (blocks/s)", ("ingest", "blocks_per_s"), 1, ",.0f"),
    ("resident memory (MiB)", ("ingest", "rss_bytes"), 2**-20, ".0f"),
    ("idle CPU before (%)", ("ingest", "idle_cpu_pct"), 1, ".1f"),
    ("lookup, 256 tokens, while ingesting, p50 (ms)", ("ingest", "poll_ms_p50"), 1, ".2f"),
    ("lookup, 8,192 tokens, p50 (ms)", ("latency", "probe_ms_p50"), 1, ".3f"),
    ("lookup, 8,192 tokens, p99 (ms)", ("latency", "probe_ms_p99"), 1, ".3f"),
    ("lookup CPU in the indexer (ms)", ("latency", "probe_cpu_ms"), 1, ".3f"),
    ("empty lookup, p50 (ms)", ("latency", "empty_ms_p50"), 1, ".3f"),
    ("empty lookup, p99 (ms)", ("latency", "empty_ms_p99"), 1, ".3f"),
    ("wrong answers", ("answers", "wrong"), 1, ".0f"),
)


def _get(r: dict[str, Any], where: tuple[str, str], who: str) -> float | None:
    v = r.get(where[0], {}).get(who, {}).get(where[1])
    return None if v is None else float(v)


def summarize(repeats: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for label, where, scale, _fmt in FIGURES:
        row: dict[str, Any] = {}
        for who in names:
            vals = [v * scale for r in repeats if (v := _get(r, where, who)) is not None]
            row[who] = statistics.median(vals) if vals else None
            row[who + "_range"] = [min(vals), max(vals)] if vals else None
        pairs = [(a, b) for r in repeats
                 if (a := _get(r, where, "kvatlas")) is not None
                 and (b := _get(r, where, "dynamo"))]  # fmt: skip
        row["ratio"] = statistics.median(a / b for a, b in pairs) if pairs else None
        out[label] = row
    out["wrong_total"] = {
        who: sum(r["answers"][who]["wrong"] for r in repeats if "answers" in r) for who in names
    }
    out["answers_checked"] = sum(
        r["answers"]["kvatlas"]["answers"] for r in repeats if "answers" in r
    )
    for key in ("others_cpu_s", "steal_s", "bench_cpu_s", "published_s"):
        vals = [r["ingest"][key] for r in repeats if r.get("ingest", {}).get(key) is not None]
        out["ingest_" + key] = [min(vals), max(vals)] if vals else None
    vals = [r["latency"]["others_cpu_s"] for r in repeats if "latency" in r]
    out["lookups_others_cpu_s"] = [min(vals), max(vals)] if vals else None
    loads = [x for r in repeats for x in (r["load_avg_1m"], r["load_avg_1m_after"])]
    out["load_avg_1m"] = [min(loads), max(loads)]
    return out


def print_table(summary: dict[str, Any], repeats: int) -> None:
    print(
        f"\n| measure (median of {repeats} repeats) | kvatlas | Dynamo 1.6.1 | kvatlas / Dynamo |"
    )
    print("|---|---|---|---|")
    for label, _where, _scale, fmt in FIGURES:
        row = summary[label]
        cells = []
        for who in ("kvatlas", "dynamo"):
            v, rng = row[who], row[who + "_range"]
            if v is None:
                cells.append("n/a")
            elif label == "wrong answers":
                cells.append(f"{summary['wrong_total'][who]} of {summary['answers_checked']:,}")
            else:
                span = f" ({rng[0]:{fmt}}-{rng[1]:{fmt}})" if repeats > 1 else ""
                cells.append(f"{v:{fmt}}{span}")
        ratio = f"{row['ratio']:.2f}x" if row["ratio"] is not None else ""
        print(f"| {label} | {cells[0]} | {cells[1]} | {ratio} |")
    s = summary
    print(f"\nother processes' CPU during ingest: {fmt_range(s['ingest_others_cpu_s'])} s, "
          f"stolen {fmt_range(s['ingest_steal_s'])} s, during lookups "
          f"{fmt_range(s['lookups_others_cpu_s'])} s; this process (the publishers) "
          f"{fmt_range(s['ingest_bench_cpu_s'])} CPU s, every batch sent after "
          f"{fmt_range(s['ingest_published_s'])} s; load average "
          f"{fmt_range(s['load_avg_1m'])}")  # fmt: skip


def fmt_range(r: list[float] | None) -> str:
    if r is None:
        return "n/a"
    return f"{r[0]:.2f}" if abs(r[0] - r[1]) < 0.005 else f"{r[0]:.2f}-{r[1]:.2f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.dynamo_indexer_bench")
    ap.add_argument("--blocks", type=int, default=1_000_000, help="blocks published in all")
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3, help="repeats, each with fresh processes")
    ap.add_argument(
        "--lookups",
        type=int,
        default=2000,
        help="timed lookups per indexer (2,000: a p99 that 300 leaves to noise)",
    )
    ap.add_argument("--probes", type=int, default=256, help="prompts whose answers are checked")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds an ingest may take")
    ap.add_argument("--seed", type=int, default=38)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    if not (DYNAMO_VENV / "bin" / "python").exists():
        print(f"skipped: no Dynamo environment at {DYNAMO_VENV} (scripts/dynamo_env.sh)")
        return 0
    init_none_hash(sha256)
    rng = random.Random(args.seed)
    t = time.perf_counter()
    print(f"building {args.blocks:,} blocks of events for {args.engines} engines ...", flush=True)
    w = build_workload(args.blocks, args.engines, rng)
    batches = sum(len(e.batches) for e in w.engines)
    print(f"  {w.blocks:,} blocks in {batches:,} batches, "
          f"{time.perf_counter() - t:.1f} s", flush=True)  # fmt: skip
    results: dict[str, Any] = {
        "machine": describe(),
        "config": {
            "blocks": w.blocks, "engines": args.engines, "batches": batches,
            "blocks_per_event": BLOCKS_PER_EVENT, "events_per_batch": EVENTS_PER_BATCH,
            "block_size": BLOCK, "hash": "sha256", "none_hash_seed": get_none_hash_seed(),
            "prefixes": PREFIXES, "follow_up": FOLLOW_UP, "probe_tokens": len(w.probe),
            "lookups": args.lookups, "probes": args.probes, "repeats": args.rounds,
            "dynamo_threads": 4, "publishers": "one process, one vLLM publisher thread each",
        },
        "repeats": [],
    }  # fmt: skip
    for n in range(args.rounds):
        print(f"repeat {n + 1} of {args.rounds}", flush=True)
        results["repeats"].append(one_repeat(w, args, rng))
    summary = summarize(results["repeats"], ["kvatlas", "dynamo"])
    results["summary"] = summary
    print_table(summary, args.rounds)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
