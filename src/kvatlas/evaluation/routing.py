"""The routing phase: one seeded workload through ``kvatlas router``, once per policy.

Owns the measurement of cache-aware routing: a fleet of cache servers, each with a reference engine
(SmolLM2-135M on the CPU, one torch thread), a router in front, and the same request
sequence (multi-turn chat sessions, questions about a few hot shared documents, unique
prompts) sent at a fixed arrival rate that loads the engines, once per run: ``kv``, ``kv-p2p``,
``least-loaded``, ``random``, and ``round-robin`` twice, with P2P off (what fleets run
today) and on. Per run it reports TTFT (the router's own time, from its route header,
plus the engine's time to first token, which counts the engine's queue), the cached-token
share, tokens recomputed, per-engine requests and busy time (the router's ``/status``),
failed requests and the router's added latency, TTFT by request kind, the time requests
queued in their engine and every request's record; beside them the limit: the share one
logical cache of the fleet's total capacity would serve on the same sequence (an LRU of
full chunks, replayed offline), and per run the tokens it fell short of that limit by,
each traced to a prefix still in flight or one computed but not found.

The arrival rate is derived from the engines' measured speed unless given: in each fleet,
before its run, every engine prefills the same few uncached prompts of the workload's mean
length, all engines at once (their rate when the whole fleet is busy, which on a machine
with fewer cores than engines is less than one engine's alone); the first fleet's rate
sets the arrival rate for every run (``arrival_rate``), the later fleets' rates are
recorded to show how steady the machine was. Every fleet runs the same calibration, so
every run starts from the same caches. Must not: print (progress goes through ``say``).
"""

from __future__ import annotations

import concurrent.futures
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Final

import httpx
import numpy as np

from kvatlas.evaluation.cpu_account import machine_times, process_cpu_s
from kvatlas.evaluation.fleet import ENGINE_MODEL as MODEL
from kvatlas.evaluation.fleet import Fleet, FleetConfig
from kvatlas.evaluation.metrics import percentiles
from kvatlas.evaluation.workload import VOCAB_SIZE
from kvatlas.launch.procs import Proc, ProcessError
from kvatlas.router.service import ROUTE_HEADER

Say = Callable[[str], None]

SMOLLM2_CHUNK_BYTES: Final = 30 * 2 * 3 * 256 * 64 * 4
"""KV bytes of one 256-token SmolLM2-135M chunk in float32 (30 layers, K and V, 3 KV
heads of dim 64): what L1 capacity is counted in for the offline limit."""

RUNS: Final[tuple[tuple[str, str, bool], ...]] = (
    ("round-robin, P2P off", "round-robin", False),
    ("round-robin, P2P on", "round-robin", True),
    ("random", "random", True),
    ("least-loaded", "least-loaded", True),
    ("kv", "kv", True),
    ("kv-p2p", "kv-p2p", True),
)
"""(label, --policy, P2P) of each run, in order."""

RUN_NAMES: Final[dict[str, str]] = {
    "rr-off": "round-robin, P2P off",
    "rr-on": "round-robin, P2P on",
    "random": "random",
    "least-loaded": "least-loaded",
    "kv": "kv",
    "kv-p2p": "kv-p2p",
}
"""The short names ``--routing-runs`` takes, and the run each names."""


@dataclass(frozen=True, slots=True)
class RoutingConfig:
    """What the routing phase runs (flags ``--routing-*`` of ``kvatlas bench fleet``)."""

    engines: int = 4
    """Nodes, each a cache server with one reference engine."""
    requests: int = 100
    """Requests per run (the same sequence in every run): enough that the engines'
    queues reach a steady state after the first few requests fill the caches, few
    enough that the six runs (each a fleet start plus its arrivals) stay practical on a
    small CPU-only machine."""
    load: float = 1.6
    """The arrival rate as the fleet's utilisation if every prompt token were recomputed
    (``arrival_rate``: the engines' prefill rate measured with all of them busy). No
    policy recomputes every token (round-robin without P2P recomputes about half of
    them, kv-p2p about a quarter), so what a run meets is below this. At 1.6, round-robin
    without P2P keeps the engines nearly saturated and falls behind (the fleet people
    run today cannot keep up at this rate), while the prefix-aware policies leave them
    well below that; at a load near 1 no engine is busy enough for requests to queue,
    so placement shows only in cache hits. A routing policy matters where engines are
    loaded."""
    rate_per_s: float | None = None
    """Fixed arrival rate, requests per second (``--routing-rate``); None: derived from
    ``load`` and the engines' measured prefill rate."""
    calibration_rounds: int = 3
    """Uncached prefills each engine runs before its run, all engines at once; the first
    is not counted (it pays for the engine's first prompt of that size)."""
    request_timeout_s: float = 180.0
    """Seconds a client waits for one request: past it the request counts as failed (a
    fleet that keeps a request this long has fallen behind for good)."""
    max_send_s: float = 400.0
    """The most seconds one run may spend sending its requests (requests / rate): a
    slower rate (a very busy machine) stops the phase with a clear error instead of
    running for hours."""
    max_tokens: int = 8
    """Completion tokens per request."""
    hot_docs: int = 3
    """Shared documents; their popularity falls as 1/rank."""
    doc_tokens: int = 768
    """Tokens of each shared document."""
    sessions: int = 4
    """Multi-turn chat sessions."""
    l1_size_mb: float = 512.0
    """L1 per server (MiB); the offline limit's capacity is all servers' together."""
    seed: int = 7
    """Workload seed."""
    tokenizer: str | None = MODEL
    """The router's ``--tokenizer`` (the engines' model: prompts are tokenized in the
    router, so its added latency is its own, not a busy engine's ``/tokenize``); None:
    the router asks the engines. The workload's token-id prompts need neither."""
    engine_nice: int = 10
    """Niceness the engines run at, above the rest of the fleet's (``--routing-engine-nice``).
    In a real fleet an engine's prefill runs on its accelerator, and the host's CPUs
    serve the router, the coordinator and the cache servers without waiting behind it;
    here four CPU-bound engines share the machine's cores with them, so at the same
    priority the router's added latency would mostly measure its wait for a CPU behind
    the engines' prefill. At 10 the engines still get every cycle the others leave
    (those use little of the CPU when quiet); 0 runs everything alike."""
    runs: tuple[str, ...] = ()
    """The runs to make, by their ``RUN_NAMES`` (``--routing-runs``); empty: all of
    ``RUNS``. The targets are evaluated only when the runs they compare were made."""


@dataclass(frozen=True, slots=True)
class Request:
    kind: str
    """``doc`` (a question about a hot document), ``chat`` (a session's next turn) or
    ``unique``."""
    tokens: list[int]
    group: int = -1
    """The document or session it belongs to (-1 for a unique prompt)."""


def workload(cfg: RoutingConfig) -> list[Request]:
    """The seeded request sequence: ~40% doc questions, ~35% chat turns, the rest unique."""
    rng = np.random.default_rng(cfg.seed)

    def toks(n: int) -> list[int]:
        return [int(t) for t in rng.integers(0, VOCAB_SIZE, n)]

    docs = [toks(cfg.doc_tokens) for _ in range(cfg.hot_docs)]
    weights = np.array([1.0 / (i + 1) for i in range(cfg.hot_docs)])
    weights /= weights.sum()
    system = toks(200)
    history = [system + toks(int(rng.integers(100, 300))) for _ in range(cfg.sessions)]
    out: list[Request] = []
    for _ in range(cfg.requests):
        u = rng.random()
        if u < 0.4:
            d = int(rng.choice(cfg.hot_docs, p=weights))
            out.append(Request("doc", docs[d] + toks(int(rng.integers(30, 90))), d))
        elif u < 0.75:
            s = int(rng.integers(cfg.sessions))
            history[s] = history[s] + toks(int(rng.integers(40, 100)))
            out.append(Request("chat", list(history[s]), s))
            history[s] = history[s] + toks(int(rng.integers(60, 120)))  # the answer
        else:
            out.append(Request("unique", toks(int(rng.integers(200, 500)))))
    return out


def arrival_rate(
    load: float, engines: int, prefill_tokens_per_s: float, mean_prompt_tokens: float
) -> float:
    """Requests per second at which ``engines`` engines, each prefilling
    ``prefill_tokens_per_s`` (measured with all of them busy), are busy ``load`` of the
    time if every prompt token is recomputed: the fleet's prefill capacity times
    ``load`` over the mean prompt. A policy that reuses cached prefixes is less busy."""
    if load <= 0 or engines < 1 or prefill_tokens_per_s <= 0 or mean_prompt_tokens <= 0:
        raise ValueError(
            f"arrival_rate needs positive inputs: load {load}, engines {engines},"
            f" prefill {prefill_tokens_per_s} tokens/s, mean prompt {mean_prompt_tokens}"
        )
    return load * engines * prefill_tokens_per_s / mean_prompt_tokens


def calibration_prompts(cfg: RoutingConfig, mean_prompt_tokens: float) -> list[list[int]]:
    """``calibration_rounds`` prompts of the workload's mean length, from their own seed:
    random tokens no workload prompt shares a chunk with, so nothing is cached for them."""
    rng = np.random.default_rng([cfg.seed, 0xCA1])
    n = max(1, round(mean_prompt_tokens))
    return [[int(t) for t in rng.integers(0, VOCAB_SIZE, n)] for _ in range(cfg.calibration_rounds)]


def one_cache_hits(requests: Sequence[Request], capacity_chunks: int, chunk: int) -> list[int]:
    """Per request, the tokens one LRU cache of ``capacity_chunks`` full chunks serves
    on ``requests`` in order (a request is served its leading chunks that are cached)."""
    lru: OrderedDict[tuple[int, ...], None] = OrderedDict()
    hits: list[int] = []
    for r in requests:
        keys = [tuple(r.tokens[: (k + 1) * chunk]) for k in range(len(r.tokens) // chunk)]
        hit = 0
        leading = True
        for key in keys:
            if leading and key in lru:
                hit += chunk
            else:
                leading = False
            lru[key] = None
            lru.move_to_end(key)
            while len(lru) > capacity_chunks:
                lru.popitem(last=False)
        hits.append(hit)
    return hits


def one_cache_limit(requests: Sequence[Request], capacity_chunks: int, chunk: int) -> float:
    """The cached-token share of ``one_cache_hits``: the limit a fleet of that capacity
    is measured against."""
    total = sum(len(r.tokens) for r in requests)
    return sum(one_cache_hits(requests, capacity_chunks, chunk)) / total if total else 0.0


def short_of_limit(
    requests: Sequence[Request],
    hits: Sequence[int],
    done: Sequence[dict[str, Any]],
    rate_per_s: float,
    chunk: int,
) -> dict[str, int]:
    """Tokens the limit serves that a run recomputed, by why. For each request that
    found fewer than ``hits``, its first missing chunk is traced to the earlier requests
    that carried it: ``in_flight`` when none of them had reached its first token by the
    time this one was sent (the prefix was still queued or prefilling somewhere, so no
    cache held it yet and P2P had nothing to read); ``not_found`` when one had (the
    prefix was computed but this request's engine did not get it: on another node
    without P2P, evicted, or a lookup that failed)."""
    out = {"requests": 0, "in_flight": 0, "not_found": 0}
    for i, (req, hit, d) in enumerate(zip(requests, hits, done, strict=True)):
        got = int(d.get("cached", 0)) if d.get("ok") else 0
        if not d.get("ok") or got >= hit:
            continue
        end = (got // chunk + 1) * chunk
        first = req.tokens[:end]
        sent = i / rate_per_s
        ready = [
            j / rate_per_s + float(done[j]["ttft_ms"]) / 1000
            for j in range(i)
            if done[j].get("ok") and requests[j].tokens[:end] == first
        ]
        why = "not_found" if any(t <= sent for t in ready) else "in_flight"
        out["requests"] += 1
        out[why] += hit - got
    return out


def _route(header: str) -> dict[str, str]:
    return dict(p.split("=", 1) for p in header.split("; ") if "=" in p)


def _own_ms(breakdown: dict[str, float]) -> float:
    """The engine's own time to first token: its breakdown without the ``p2p_*`` parts,
    which the cache server spent inside the engine's ``lookup``."""
    return sum(v for k, v in breakdown.items() if not k.startswith("p2p_"))


def _send(http: httpx.Client, url: str, req: Request, max_tokens: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    try:
        r = http.post(
            url + "/v1/completions",
            json={
                "model": MODEL,
                "prompt": req.tokens,
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "kv_transfer_params": {"cached_token_stats": True},
            },
        )
    except httpx.HTTPError as exc:
        return {"kind": req.kind, "ok": False, "error": repr(exc)}
    total_ms = (time.perf_counter() - t0) * 1000
    if r.status_code != 200:
        return {"kind": req.kind, "ok": False, "error": f"{r.status_code}: {r.text[:200]}"}
    st = r.json().get("cached_token_stats") or {}
    route = _route(r.headers.get(ROUTE_HEADER, ""))
    overhead = float(route.get("overhead_ms", 0.0))
    engine_ttft = float(st.get("ttft_ms", total_ms))
    return {
        "kind": req.kind,
        "group": req.group,
        "ok": True,
        "engine": route.get("engine", ""),
        "reason": route.get("reason", ""),
        "expected_cached": int(route.get("cached", 0)),
        "overhead_ms": overhead,
        "ttft_ms": overhead + engine_ttft,
        # the engine's TTFT less the parts of its breakdown: the time it queued
        "queue_ms": max(0.0, engine_ttft - _own_ms(st.get("breakdown_ms") or {})),
        "prompt": len(req.tokens),
        "cached": int(st.get("num_cached_tokens", 0)),
        "peer": int(st.get("num_peer_cached_tokens", 0)),
        "prefilled": int(st.get("num_prefilled_tokens", 0)),
    }


def _prefill_rate(http: httpx.Client, url: str, prompts: Sequence[list[int]]) -> float:
    """One engine's prefill tokens per second over ``prompts`` (sent one after another,
    straight to the engine), the first not counted: the engine's own ``prefill`` time
    from its breakdown, so neither HTTP nor the cache lookup is counted."""
    tokens, seconds = 0, 0.0
    for i, prompt in enumerate(prompts):
        r = http.post(
            url + "/v1/completions",
            json={
                "model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0,
                "kv_transfer_params": {"cached_token_stats": True},
            },
        )  # fmt: skip
        r.raise_for_status()
        st = r.json().get("cached_token_stats") or {}
        if i > 0 or len(prompts) == 1:
            tokens += int(st.get("num_prefilled_tokens", 0))
            seconds += float((st.get("breakdown_ms") or {}).get("prefill", 0.0)) / 1000
    if tokens <= 0 or seconds <= 0:
        raise ProcessError(f"the engine at {url} reported no prefill to calibrate with")
    return tokens / seconds


def calibrate(urls: Sequence[str], prompts: Sequence[list[int]], timeout_s: float) -> list[float]:
    """Every engine's prefill rate (tokens/s), all engines prefilling at the same time."""
    with (
        httpx.Client(timeout=timeout_s) as http,
        concurrent.futures.ThreadPoolExecutor(len(urls)) as pool,
    ):
        return list(pool.map(lambda u: _prefill_rate(http, u, prompts), urls))


class PaceError(RuntimeError):
    """The arrival rate makes a run send for longer than ``max_send_s``: every later run
    would use the same rate, so the phase stops instead of starting their fleets."""


@dataclass(slots=True)
class Pace:
    """The arrival rate of every run: given, or derived from the first calibration."""

    load: float
    mean_prompt_tokens: float
    rate_per_s: float | None = None
    prefill_tokens_per_s: float | None = None
    """The engines' mean prefill rate that set ``rate_per_s`` (None when given)."""

    def rate(self, engines: int, measured: Sequence[float]) -> float:
        if self.rate_per_s is None:
            self.prefill_tokens_per_s = float(np.mean(measured))
            self.rate_per_s = arrival_rate(
                self.load, engines, self.prefill_tokens_per_s, self.mean_prompt_tokens
            )
        return self.rate_per_s


def _run(
    fcfg: FleetConfig,
    cfg: RoutingConfig,
    requests: Sequence[Request],
    pace: Pace,
    *,
    policy: str,
    label: str,
    say: Say,
) -> dict[str, Any]:
    with Fleet(fcfg) as fleet:
        fleet.start(lambda m: say(f"  [{label}] {m}"))
        urls = fleet.start_engines(extra_args=("--num-threads", "1"), nice=cfg.engine_nice)
        tokenizer = ("--tokenizer", cfg.tokenizer) if cfg.tokenizer else ()
        router = fleet.start_router(policy, ("--seed", str(cfg.seed), *tokenizer))
        fleet.wait_router_engines(router, len(urls), 60.0)
        prompts = calibration_prompts(cfg, pace.mean_prompt_tokens)
        measured = calibrate(urls, prompts, cfg.request_timeout_s)
        rate = pace.rate(len(urls), measured)
        send_s = len(requests) / rate
        say(
            f"  [{label}] engines prefill {np.mean(measured):.0f} tokens/s each (all at"
            f" once); sending {len(requests)} requests at {rate:.3g}/s ({send_s:.0f} s)"
        )
        if send_s > cfg.max_send_s:
            raise PaceError(
                f"{len(requests)} requests at {rate:.3g}/s take {send_s:.0f} s to send, more"
                f" than {cfg.max_send_s:.0f} s: the engines prefill only"
                f" {np.mean(measured):.0f} tokens/s each; give a higher --routing-load or"
                " --routing-rate, or fewer --routing-requests"
            )
        procs = _roles(fleet, urls, router)
        cpu0, machine0 = _cpu_by_role(procs), machine_times()
        t0 = time.monotonic()
        # a thread per request: the client must never hold a request back, or the time it
        # waited for a thread would be queueing that no TTFT counts
        with (
            httpx.Client(timeout=cfg.request_timeout_s) as http,
            concurrent.futures.ThreadPoolExecutor(len(requests)) as pool,
        ):
            futures = []
            for i, req in enumerate(requests):
                time.sleep(max(0.0, t0 + i / rate - time.monotonic()))
                futures.append(pool.submit(_send, http, router, req, cfg.max_tokens))
            done = [f.result() for f in futures]
        elapsed = time.monotonic() - t0
        cpu1, machine1 = _cpu_by_role(procs), machine_times()
        status = httpx.get(f"{router}/status", timeout=10).json()
    ok = [d for d in done if d["ok"]]
    busy = {e["url"]: float(e["busy_s"]) for e in status["engines"]}
    counts = {e["url"]: int(e["requests"]) for e in status["engines"]}
    mean_busy = float(np.mean(list(busy.values()))) if busy else 0.0
    prompt = sum(d["prompt"] for d in ok)
    cached = sum(d["cached"] for d in ok)
    hot = [d["ttft_ms"] for d in ok if d["kind"] == "doc"]
    say(
        f"  [{label}] {len(ok)}/{len(done)} ok in {elapsed:.0f} s, mean TTFT"
        f" {np.mean([d['ttft_ms'] for d in ok]) if ok else 0:.0f} ms,"
        f" cached {cached / prompt if prompt else 0:.1%}"
    )
    return {
        "policy": policy,
        "p2p": fcfg.p2p,
        "requests": len(done),
        "failed": len(done) - len(ok),
        "errors": sorted({d["error"] for d in done if not d["ok"]})[:5],
        "elapsed_s": round(elapsed, 1),
        "rate_per_s": round(rate, 6),
        "prefill_tokens_per_s": [round(v, 1) for v in measured],
        "busy_share": round(mean_busy / elapsed, 3) if elapsed > 0 else 0.0,
        "ttft_ms": percentiles([d["ttft_ms"] for d in ok]),
        "ttft_ms_hot_doc": percentiles(hot),
        "ttft_ms_mean_by_kind": {
            k: round(float(np.mean([d["ttft_ms"] for d in ok if d["kind"] == k])), 1)
            for k in ("chat", "doc", "unique")
            if any(d["kind"] == k for d in ok)
        },
        "queue_ms": percentiles([d["queue_ms"] for d in ok]),
        "ttft_ms_all": [round(d["ttft_ms"], 1) for d in ok],
        "router_overhead_ms": percentiles([d["overhead_ms"] for d in ok]),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "peer_cached_tokens": sum(d["peer"] for d in ok),
        "recomputed_tokens": sum(d["prefilled"] for d in ok),
        "cached_share": round(cached / prompt, 4) if prompt else 0.0,
        "engine_requests": counts,
        "engine_busy_s": {k: round(v, 2) for k, v in busy.items()},
        "busy_imbalance": round(max(busy.values()) / mean_busy, 3) if mean_busy else 0.0,
        "reasons": {r: sum(d["reason"] == r for d in ok) for r in {d["reason"] for d in ok}},
        "cpu_s": {k: round(cpu1[k] - cpu0[k], 1) for k in cpu1 if k in cpu0},
        "machine": machine1.since(machine0).shares() if machine0 and machine1 else {},
        "per_request": [
            {k: round(v, 1) if isinstance(v, float) else v for k, v in d.items()} for d in done
        ],
    }


def _roles(fleet: Fleet, engine_urls: Sequence[str], router_url: str) -> dict[str, list[Proc]]:
    """The fleet's processes by kind: engines, cache servers, coordinator, router (the
    engines and the router known by the URLs their starts returned)."""
    extras = fleet.extras
    return {
        "engines": [p for p in extras if p.url in engine_urls],
        "servers": list(fleet.servers),
        "coordinator": list(fleet.coordinators),
        "router": [p for p in extras if p.url == router_url],
    }


def _cpu_by_role(procs: dict[str, list[Proc]]) -> dict[str, float]:
    """CPU seconds so far of each kind of process, and of this one (the load client);
    a kind none of whose processes could be read is left out."""
    out: dict[str, float] = {}
    for role, ps in procs.items():
        seconds = [s for p in ps if (s := process_cpu_s(p.pid)) is not None]
        if seconds:
            out[role] = sum(seconds)
    own = process_cpu_s(os.getpid())
    if own is not None:
        out["client"] = own
    return out


def selected_runs(names: Sequence[str]) -> tuple[tuple[str, str, bool], ...]:
    """The runs of ``RUNS`` that ``names`` (``RUN_NAMES`` keys) pick, in ``RUNS``'s order;
    all of them for none. An unknown name is a ValueError naming the known ones."""
    unknown = [n for n in names if n not in RUN_NAMES]
    if unknown:
        raise ValueError(f"unknown run {', '.join(unknown)}: the runs are {', '.join(RUN_NAMES)}")
    labels = {RUN_NAMES[n] for n in names}
    return tuple(r for r in RUNS if not labels or r[0] in labels)


def run_routing_phase(fcfg: FleetConfig, cfg: RoutingConfig, say: Say) -> dict[str, Any]:
    """Every run of ``RUNS`` on the same sequence; a run whose fleet fails is recorded
    with its reason and the others still run."""
    requests = workload(cfg)
    chunk = fcfg.chunk_size
    per_server = int(cfg.l1_size_mb * (1 << 20)) // SMOLLM2_CHUNK_BYTES
    hits = one_cache_hits(requests, per_server * cfg.engines, chunk)
    total = sum(len(r.tokens) for r in requests)
    limit = sum(hits) / total if total else 0.0
    kinds = {k: sum(r.kind == k for r in requests) for k in ("doc", "chat", "unique")}
    pace = Pace(cfg.load, total / max(1, len(requests)), cfg.rate_per_s)
    say(
        f"routing phase: {cfg.engines} engines ({MODEL}), {len(requests)} requests"
        f" ({kinds}, {pace.mean_prompt_tokens:.0f} prompt tokens on average) at "
        + (f"{cfg.rate_per_s:g}/s" if cfg.rate_per_s else f"load {cfg.load:g}")
        + f"; one-cache limit {limit:.1%}"
    )
    base = replace(fcfg, nodes=cfg.engines, l1_size_mb=cfg.l1_size_mb, start_timeout_s=300.0)
    runs: dict[str, Any] = {}
    stop: str | None = None
    for label, policy, p2p in selected_runs(cfg.runs):
        if stop is not None:
            runs[label] = {"skipped": stop}
            continue
        try:
            fleet_cfg = replace(base, p2p=p2p)
            run = _run(fleet_cfg, cfg, requests, pace, policy=policy, label=label, say=say)
            run["short_of_limit"] = short_of_limit(
                requests, hits, run["per_request"], run["rate_per_s"], chunk
            )
            runs[label] = run
        except PaceError as exc:
            say(f"  [{label}] stopped the phase: {exc}")
            stop = f"PaceError: {exc}"
            runs[label] = {"skipped": stop}
        except (httpx.HTTPError, OSError, ProcessError) as exc:
            say(f"  [{label}] failed: {type(exc).__name__}: {exc}")
            runs[label] = {"skipped": f"{type(exc).__name__}: {str(exc)[:500]}"}
    return {
        "model": MODEL,
        "config": {k: getattr(cfg, k) for k in cfg.__dataclass_fields__},
        "kinds": kinds,
        "prompt_tokens": sum(len(r.tokens) for r in requests),
        "mean_prompt_tokens": round(pace.mean_prompt_tokens, 1),
        "arrival": {
            "rate_per_s": None if pace.rate_per_s is None else round(pace.rate_per_s, 4),
            "given": cfg.rate_per_s is not None,
            "load": cfg.load,
            "prefill_tokens_per_s": None
            if pace.prefill_tokens_per_s is None
            else round(pace.prefill_tokens_per_s, 1),
        },
        "one_cache_limit": round(limit, 4),
        "one_cache_capacity_chunks": per_server * cfg.engines,
        "runs": runs,
        "targets": targets(runs, limit),
    }


def targets(runs: dict[str, Any], limit: float) -> dict[str, Any]:
    """The routing targets, each with the measured values it compares."""
    rr_off = runs.get("round-robin, P2P off", {})
    rr_on = runs.get("round-robin, P2P on", {})
    kvp = runs.get("kv-p2p", {})
    kv = runs.get("kv", {})
    if any("ttft_ms" not in r for r in (rr_off, rr_on, kvp, kv)):
        return {"evaluated": False}
    m = kvp["ttft_ms"]["mean"]
    return {
        "evaluated": True,
        "kv_p2p_ttft_mean_le_third_of_rr_off": {
            "value": round(m / rr_off["ttft_ms"]["mean"], 3), "target": "<= 0.333",
            "met": m <= rr_off["ttft_ms"]["mean"] / 3,
        },
        "kv_p2p_ttft_mean_below_rr_on": {
            "value": round(m / rr_on["ttft_ms"]["mean"], 3), "target": "< 1",
            "met": m < rr_on["ttft_ms"]["mean"],
        },
        "kv_p2p_cached_share_ge_95pct_of_limit": {
            "value": round(kvp["cached_share"] / limit, 3) if limit else 0.0,
            "target": ">= 0.95", "met": kvp["cached_share"] >= 0.95 * limit,
        },
        "kv_p2p_busy_imbalance_le_1_25": {
            "value": kvp["busy_imbalance"], "target": "<= 1.25",
            "met": kvp["busy_imbalance"] <= 1.25,
        },
        "kv_p2p_hot_doc_p99_below_kv": {
            "value": round(kvp["ttft_ms_hot_doc"]["p99"] / kv["ttft_ms_hot_doc"]["p99"], 3)
            if kv["ttft_ms_hot_doc"]["p99"] else 0.0,
            "target": "< 1", "met": kvp["ttft_ms_hot_doc"]["p99"] < kv["ttft_ms_hot_doc"]["p99"],
        },
        "router_overhead_p99_le_5ms": {
            "value": kvp["router_overhead_ms"]["p99"], "target": "<= 5 ms",
            "met": kvp["router_overhead_ms"]["p99"] <= 5.0,
        },
    }  # fmt: skip
