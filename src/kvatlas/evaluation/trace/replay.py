"""A trace replayed through a real kvatlas fleet: one policy, one run.

Owns, for ``kvatlas bench trace``: the fleet (a coordinator and N ``kvatlas server``
processes on loopback, with P2P for the global cache and without it for the local ones),
N trace engines in this process (``trace.engine``: the real lookup, P2P read and store
path, prefill by the cost model), ``kvatlas router`` in front with the policy's routing,
and the trace's requests sent at their timestamps divided by ``speed``, each prompt the
token runs its ``hash_ids`` stand for (``trace.mooncake``), so that every key, lookup and
peer read is the real one.

Capacity is in tokens per node, as the paper sets it: each server's L1 holds
``node_capacity_tokens / block_tokens`` chunks of ``chunk_bytes`` (no L2).

It fails loudly (``FellBehind``) when the fleet cannot keep the trace's clock: a request
sent more than ``max_lag_s`` after its scheduled time, or answered with more than
``max_lag_s`` of wall time that is not its modelled queueing and prefill (the fleet's
own overhead). A replay that falls behind measures something else than the trace.

Must not: print (progress goes through ``say``), or decide what a policy is worth (the
report does).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import httpx
import msgspec
import numpy as np

from kvatlas.core.errors import KvatlasError
from kvatlas.evaluation.fleet import Fleet, FleetConfig
from kvatlas.evaluation.metrics import percentiles
from kvatlas.evaluation.trace.engine import TraceEngine, trace_contract
from kvatlas.evaluation.trace.mooncake import Trace, prompt_token_ids
from kvatlas.evaluation.trace.simulate import PROFILES, CostProfile
from kvatlas.launch.procs import HOST

Say = Callable[[str], None]

REPLAY_POLICIES: Final = {
    "local-random": ("random", False),
    "local-least-loaded": ("least-loaded", False),
    "local-prefix": ("kv", False),
    "global": ("kv-p2p", True),
}
"""Policy -> (the router's ``--policy``, P2P between the servers)."""
MODEL: Final = "trace-model"
KEEPALIVE_S: Final = 2.0
VOCAB: Final = 32_000


class FellBehind(KvatlasError):
    """The fleet did not keep the trace's clock; the message says where and by how much."""


@dataclass(frozen=True, slots=True)
class ReplayConfig:
    """One replay's settings."""

    policy: str = "global"
    nodes: int = 10
    node_capacity_tokens: int = 3_000_000
    profile: CostProfile = PROFILES["llama3-70b-8xa800"]
    """The prefill cost model (``simulate.PROFILES``)."""
    speed: float = 1.0
    """Trace seconds per wall second."""
    chunk_bytes: int = 16 << 10
    """KV bytes per chunk (one trace block)."""
    max_lag_s: float = 30.0
    seed: int = 1


@dataclass(slots=True)
class Answer:
    """One request's outcome, in trace time (wall time x speed)."""

    arrival_s: float
    prompt_tokens: int
    cached_tokens: int
    peer_tokens: int
    prefilled_tokens: int
    ttft_s: float
    engine: str


@dataclass(slots=True)
class ReplayResult:
    """A replay's figures (``summary``) and its answers."""

    policy: str
    config: ReplayConfig
    answers: list[Answer] = field(default_factory=list)
    wall_s: float = 0.0
    max_send_lag_s: float = 0.0

    def summary(self, block_tokens: int) -> dict[str, float]:
        a = self.answers
        prompt = sum(x.prompt_tokens for x in a) or 1
        cached = sum(x.cached_tokens for x in a)
        per_engine: dict[str, int] = {}
        for x in a:
            per_engine[x.engine] = per_engine.get(x.engine, 0) + x.prefilled_tokens
        loads = list(per_engine.values()) or [0]
        pct = percentiles([x.ttft_s for x in a])
        peer = sum(x.peer_tokens for x in a)
        return {
            "requests": float(len(a)),
            "token_hit_rate": cached / prompt,
            "prefill_s": sum(
                self.config.profile.prefill_s(x.cached_tokens, x.prompt_tokens) for x in a
            ),
            "prefill_s_uncached": sum(self.config.profile.prefill_s(0, x.prompt_tokens) for x in a),
            "ttft_p50_s": pct["p50"],
            "ttft_p90_s": pct["p90"],
            "ttft_p99_s": pct["p99"],
            "p2p_tokens": float(peer),
            "p2p_bytes": peer / block_tokens * self.config.chunk_bytes,
            "load_max_over_mean": max(loads) / (sum(loads) / len(loads)) if sum(loads) else 1.0,
            "wall_s": self.wall_s,
            "max_send_lag_s": self.max_send_lag_s,
        }


class _Stats(msgspec.Struct):
    num_cached_tokens: int
    num_peer_cached_tokens: int
    num_prefilled_tokens: int
    num_prompt_tokens: int
    queued_ms: float
    prefill_ms: float


class _Body(msgspec.Struct):
    model: str
    cached_token_stats: _Stats


_answer: Final = msgspec.json.Decoder(_Body)


def replay(
    trace: Trace, cfg: ReplayConfig, *, workdir: Path | None = None, say: Say = lambda _m: None
) -> ReplayResult:
    """Start the fleet for ``cfg.policy``, send ``trace`` through it, stop everything."""
    if cfg.policy not in REPLAY_POLICIES:
        raise ValueError(f"policy must be one of {sorted(REPLAY_POLICIES)}, got {cfg.policy!r}")
    router_policy, p2p = REPLAY_POLICIES[cfg.policy]
    block = trace.block_tokens
    contract = trace_contract(MODEL, block, cfg.chunk_bytes)
    chunks = -(-cfg.node_capacity_tokens // block)
    l1_mb = chunks * cfg.chunk_bytes / 2**20 * 1.02 + 1  # slack for the allocator
    fleet_cfg = FleetConfig(
        nodes=cfg.nodes,
        chunk_size=block,
        l1_size_mb=l1_mb,
        p2p=p2p,
        engine_workers=2,
        server_args=(("--l1-align-bytes", "4096", "--no-l1-prefault"),) * cfg.nodes,
    )
    engines: list[TraceEngine] = []
    result = ReplayResult(cfg.policy, cfg)
    with Fleet(fleet_cfg, workdir=workdir) as fleet:
        fleet.start(say)
        try:
            for i, srv in enumerate(fleet.servers):
                e = TraceEngine(
                    f"trace-{i}",
                    cache_url=f"tcp://{HOST}:{srv.engine_port}",
                    contract=contract,
                    profile=cfg.profile,
                    speed=cfg.speed,
                )
                e.start()
                engines.append(e)
            if p2p:
                fleet.wait_p2p_peers(60.0)
            router = fleet.start_router(
                router_policy,
                ("--seed", str(cfg.seed), "--chunk-size", str(block), "--model-name", MODEL),
            )
            fleet.wait_router_engines(router, cfg.nodes, 60.0)
            say(f"{cfg.policy}: {cfg.nodes} nodes, router --policy {router_policy}, P2P {p2p}")
            asyncio.run(_send(trace, cfg, router, result, say))
        finally:
            for e in engines:
                e.stop()
    return result


async def _send(trace: Trace, cfg: ReplayConfig, router: str, out: ReplayResult, say: Say) -> None:
    reqs = trace.requests
    if not reqs:
        return
    t_zero = reqs[0].arrival_s
    # idle connections expire before the router's keep-alive timeout (uvicorn's 5 s)
    # would close them: a request sent on a connection the router is closing is a
    # ReadError that says nothing about the fleet
    limits = httpx.Limits(
        max_connections=None, max_keepalive_connections=256, keepalive_expiry=KEEPALIVE_S
    )
    failure: list[BaseException] = []
    done = 0
    async with httpx.AsyncClient(
        base_url=router, timeout=None, limits=limits, trust_env=False
    ) as client:
        start = time.perf_counter()

        async def one(i: int) -> None:
            nonlocal done
            r = reqs[i]
            ids = prompt_token_ids(r, trace.block_tokens, VOCAB)
            body = msgspec.json.encode(
                {"prompt": ids.tolist(), "max_tokens": 1, "kv_transfer_params": {}}
            )
            t0 = time.perf_counter()
            resp = await client.post(
                "/v1/completions", content=body, headers={"content-type": "application/json"}
            )
            wall = time.perf_counter() - t0
            if resp.status_code != 200:
                raise FellBehind(f"request {i} (line {r.line}) answered {resp.status_code}")
            a = _answer.decode(resp.content)
            s = a.cached_token_stats
            overhead = wall - (s.queued_ms + s.prefill_ms) / 1000
            if overhead > cfg.max_lag_s:
                raise FellBehind(
                    f"request {i} (line {r.line}) took {overhead:.1f} s of the fleet's own time"
                    f" beyond its queueing and prefill (limit {cfg.max_lag_s:g} s)"
                )
            out.answers.append(
                Answer(
                    r.arrival_s,
                    s.num_prompt_tokens,
                    s.num_cached_tokens,
                    s.num_peer_cached_tokens,
                    s.num_prefilled_tokens,
                    wall * cfg.speed,
                    a.model,
                )
            )
            done += 1

        def finished(task: asyncio.Task[None]) -> None:
            if not task.cancelled() and task.exception() is not None:
                failure.append(task.exception())  # type: ignore[arg-type]

        tasks: list[asyncio.Task[None]] = []
        last_say = start
        for i, r in enumerate(reqs):
            due = start + (r.arrival_s - t_zero) / cfg.speed
            now = time.perf_counter()
            if due > now:
                await asyncio.sleep(due - now)
            lag = time.perf_counter() - due
            out.max_send_lag_s = max(out.max_send_lag_s, lag)
            if lag > cfg.max_lag_s:
                failure.append(
                    FellBehind(
                        f"request {i} went out {lag:.1f} s after its time on the trace clock"
                    )
                )
            if failure:
                for t in tasks:
                    t.cancel()
                raise failure[0]
            task = asyncio.create_task(one(i))
            task.add_done_callback(finished)
            tasks.append(task)
            if time.perf_counter() - last_say > 10:
                last_say = time.perf_counter()
                say(
                    f"{out.policy}: sent {i + 1}/{len(reqs)}, answered {done},"
                    f" trace time {r.arrival_s - t_zero:.0f} s"
                )
        await asyncio.gather(*tasks, return_exceptions=True)
        if failure:
            raise failure[0]
        out.wall_s = time.perf_counter() - start
    say(f"{out.policy}: {done} answered in {out.wall_s:.0f} s")


def hit_series(answers: list[Answer], bucket_s: float = 60.0) -> list[tuple[float, float]]:
    """(bucket start, token hit rate) per ``bucket_s`` of trace time: the plot's line."""
    if not answers:
        return []
    t = np.array([a.arrival_s for a in answers])
    cached = np.array([a.cached_tokens for a in answers], dtype=float)
    prompt = np.array([a.prompt_tokens for a in answers], dtype=float)
    b = np.floor((t - t.min()) / bucket_s).astype(int)
    out = []
    for k in range(int(b.max()) + 1):
        m = b == k
        if m.any():
            out.append((k * bucket_s, float(cached[m].sum() / prompt[m].sum())))
    return out
