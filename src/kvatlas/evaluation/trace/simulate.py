"""The cache policies over a Mooncake trace, simulated in process: hit rates, prefill time,
modelled TTFT, P2P reads and load spread per policy, and the capacity sweep of the FAST'25
paper's Figure 9.

Owns the offline side of ``kvatlas bench trace``: the trace's own time, no sockets, no
threads, no clocks (``main`` alone times its runs). Everything is counted in the trace's
unit, blocks of ``trace.block_tokens`` tokens (512): a node's capacity is
``capacity_tokens // block_tokens`` blocks, every block taking a full block of capacity,
and a request's hit is the tokens of its leading blocks found (the last, partial block
counting its own tokens). Equal hash ids are equal prefixes, so a leading run is a prefix.

Policies (``POLICIES``), all over the same requests in arrival order:

- ``theoretical``: infinite capacity; a request hits its leading blocks that any earlier
  request had (the trace's maximum);
- ``local-random``, ``local-least-loaded``: ``nodes`` nodes, each its own LRU of
  ``capacity_tokens``; a request goes to a seeded random node / the node with the least
  outstanding prefill (seconds of queued work under the cost model; ties in turn) and hits
  that node's leading blocks;
- ``local-prefix``: prefix-aware routing over local caches, as ``kvatlas router --policy
  kv`` (P2P off) scores it, and as llm-d's precise prefix scorer beside its load scorer and
  Mooncake's conductor (estimated TTFT) weigh it: a node costs the tokens it would compute
  (prompt minus its leading local match) plus its outstanding work in prefill-token
  equivalents; near-ties (within ``tie`` x the prompt) go to the longest local match, then
  the least work, then in turn. Hit: that node's leading blocks. The paper's local setup;
- ``local-prefix-only``: the longest local match alone (ties: least work, then in turn).
  Shown for why load must weigh in: on the conversation trace nearly every request starts
  with the same block (id 0), so the first node to hold it matches longest for ever and
  takes every request (load spread 10 of 10 nodes, TTFTs of hours);
- ``global``: kvatlas with P2P: the same nodes and LRUs, a request hits the longest leading
  run of blocks that ANY node holds; the blocks its node lacks are read from a peer (the
  holder's copy is refreshed, as the read locks it) and stored on its node, as kvatlas'
  servers do. Routing as ``kvatlas router --policy kv-p2p`` scores it: a node costs its
  outstanding work in prefill-token equivalents plus ``p2p_weight`` per token it must read
  from a peer (the compute term is the same for every node, the fleet's hit being global);
  nodes within ``tie`` x the prompt of the cheapest are near-ties, taken by the longest
  local match, then the least work, then in turn;
- ``pooled-lru``: one ideal LRU of ``nodes x capacity_tokens`` (the paper's pooled cache),
  requests placed least-loaded for the TTFT model. The issue's target is ``global`` at
  >= 95% of its hit rate.

LRU: a request refreshes (and stores) its blocks tail first, so its first block is the
most recent and a prefix is never evicted before its own continuation (vLLM frees a
request's blocks in reverse for the same reason; the other order would evict the shared
head of a conversation first and strand its tail). Capacity is checked after the request's
blocks are stored.

Time model (prefill nodes only, as the paper's prefill pool; decode is not modelled): each
node serves its requests one at a time in arrival order; a request waits for its node's
earlier work, then reads its peer blocks (``global``: tokens x KV bytes per token /
``p2p_bytes_per_s``; the node is held meanwhile, the engine waiting on its server), then
prefills its uncached tokens. TTFT = wait + read + prefill. Prefill of tokens ``c..n`` with
``c`` cached costs ``(n - c) * s_per_token + s_per_token_ctx * (n**2 - c**2) / 2`` (a
linear part and attention's part, which grows with the context).

Cost profiles (``PROFILES``; assumptions, not measurements of this project):

- ``llama3-70b-8xa800``: LLaMA3-70B, tensor-parallel on 8 x A800 (the paper's setup).
  The paper gives no per-token prefill rate, so it is derived: 2 x 70.6e9 FLOPs per token
  for the weights and 4 x 80 layers x 8192 x position FLOPs for attention, on 8 x 312 bf16
  TFLOPS at an assumed 40% utilisation (~1.0 PFLOPS): 1.41e-4 s per token plus 2.6e-9 s
  per token per position of context (a 12k-token prompt: ~1.9 s, ~6.3k tokens/s). KV: 80
  layers x K and V x 8 KV heads x 128 x 2 bytes = 320 KiB per token. At 3.3 requests/s of
  12k tokens the trace loads 10 such nodes to ~60% without a cache.
- ``smollm2-cpu``: SmolLM2-135M on this project's CPU, fitted to docs/benchmarks.md's
  reference-engine TTFTs (1,024 tokens 2.0 s, 4,096 tokens 11.5 s): 1.67e-3 s per token plus
  5.6e-7 s per token per position; fp32 KV, 45 KiB per token. The trace overloads it by far
  (its queues grow all hour): a profile for short windows and for the real replay's
  engines.

P2P default: 25 GB/s (one 200 Gb/s RDMA NIC; Mooncake's nodes have more).

Speed, measured on this 2-core machine (one core used): the full conversation trace
(12,031 requests, 288,500 blocks), all seven policies at 10 nodes x 3M tokens, in 1.9 s
(0.2 to 0.5 s per policy; the prefix policies and ``global`` walk every node's cache per
request); the capacity sweep of three policies at eight capacities in 9 s.

Must not: open sockets, start threads, read clocks (but ``main``'s timing), or import a
process's code: it models kvatlas, it does not run it (the real replay does).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Final, Literal

import numpy as np

from kvatlas.core.errors import ConfigError
from kvatlas.evaluation.trace.mooncake import (
    DEFAULT_BLOCK_TOKENS,
    Trace,
    bundled_trace_path,
    load_trace,
)

Say = Callable[[str], None]

Policy = Literal[
    "theoretical",
    "local-random",
    "local-least-loaded",
    "local-prefix-only",
    "local-prefix",
    "global",
    "pooled-lru",
]
POLICIES: Final[tuple[Policy, ...]] = (
    "theoretical",
    "local-random",
    "local-least-loaded",
    "local-prefix-only",
    "local-prefix",
    "global",
    "pooled-lru",
)
SWEEP_POLICIES: Final[tuple[Policy, ...]] = ("local-prefix", "global", "pooled-lru")


@dataclass(frozen=True, slots=True)
class CostProfile:
    """Prefill cost of one node (see the module docstring for where the numbers come from)."""

    name: str
    s_per_token: float
    """Seconds per prefilled token, the linear part."""
    s_per_token_ctx: float
    """Extra seconds per prefilled token per token of context before it (attention)."""
    kv_bytes_per_token: int
    """KV bytes of one token (what a P2P read moves)."""

    def prefill_s(self, cached: int, total: int) -> float:
        """Seconds to prefill tokens ``cached..total`` of a prompt of ``total`` tokens."""
        return (total - cached) * self.s_per_token + self.s_per_token_ctx * (
            total * total - cached * cached
        ) / 2.0


PROFILES: Final[dict[str, CostProfile]] = {
    p.name: p
    for p in (
        CostProfile("llama3-70b-8xa800", 1.41e-4, 2.6e-9, 80 * 2 * 8 * 128 * 2),
        CostProfile("smollm2-cpu", 1.67e-3, 5.6e-7, 30 * 2 * 3 * 64 * 4),
    )
}


@dataclass(frozen=True, slots=True)
class SimConfig:
    """One simulated fleet."""

    nodes: int = 10
    """Prefill nodes, each with its own cache."""
    capacity_tokens: int = 3_000_000
    """Cache capacity of one node, in tokens (the paper's unit)."""
    profile: CostProfile = PROFILES["llama3-70b-8xa800"]
    """Prefill cost model."""
    p2p_bytes_per_s: float = 25e9
    """Rate of one peer read (``global``)."""
    p2p_weight: float | None = None
    """Prefill tokens one token read from a peer costs in ``global``'s routing; None: the
    cost model's ratio, (KV bytes per token / P2P rate) / seconds per token, as the
    router measures it."""
    tie: float = 0.25
    """``global``'s near-tie band, a share of the prompt (``kvatlas router --weight-tie``)."""
    seed: int = 0
    """Seed of ``local-random``."""

    def checked(self) -> SimConfig:
        if self.nodes < 1:
            raise ConfigError(f"--nodes must be >= 1, got {self.nodes}")
        if self.capacity_tokens < 1:
            raise ConfigError(f"--capacity-tokens must be >= 1, got {self.capacity_tokens}")
        if self.p2p_bytes_per_s <= 0:
            raise ConfigError(f"the P2P rate must be > 0, got {self.p2p_bytes_per_s}")
        return self

    @property
    def read_s_per_token(self) -> float:
        return self.profile.kv_bytes_per_token / self.p2p_bytes_per_s

    @property
    def effective_p2p_weight(self) -> float:
        if self.p2p_weight is not None:
            return self.p2p_weight
        return self.read_s_per_token / self.profile.s_per_token


@dataclass(frozen=True, slots=True)
class PolicyResult:
    """One policy over one trace."""

    policy: str
    requests: int
    input_tokens: int
    hit_tokens: int
    hit_rate: float
    """Cached tokens over prompt tokens."""
    prefill_s: float
    """Prefill seconds spent, all nodes."""
    prefill_s_uncached: float
    """Prefill seconds without any cache."""
    prefill_saved: float
    """Share of ``prefill_s_uncached`` the cache saved."""
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    p2p_tokens: int
    p2p_bytes: int
    load_spread: float
    """Max over mean of the tokens each node prefilled (1.0: even)."""
    node_prefill_tokens: tuple[int, ...]
    hit_rate_per_minute: tuple[float, ...]
    """Token hit rate per minute of the trace (nan: no request that minute)."""
    share_of_theoretical: float = float("nan")
    """``hit_rate`` over the theoretical maximum's (filled by ``simulate_all``)."""
    ttft_s: tuple[float, ...] = field(default=(), repr=False)
    """Every request's modelled TTFT, in trace order (for the distributions' plots)."""


def _lead(cache: OrderedDict[int, None] | set[int] | dict[int, int], ids: Sequence[int]) -> int:
    n = 0
    for h in ids:
        if h not in cache:
            break
        n += 1
    return n


def _store(
    cache: OrderedDict[int, None], ids: Sequence[int], cap: int, holders: dict[int, int] | None
) -> None:
    """Refresh or insert ``ids`` tail first, then evict down to ``cap`` blocks."""
    for h in reversed(ids):
        if h in cache:
            cache.move_to_end(h)
        else:
            cache[h] = None
            if holders is not None:
                holders[h] = holders.get(h, 0) + 1
    while len(cache) > cap:
        old, _ = cache.popitem(last=False)
        if holders is not None:
            left = holders[old] - 1
            if left:
                holders[old] = left
            else:
                del holders[old]


def _least_loaded(loads: list[float], turn: int) -> int:
    n = len(loads)
    return min(range(n), key=lambda i: (loads[i], (i - turn) % n))


class _Fleet:
    """The caches of one policy and the routing that goes with it."""

    def __init__(self, policy: Policy, cfg: SimConfig, block_tokens: int) -> None:
        self.policy = policy
        self.cfg = cfg
        self.bt = block_tokens
        self.n = cfg.nodes
        self.cap = cfg.capacity_tokens // block_tokens
        if self.cap < 1 and policy != "theoretical":
            raise ConfigError(
                f"a node's capacity ({cfg.capacity_tokens} tokens) holds no"
                f" {block_tokens}-token block"
            )
        self.caches: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(self.n)]
        self.pooled: OrderedDict[int, None] = OrderedDict()
        self.seen: set[int] = set()
        self.holders: dict[int, int] = {}
        self.rng = random.Random(cfg.seed)
        self.weight = cfg.effective_p2p_weight

    def tokens(self, blocks: int, ids: Sequence[int], length: int) -> int:
        return length if blocks >= len(ids) else blocks * self.bt

    def serve(
        self, ids: Sequence[int], length: int, loads: list[float], turn: int
    ) -> tuple[int, int, int]:
        """Route one request and update the caches: (node, hit blocks, peer blocks)."""
        p = self.policy
        if p == "theoretical":
            hit = _lead(self.seen, ids)
            self.seen.update(ids)
            return _least_loaded(loads, turn), hit, 0
        if p == "pooled-lru":
            hit = _lead(self.pooled, ids)
            _store(self.pooled, ids, self.cap * self.n, None)
            return _least_loaded(loads, turn), hit, 0
        if p in {"local-random", "local-least-loaded"}:
            x = self.rng.randrange(self.n) if p == "local-random" else _least_loaded(loads, turn)
            hit = _lead(self.caches[x], ids)
            _store(self.caches[x], ids, self.cap, None)
            return x, hit, 0
        matches = [_lead(c, ids) for c in self.caches]
        if p == "local-prefix-only":
            best = max(matches)
            x = min(
                (i for i in range(self.n) if matches[i] == best),
                key=lambda i: (loads[i], (i - turn) % self.n),
            )
            _store(self.caches[x], ids, self.cap, None)
            return x, best, 0
        if p == "local-prefix":
            # the router's ``kv`` cost: what the node must compute plus its queued work
            a = self.cfg.profile.s_per_token
            costs = [
                length - self.tokens(matches[i], ids, length) + loads[i] / a for i in range(self.n)
            ]
            x = self._pick(costs, matches, loads, length, turn)
            _store(self.caches[x], ids, self.cap, None)
            return x, matches[x], 0
        return self._serve_global(ids, length, loads, turn, matches)

    def _pick(
        self, costs: list[float], matches: list[int], loads: list[float], length: int, turn: int
    ) -> int:
        """The cheapest node, near-ties (within ``tie`` x the prompt) taken by the longest
        local match, then the least outstanding work, then in turn."""
        near = min(costs) + self.cfg.tie * length
        return min(
            (i for i in range(self.n) if costs[i] <= near),
            key=lambda i: (-matches[i], loads[i], (i - turn) % self.n),
        )

    def _serve_global(
        self, ids: Sequence[int], length: int, loads: list[float], turn: int, matches: list[int]
    ) -> tuple[int, int, int]:
        fleet = _lead(self.holders, ids)
        fleet_tok = self.tokens(fleet, ids, length)
        a = self.cfg.profile.s_per_token
        costs = [
            loads[i] / a + self.weight * (fleet_tok - self.tokens(matches[i], ids, length))
            for i in range(self.n)
        ]
        x = self._pick(costs, matches, loads, length, turn)
        local = matches[x]
        for h in ids[local:fleet]:
            # the peer that serves the read: the next holder after x, in node order
            for k in range(1, self.n):
                c = self.caches[(x + k) % self.n]
                if h in c:
                    c.move_to_end(h)
                    break
        _store(self.caches[x], ids, self.cap, self.holders)
        return x, fleet, fleet - local


def simulate(trace: Trace, policy: Policy, config: SimConfig | None = None) -> PolicyResult:
    """Run one policy over ``trace`` (see the module docstring)."""
    cfg = (config or SimConfig()).checked()
    if policy not in POLICIES:
        raise ConfigError(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}")
    if not trace.requests:
        raise ConfigError(f"{trace.source}: no requests to simulate")
    fleet = _Fleet(policy, cfg, trace.block_tokens)
    prof = cfg.profile
    read_s = cfg.read_s_per_token
    free_at = [0.0] * cfg.nodes
    node_tokens = [0] * cfg.nodes
    ttft = np.empty(len(trace.requests))
    t0 = trace.requests[0].timestamp_ms
    minutes = int((trace.requests[-1].timestamp_ms - t0) // 60_000) + 1
    minute_hit = np.zeros(minutes)
    minute_in = np.zeros(minutes)
    hit_total = in_total = p2p_total = 0
    spent = uncached = 0.0
    for turn, req in enumerate(trace.requests):
        t = (req.timestamp_ms - t0) / 1000.0
        length = req.input_length
        loads = [f - t if f > t else 0.0 for f in free_at]
        x, hit, peer = fleet.serve(req.hash_ids, length, loads, turn)
        hit_tok = fleet.tokens(hit, req.hash_ids, length)
        peer_tok = hit_tok - fleet.tokens(hit - peer, req.hash_ids, length)
        prefill = prof.prefill_s(hit_tok, length)
        end = max(t, free_at[x]) + peer_tok * read_s + prefill
        free_at[x] = end
        ttft[turn] = end - t
        node_tokens[x] += length - hit_tok
        m = int((req.timestamp_ms - t0) // 60_000)
        minute_hit[m] += hit_tok
        minute_in[m] += length
        hit_total += hit_tok
        in_total += length
        p2p_total += peer_tok
        spent += prefill
        uncached += prof.prefill_s(0, length)
    p50, p90, p99 = (float(v) for v in np.percentile(ttft, [50, 90, 99]))
    mean_tokens = sum(node_tokens) / cfg.nodes
    with np.errstate(invalid="ignore", divide="ignore"):
        per_minute = np.where(minute_in > 0, minute_hit / np.maximum(minute_in, 1), np.nan)
    return PolicyResult(
        policy=policy,
        requests=len(trace.requests),
        input_tokens=in_total,
        hit_tokens=hit_total,
        hit_rate=hit_total / in_total,
        prefill_s=spent,
        prefill_s_uncached=uncached,
        prefill_saved=1.0 - spent / uncached,
        ttft_p50_s=p50,
        ttft_p90_s=p90,
        ttft_p99_s=p99,
        p2p_tokens=p2p_total,
        p2p_bytes=p2p_total * prof.kv_bytes_per_token,
        load_spread=max(node_tokens) / mean_tokens if mean_tokens else 1.0,
        node_prefill_tokens=tuple(node_tokens),
        hit_rate_per_minute=tuple(float(v) for v in per_minute),
        ttft_s=tuple(float(v) for v in ttft),
    )


def simulate_all(
    trace: Trace,
    config: SimConfig | None = None,
    policies: Sequence[Policy] = POLICIES,
    say: Say | None = None,
) -> dict[str, PolicyResult]:
    """Every policy of ``policies`` over ``trace``, with ``share_of_theoretical`` filled
    (the theoretical maximum is always run, first)."""
    order: list[Policy] = ["theoretical", *(p for p in policies if p != "theoretical")]
    out: dict[str, PolicyResult] = {}
    for i, p in enumerate(order, start=1):
        if say:
            say(f"[{i}/{len(order)}] {p}: {len(trace)} requests")
        out[p] = simulate(trace, p, config)
    top = out["theoretical"].hit_rate
    return {
        p: replace(r, share_of_theoretical=r.hit_rate / top if top else float("nan"))
        for p, r in out.items()
        if p in policies
    }


@dataclass(frozen=True, slots=True)
class SweepPoint:
    """One policy at one capacity."""

    capacity_tokens: int
    policy: str
    hit_rate: float
    share_of_theoretical: float


@dataclass(frozen=True, slots=True)
class Sweep:
    """Hit rate against tokens per node (the paper's Figure 9), at a fixed node count."""

    nodes: int
    theoretical_hit_rate: float
    points: tuple[SweepPoint, ...]

    def hit_rate(self, policy: str, capacity_tokens: int) -> float:
        for p in self.points:
            if p.policy == policy and p.capacity_tokens == capacity_tokens:
                return p.hit_rate
        raise KeyError((policy, capacity_tokens))


def capacity_sweep(
    trace: Trace,
    nodes: int,
    capacities: Sequence[int],
    *,
    policies: Sequence[Policy] = SWEEP_POLICIES,
    config: SimConfig | None = None,
    say: Say | None = None,
) -> Sweep:
    """``policies`` over ``trace`` at each of ``capacities`` (tokens per node)."""
    base = replace(config or SimConfig(), nodes=nodes)
    top = simulate(trace, "theoretical", base).hit_rate
    points: list[SweepPoint] = []
    for cap in capacities:
        for p in policies:
            if say:
                say(f"sweep: {p} at {cap:,} tokens per node")
            r = simulate(trace, p, replace(base, capacity_tokens=cap))
            points.append(SweepPoint(cap, p, r.hit_rate, r.hit_rate / top if top else 0.0))
    return Sweep(nodes, top, tuple(points))


def format_table(results: dict[str, PolicyResult]) -> str:
    """The policies side by side, as a markdown table."""
    rows = [
        "| policy | hit rate | of theoretical | prefill saved | TTFT p50 / p90 / p99 (s)"
        " | P2P tokens (GB) | load spread |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results.values():
        p2p = f"{r.p2p_tokens:,} ({r.p2p_bytes / 1e9:,.0f})" if r.policy == "global" else "-"
        rows.append(
            f"| {r.policy} | {r.hit_rate:.1%} | {r.share_of_theoretical:.1%}"
            f" | {r.prefill_saved:.1%} | {r.ttft_p50_s:.2f} / {r.ttft_p90_s:.2f}"
            f" / {r.ttft_p99_s:.2f} | {p2p} | {r.load_spread:.2f} |"
        )
    return "\n".join(rows)


def format_sweep(sweep: Sweep) -> str:
    """Hit rate by capacity, one column per policy, as a markdown table."""
    policies = list(dict.fromkeys(p.policy for p in sweep.points))
    caps = list(dict.fromkeys(p.capacity_tokens for p in sweep.points))
    rows = [
        f"| tokens per node ({sweep.nodes} nodes) | {' | '.join(policies)} |",
        "|---" * (len(policies) + 1) + "|",
    ]
    for cap in caps:
        cells = " | ".join(f"{sweep.hit_rate(p, cap):.1%}" for p in policies)
        rows.append(f"| {cap:,} | {cells} |")
    rows.append(f"\ntheoretical maximum: {sweep.theoretical_hit_rate:.1%}")
    return "\n".join(rows)


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m kvatlas.evaluation.trace.simulate",
        description="Simulate the cache policies over a Mooncake trace (no fleet).",
    )
    ap.add_argument("--trace", default=None, help="trace file (default: the vendored one)")
    ap.add_argument("--trace-block-tokens", type=int, default=DEFAULT_BLOCK_TOKENS)
    ap.add_argument("--nodes", type=int, default=10)
    ap.add_argument("--capacity-tokens", type=int, default=3_000_000)
    ap.add_argument("--profile", choices=sorted(PROFILES), default="llama3-70b-8xa800")
    ap.add_argument("--p2p-gbytes-per-s", type=float, default=25.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start-s", type=float, default=0.0)
    ap.add_argument("--duration-s", type=float, default=None)
    ap.add_argument(
        "--policies", default=",".join(POLICIES), help="comma-separated, of: " + ", ".join(POLICIES)
    )
    ap.add_argument(
        "--sweep", default="", help="capacities (tokens per node, comma-separated) to sweep"
    )
    ap.add_argument("--json", default=None, help="write the results to this file")
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    path = args.trace or bundled_trace_path()
    trace = load_trace(path, block_tokens=args.trace_block_tokens)
    if args.start_s or args.duration_s is not None:
        trace = trace.window(args.start_s, args.duration_s or float("inf"))
    asked = {p.strip() for p in args.policies.split(",") if p.strip()}
    unknown = sorted(asked.difference(POLICIES))
    if unknown:
        raise SystemExit(f"unknown policies {unknown}; known: {', '.join(POLICIES)}")
    policies = [p for p in POLICIES if p in asked]
    cfg = SimConfig(
        nodes=args.nodes,
        capacity_tokens=args.capacity_tokens,
        profile=PROFILES[args.profile],
        p2p_bytes_per_s=args.p2p_gbytes_per_s * 1e9,
        seed=args.seed,
    ).checked()
    say(
        f"{trace.source}: {len(trace)} requests over {trace.duration_s:,.0f} s;"
        f" {cfg.nodes} nodes x {cfg.capacity_tokens:,} tokens, profile {cfg.profile.name}"
    )
    began = time.perf_counter()
    results = simulate_all(trace, cfg, policies, say)
    took = time.perf_counter() - began
    print(format_table(results))
    print(f"\n{len(results)} policies in {took:.1f} s")
    doc: dict[str, object] = {
        "trace": trace.source,
        "requests": len(trace),
        "config": {**asdict(cfg), "profile": asdict(cfg.profile)},
        "results": {
            p: {k: v for k, v in asdict(r).items() if k != "ttft_s"} for p, r in results.items()
        },
        "seconds": took,
    }
    if args.sweep:
        caps = [int(float(c)) for c in args.sweep.split(",") if c.strip()]
        began = time.perf_counter()
        sweep = capacity_sweep(trace, cfg.nodes, caps, config=cfg, say=say)
        took = time.perf_counter() - began
        print()
        print(format_sweep(sweep))
        print(f"sweep in {took:.1f} s")
        doc["sweep"] = asdict(sweep)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1, allow_nan=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
