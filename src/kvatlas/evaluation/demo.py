"""`kvatlas demo`: the local fleet, end to end, in one command.

Owns the demonstration the reference guide does with five terminals and two GPUs: one
coordinator, two cache servers with P2P and two reference engines (SmolLM2-135M on the
CPU) on 127.0.0.1; a long prompt goes to node A (cold), then the same prompt to node B,
which never saw it, so every cached token B reports can only have come from A through
P2P. With ``router`` both requests go through ``kvatlas router`` instead (engines found
through the coordinator), and the report says where it sent each and why: the repeat
finds the prefix either on the node that computed it or, through P2P, on the other.
It returns what an operator would look at: TTFT on both nodes, cached tokens, bytes
B read from A, the two generated texts (identical), and the coordinator's view of the
fleet. Every process it starts is stopped by pid when it returns, on errors and on
Ctrl-C (the `Fleet` context manager). Must not: print; progress goes through ``say``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kvatlas.evaluation.fleet import ENGINE_MODEL as MODEL
from kvatlas.evaluation.fleet import Fleet, FleetConfig
from kvatlas.launch.procs import ProcessError
from kvatlas.router.service import ROUTE_HEADER
from kvatlas.wire.coordinator_views import StatsResponse
from kvatlas.wire.instances_api import InstanceWire

Say = Callable[[str], None]
CHARS_PER_TOKEN = 4


@dataclass(frozen=True, slots=True)
class DemoConfig:
    """What the demo runs."""

    prompt_tokens: int = 2048
    """About how many prompt tokens (a numbered document; several 256-token chunks)."""
    max_tokens: int = 24
    """Tokens generated per request (greedy, so both nodes must agree)."""
    transport: str = "tcp"
    """``--p2p-transfer-engine`` of both servers."""
    l1_size_mb: float = 1024.0
    """L1 region of each server (SmolLM2 KV is 45 KiB per token in float32)."""
    model_cache_dir: Path | None = None
    """Where the engines keep the converted model (None: their default)."""
    start_timeout_s: float = 600.0
    """How long an engine may take to load its model (the first run converts the GGUF)."""
    workdir: Path | None = None
    """Logs and state of the processes (None: a temporary folder, removed afterwards)."""
    router: bool = False
    """Send both requests through ``kvatlas router`` (``--router``)."""
    router_policy: str = "kv-p2p"
    """The router's ``--policy`` (``--router-policy``)."""


@dataclass(frozen=True, slots=True)
class NodeRun:
    """One request on one node, as the engine and its cache server reported it."""

    node: str
    ttft_ms: float
    cached_tokens: int
    peer_cached_tokens: int
    prefilled_tokens: int
    prompt_tokens: int
    fallback: str | None
    text: str
    peer_bytes_read: int
    route: str = ""
    """The router's ``X-Kvatlas-Route`` header (engine, cached tokens expected, reason);
    empty without a router."""


@dataclass(frozen=True, slots=True)
class DemoResult:
    cold: NodeRun
    warm: NodeRun
    instances: list[InstanceWire]
    directory: StatsResponse | None
    """None when the coordinator did not answer."""

    @property
    def same_text(self) -> bool:
        return self.cold.text == self.warm.text


def build_document(tokens: int) -> str:
    """A deterministic numbered document of about ``tokens`` tokens."""
    lines: list[str] = []
    size = i = 0
    while size < tokens * CHARS_PER_TOKEN:
        i += 1
        line = (
            f"Section {i}: the fleet keeps chunk {i} of this document in memory so that"
            f" node {i % 7} never prefills it twice."
        )
        lines.append(line)
        size += len(line) + 1
    return "\n".join(lines)


def _ask(
    http: httpx.Client, url: str, document: str, max_tokens: int
) -> tuple[dict[str, Any], str]:
    """The answer, and the router's route header (empty when ``url`` is an engine)."""
    body = {
        "messages": [
            {"role": "system", "content": "You answer in one short sentence."},
            {"role": "user", "content": document + "\n\nWhat is this document about?"},
        ],
        "max_tokens": max_tokens,
        "temperature": 0,
        "kv_transfer_params": {"cached_token_stats": True},
    }
    resp = http.post(f"{url}/v1/chat/completions", json=body)
    if resp.status_code != 200:
        raise ProcessError(f"engine {url} answered {resp.status_code}: {resp.text[:300]}")
    answer: dict[str, Any] = resp.json()
    return answer, resp.headers.get(ROUTE_HEADER, "")


def _peer_bytes(fleet: Fleet, i: int) -> int:
    status = fleet.server_status(i)
    if status is None or status.p2p is None:
        return 0
    return status.p2p.bytes_read


def _wait_for_directory(fleet: Fleet, chunks: int, timeout_s: float) -> None:
    """Until the coordinator's directory lists node A's chunks (events flush async)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = fleet.directory_stats()
        if stats is not None and stats.keys >= chunks:
            return
        time.sleep(0.1)


def _node_run(
    node: str, asked: tuple[dict[str, Any], str], peer_bytes: int, urls: list[str]
) -> NodeRun:
    answer, route = asked
    if route:  # the node is the one the router chose
        engine = route.split(";", 1)[0].removeprefix("engine=")
        node = "AB"[urls.index(engine)] if engine in urls else engine
    stats = answer.get("cached_token_stats") or {}
    text = str(answer["choices"][0]["message"]["content"])
    return NodeRun(
        node=node,
        ttft_ms=float(stats.get("ttft_ms", 0.0)),
        cached_tokens=int(stats.get("num_cached_tokens", 0)),
        peer_cached_tokens=int(stats.get("num_peer_cached_tokens", 0)),
        prefilled_tokens=int(stats.get("num_prefilled_tokens", 0)),
        prompt_tokens=int(stats.get("num_prompt_tokens", 0)),
        fallback=stats.get("fallback"),
        text=text,
        peer_bytes_read=peer_bytes,
        route=route,
    )


def run_demo(cfg: DemoConfig, say: Say) -> DemoResult:
    """Start the fleet, send the prompt to A then B, collect the views, stop everything."""
    fcfg = FleetConfig(
        nodes=2,
        l1_size_mb=cfg.l1_size_mb,
        p2p=True,
        p2p_transfer_engine=cfg.transport,
        p2p_lookup_timeout_s=5.0,
        p2p_load_timeout_s=10.0,
        instance_timeout_s=10.0,
        log_level="INFO",
        start_timeout_s=cfg.start_timeout_s,
    )
    document = build_document(cfg.prompt_tokens)
    with Fleet(fcfg, workdir=cfg.workdir) as fleet:
        say(f"starting a coordinator and 2 cache servers (P2P over {cfg.transport})")
        fleet.start(lambda m: say(f"  {m}"))

        def loading(name: str, url: str) -> None:
            note = " (the first run converts the model, ~30 s)" if name == "engine-a" else ""
            say(f"loading {MODEL} for engine {name[-1].upper()} on {url}{note}")

        extra = ("--model-cache-dir", str(cfg.model_cache_dir)) if cfg.model_cache_dir else ()
        urls = fleet.start_engines(
            extra_args=extra, names=("engine-a", "engine-b"), on_start=loading
        )
        fleet.wait_p2p_peers(15.0)
        say("both servers list each other as P2P peers")
        first, second = urls
        if cfg.router:
            # the demo shows decisions, not latency: a loaded machine must not turn a
            # slow lookup into "routed by load"
            first = second = fleet.start_router(cfg.router_policy, ("--lookup-timeout-s", "10"))
            fleet.wait_router_engines(first, len(urls), 30.0)
            say(f"router ({cfg.router_policy}) on {first} sees both engines")
        with httpx.Client(timeout=600.0) as http:
            to = "router" if cfg.router else "node A"
            say(f"{to}: sending a ~{cfg.prompt_tokens}-token prompt (cold)")
            cold = _node_run("A", _ask(http, first, document, cfg.max_tokens), 0, urls)
            _wait_for_directory(fleet, cold.prompt_tokens // fcfg.chunk_size, 5.0)
            if cfg.router:
                say(f"the router sent it to node {cold.node}; now the same prompt again")
            else:
                say("node B: sending the same prompt (B never saw it)")
            before = sum(_peer_bytes(fleet, i) for i in range(2))
            answer = _ask(http, second, document, cfg.max_tokens)
            after = sum(_peer_bytes(fleet, i) for i in range(2))
            warm = _node_run("B", answer, after - before, urls)
        instances = fleet.instances() or []
        directory = fleet.directory_stats()
    return DemoResult(cold, warm, instances, directory)


def render(result: DemoResult, cfg: DemoConfig) -> str:
    """The demo's report as plain text tables."""
    c, w = result.cold, result.warm
    speedup = c.ttft_ms / w.ttft_ms if w.ttft_ms > 0 else float("inf")
    how = "via P2P" if w.node != c.node else "from its own cache"
    head = (
        ("", f"node {c.node} (cold)", f"node {w.node} (warm, {how})")
        if cfg.router
        else ("", "node A (cold)", "node B (warm, via P2P)")
    )
    rows = [
        head,
        ("TTFT", f"{c.ttft_ms:,.0f} ms", f"{w.ttft_ms:,.0f} ms  ({speedup:.1f}x faster)"),
        ("prompt tokens", f"{c.prompt_tokens:,}", f"{w.prompt_tokens:,}"),
        ("cached tokens", f"{c.cached_tokens:,}", f"{w.cached_tokens:,}"),
        ("  of which from peers", f"{c.peer_cached_tokens:,}", f"{w.peer_cached_tokens:,}"),
        ("prefilled tokens", f"{c.prefilled_tokens:,}", f"{w.prefilled_tokens:,}"),
        ("bytes read from the peer", "0", f"{w.peer_bytes_read / 2**20:,.1f} MiB"),
        ("cache fallback", _fallback(c.fallback), _fallback(w.fallback)),
    ]
    if cfg.router:
        rows.append(("router's reason", _reason(c.route), _reason(w.route)))
    width = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["", f"kvatlas demo: {MODEL}, transport {cfg.transport}", ""]
    for k, r in enumerate(rows):
        lines.append("  ".join(cell.ljust(width[i]) for i, cell in enumerate(r)).rstrip())
        if k == 0:
            lines.append("  ".join("-" * n for n in width))
    lines += [
        "",
        f"generated on {c.node}: {c.text!r}",
        f"generated on {w.node}: {w.text!r}",
        "identical: " + ("yes" if result.same_text else "NO"),
        "",
        "the coordinator's view of the fleet:",
    ]
    for inst in result.instances:
        lines.append(
            f"  {inst.instance_id}: incarnation {inst.incarnation},"
            f" p2p {inst.p2p_advertised_url},"
            f" heartbeat {inst.heartbeat_age_s:.1f} s ago"
        )
    d = result.directory
    lines.append(
        f"  directory: {d.keys if d else 0} keys, {d.placements if d else 0} placements"
        f" ({_per_instance(d)})"
    )
    return "\n".join(lines) + "\n"


def _reason(route: str) -> str:
    parts = dict(p.split("=", 1) for p in route.split("; ") if "=" in p)
    return f"{parts.get('reason', '?')} (expected {parts.get('cached', '?')} cached)"


def _fallback(cause: str | None) -> str:
    if not cause:
        return "-"
    if cause.endswith("not_found"):
        return "none: a cold miss, no peer had it"
    return cause


def _per_instance(stats: StatsResponse | None) -> str:
    owners = stats.owners if stats is not None else []
    parts = [f"{o.instance_id} {o.tier}: {o.placements}" for o in owners]
    return ", ".join(parts) or "no placements"
