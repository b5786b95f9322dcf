"""Router-added time with tenants on against off, in one fleet and one run.

    python -m bench.tenant_router_bench [--requests N] [--rounds R] [--tenants 8] [--time-limit 300]

Starts one real loopback fleet (a coordinator, 2 cache servers with P2P, 2 reference
engines on the tiny random model: byte tokens, so a prefill costs milliseconds and the
router's own time is what shows) and two ``kvatlas router --policy kv-p2p --tokenizer
tiny-random`` in front of it, side by side: ``off`` without tenants, ``on`` with
``--tenants FILE`` (``--tenants`` tenants, one API key each, ``client_salt = "replace"``).
Both expose the route header (``--expose-route-header``), whose ``overhead_ms`` is the
router's own time per request.

Each round sends the same pre-encoded ``/v1/completions`` bodies (``max_tokens=1``) to
each router, one at a time through one keep-alive client per router, with each request's
tenant's ``Authorization: Bearer <key>`` in both modes (the ``off`` router ignores it).
Request ``i`` belongs to tenant ``i % tenants`` and opens with one of that tenant's
``--docs-per-tenant`` documents (3/4 of the prompt, in turn) before a tail of its own,
so each tenant repeats its own documents and no document is shared across tenants: the
cached-token share (``usage.prompt_tokens_details.cached_tokens`` over
``usage.prompt_tokens``) must be the same on as off. Every round has documents of its
own, so each router starts each round cold (with tenants its KV lives under the tenants'
salts, without under none: neither mode's round finds the other's KV). Rounds alternate
the order (off, on; then on, off; ...) so drift on a shared machine falls on both; each
figure is a round's, and the table shows the median over rounds and the rounds' range.

What the figures cover:

- ``overhead_ms`` (the route header) is measured inside the router's ``plan()``:
  tokenize, the chunk lookup (per salt with tenants) and the pick. The tenant step
  itself (the gate's ``TenantTable.by_key``, then ``request_salt``, ``salt_for`` and
  ``with_salt`` on the body) runs before ``plan()`` and is not in it;
- the client-observed end-to-end time holds everything: HTTP both ways, the gate, the
  tenant step, the engine's prefill and the relay; less the engine's own time to first
  token (each body asks for ``cached_token_stats``, whose ``ttft_ms`` it is), what is
  left is the router and the HTTP hops ("e2e - engine TTFT"), far less noisy;
- the router-found share (the route header's ``cached=``: what its per-salt lookup
  expected on the engine it chose) and the share of cached tokens a peer served (P2P)
  say whether routing inside a tenant found the holders as it does without tenants;
- the tenant step alone is timed in this process (``timeit``, median of repeats) on a
  pre-encoded ``--step-body-kib`` body, so the table says how many microseconds of the
  difference it is. ``request_salt`` runs in both modes (a client's own ``cache_salt``);
  the rest only with tenants.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import secrets
import statistics
import time
import timeit
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from bench.machine import describe
from bench.router_bench import _words, percentiles
from kvatlas.core.tenancy import TenantTable, key_digest
from kvatlas.evaluation.fleet import Fleet, FleetConfig
from kvatlas.router.tenants import request_salt, with_salt

MODES = ("off", "on")
_OVERHEAD = re.compile(r"overhead_ms=([0-9.]+)")
_CACHED = re.compile(r"cached=(\d+)")
_ENGINE = re.compile(r"engine=([^;]+)")
_TAG = "[tenant-router]"


def say(message: str) -> None:
    print(f"{_TAG} {message}", flush=True)


# ---- the tenants and the workload -------------------------------------------------------


def tenants_document(tenants: int, seed: int) -> tuple[dict[str, Any], list[str]]:
    """A tenants document of ``tenants`` tenants (``t0``, ``t1``, ...), one API key each
    (listed as ``sha256:<hex>``, as an operator should), and one shared namespace open to
    all; and the keys, by tenant index."""
    rng = random.Random(seed)
    keys = [f"kva-{rng.getrandbits(128):032x}" for _ in range(tenants)]
    digests = [key_digest(k).hex() for k in keys]
    doc: dict[str, Any] = {
        "secret": secrets.token_hex(24),
        "client_salt": "replace",
        "shared": {"public": "*"},
        "tenants": {f"t{i}": {"api_keys": [f"sha256:{d}"]} for i, d in enumerate(digests)},
    }
    return doc, keys


def tenants_toml(doc: dict[str, Any]) -> str:
    """``doc`` (as ``tenants_document`` makes it) as TOML: ASCII strings only, whose JSON
    quoting is TOML's basic-string quoting."""
    q = json.dumps
    lines = [f"secret = {q(doc['secret'])}", f"client_salt = {q(doc['client_salt'])}", ""]
    lines.append("[shared]")
    for name, who in doc["shared"].items():
        lines.append(f"{name} = {q(who)}")
    for tid, entry in doc["tenants"].items():
        lines += ["", f"[tenants.{tid}]", f"api_keys = {q(entry['api_keys'])}"]
    return "\n".join(lines) + "\n"


def build_round(
    requests: int, tenants: int, docs_per_tenant: int, prompt_tokens: int, seed: str
) -> tuple[list[tuple[int, bytes]], float]:
    """One round's requests as (tenant index, pre-encoded body), request ``i`` of tenant
    ``i % tenants`` with that tenant's document ``(i // tenants) % docs_per_tenant``
    (fresh documents per ``seed``: a string, as ``random.Random`` takes ``-1`` for ``1``);
    and the share of prompt tokens a perfect per-tenant cache would find (a document's
    tokens again, whole chunks of 256 only)."""
    rng = random.Random(seed)
    head = prompt_tokens * 3 // 4
    docs = [[_words(rng, head) for _ in range(docs_per_tenant)] for _ in range(tenants)]
    out: list[tuple[int, bytes]] = []
    seen: set[tuple[int, int]] = set()
    reusable = 0
    for i in range(requests):
        t, d = i % tenants, (i // tenants) % docs_per_tenant
        if (t, d) in seen:
            reusable += head // 256 * 256
        seen.add((t, d))
        prompt = docs[t][d] + _words(rng, prompt_tokens - head)
        body = {
            "model": "tiny-random",
            "prompt": prompt,
            "max_tokens": 1,
            "kv_transfer_params": {"cached_token_stats": True},
        }
        out.append((t, json.dumps(body).encode()))
    return out, reusable / (requests * prompt_tokens) if requests else 0.0


# ---- the tenant step, in this process ---------------------------------------------------


def tenant_step_us(
    body_bytes: int = 32 << 10, tenants: int = 8, number: int = 2000, repeat: int = 7
) -> dict[str, float]:
    """Microseconds per call (median of ``repeat`` runs of ``number`` calls) of each part
    of the router's tenant step on a pre-encoded body of about ``body_bytes`` bytes
    without a ``cache_salt``: ``by_key`` (the gate), ``request_salt``, ``salt_for``,
    ``with_salt``; ``total``: all four in a row, as the router runs them; ``on_only``:
    ``total`` less ``request_salt`` (which runs without tenants too)."""
    doc, keys = tenants_document(tenants, 0)
    table = TenantTable.from_document(doc)
    filler = _words(random.Random(1), max(0, body_bytes - 60))
    body = json.dumps({"model": "tiny-random", "prompt": filler, "max_tokens": 1}).encode()
    key = keys[-1]
    tenant = table.by_key(key)
    if tenant is None:
        raise RuntimeError("the bench's own key does not authenticate")
    salted = with_salt(body, table.salt_for(tenant, request_salt(body)))
    if request_salt(salted) != tenant.salt:
        raise RuntimeError("with_salt did not set the tenant's salt")

    def whole() -> bytes:
        t = table.by_key(key)
        assert t is not None
        return with_salt(body, table.salt_for(t, request_salt(body)))

    parts: dict[str, Callable[[], object]] = {
        "by_key": lambda: table.by_key(key),
        "request_salt": lambda: request_salt(body),
        "salt_for": lambda: table.salt_for(tenant, None),
        "with_salt": lambda: with_salt(body, tenant.salt),
        "total": whole,
    }
    out: dict[str, float] = {}
    for name, fn in parts.items():
        runs = timeit.Timer(fn).repeat(repeat=repeat, number=number)
        out[name] = round(statistics.median(runs) / number * 1e6, 3)
    out["on_only"] = round(out["total"] - out["request_salt"], 3)
    out["body_bytes"] = float(len(body))
    return out


# ---- the fleet --------------------------------------------------------------------------


def run_round(
    http: httpx.Client,
    items: list[tuple[int, bytes]],
    headers: list[dict[str, str]],
    deadline: float,
) -> dict[str, Any] | None:
    """Send one round's bodies one at a time; its figures, or None if the time ran out."""
    overhead: list[float] = []
    e2e: list[float] = []
    outside: list[float] = []
    engines: Counter[str] = Counter()
    prompt_tokens = cached_tokens = peer_tokens = router_cached = failed = 0
    for tenant, body in items:
        if time.monotonic() > deadline:
            return None
        t = time.perf_counter()
        resp = http.post("/v1/completions", content=body, headers=headers[tenant])
        elapsed = (time.perf_counter() - t) * 1e3
        route = resp.headers.get("x-kvatlas-route", "")
        m = _OVERHEAD.search(route)
        if resp.status_code != 200 or m is None:
            failed += 1
            continue
        overhead.append(float(m.group(1)))
        e2e.append(elapsed)
        c = _CACHED.search(route)
        router_cached += int(c.group(1)) if c else 0
        e = _ENGINE.search(route)
        engines[e.group(1) if e else "?"] += 1
        answer = resp.json()
        usage, stats = answer["usage"], answer["cached_token_stats"]
        prompt_tokens += int(usage["prompt_tokens"])
        cached_tokens += int(usage["prompt_tokens_details"]["cached_tokens"])
        peer_tokens += int(stats["num_peer_cached_tokens"])
        outside.append(elapsed - float(stats["ttft_ms"]))
    return {
        "requests": len(items),
        "failed": failed,
        "overhead_ms": percentiles(overhead),
        "e2e_ms": percentiles(e2e),
        "outside_engine_ms": percentiles(outside),
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached_tokens,
        "peer_cached_tokens": peer_tokens,
        "hit_share": round(cached_tokens / prompt_tokens, 4) if prompt_tokens else 0.0,
        "peer_share": round(peer_tokens / cached_tokens, 4) if cached_tokens else 0.0,
        "router_found_share": round(router_cached / prompt_tokens, 4) if prompt_tokens else 0.0,
        "engines": dict(engines),
    }


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Median over rounds of each round's figure, with the rounds' range."""

    out: dict[str, Any] = {
        "rounds": len(rounds),
        "requests": sum(r["requests"] for r in rounds),
        "failed": sum(r["failed"] for r in rounds),
        "cached_tokens": sum(r["cached_tokens"] for r in rounds),
        "prompt_tokens": sum(r["prompt_tokens"] for r in rounds),
    }
    for key, pick in _FIGURES.items():
        out[key] = _spread([pick(r) for r in rounds])
    return out


def _cell(s: dict[str, float], digits: int = 3) -> str:
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


_FIGURES: dict[str, Callable[[dict[str, Any]], float]] = {
    "overhead_p50_ms": lambda r: r["overhead_ms"]["p50"],
    "overhead_p99_ms": lambda r: r["overhead_ms"]["p99"],
    "e2e_p50_ms": lambda r: r["e2e_ms"]["p50"],
    "outside_engine_p50_ms": lambda r: r["outside_engine_ms"]["p50"],
    "hit_share": lambda r: r["hit_share"],
    "router_found_share": lambda r: r["router_found_share"],
    "peer_share": lambda r: r["peer_share"],
}


def paired(
    off: list[dict[str, Any]], on: list[dict[str, Any]]
) -> dict[str, dict[str, dict[str, float]]]:
    """Each figure on against off within the same round (``ratio``: on / off; ``diff``:
    on - off), median over rounds with the range: a round's two modes ran back to back,
    so drift of a shared machine between rounds cancels out."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for key, pick in _FIGURES.items():
        pairs = [(pick(b), pick(a)) for a, b in zip(off, on, strict=True)]
        ratios = [x / y for x, y in pairs if y]
        diffs = [x - y for x, y in pairs]
        out[key] = {"diff": _spread(diffs)}
        if ratios and key != "peer_share":  # a share near 0: its ratio says nothing
            out[key]["ratio"] = _spread(ratios)
    return out


def _spread(xs: list[float]) -> dict[str, float]:
    return {
        "median": round(statistics.median(xs), 4),
        "min": round(min(xs), 4),
        "max": round(max(xs), 4),
    }


def main(argv: list[str] | None = None) -> dict[str, object]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=96, help="requests per mode per round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per mode (at least 3)")
    ap.add_argument("--tenants", type=int, default=8)
    ap.add_argument("--docs-per-tenant", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--step-body-kib", type=int, default=32, help="body of the in-process step")
    ap.add_argument("--time-limit", type=float, default=300.0, help="seconds for all rounds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--engine-nice",
        type=int,
        default=10,
        help="niceness of the engines above the routers' (as bench.router_bench: their"
        " prefill stands in for accelerator work)",
    )
    args = ap.parse_args(argv)
    if args.rounds < 3:
        ap.error(f"--rounds must be at least 3 (medians over rounds), not {args.rounds}")
    if args.requests < 1 or args.tenants < 1 or args.docs_per_tenant < 1:
        ap.error("--requests, --tenants and --docs-per-tenant must be at least 1")
    if args.prompt_tokens < 512:
        ap.error(f"--prompt-tokens must be at least 512 (two chunks), not {args.prompt_tokens}")
    if not 0 <= args.engine_nice <= 19:
        ap.error(f"--engine-nice must be 0 to 19, not {args.engine_nice}")

    machine = describe()  # before the run: the commit measured, not one made meanwhile
    say(f"tenant step in this process, {args.step_body_kib} KiB body ...")
    step = tenant_step_us(args.step_body_kib << 10, args.tenants)
    say(f"tenant step (us per call): {step}")
    step_fleet = tenant_step_us(args.prompt_tokens + 60, args.tenants)
    say(f"tenant step on the fleet's bodies (us per call): {step_fleet}")

    doc, keys = tenants_document(args.tenants, args.seed)
    headers = [{"content-type": "application/json", "authorization": f"Bearer {k}"} for k in keys]
    rounds_by_mode: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    expected: list[float] = []
    with Fleet(FleetConfig(nodes=2, l1_size_mb=256.0)) as fleet:
        fleet.start(say)
        urls = fleet.start_engines("tiny-random", ("--num-threads", "1"), nice=args.engine_nice)
        tenants_path = fleet.workdir / "tenants.toml"
        tenants_path.write_text(tenants_toml(doc))
        tenants_path.chmod(0o600)
        base = ("--seed", "1", "--tokenizer", "tiny-random")
        # Both routers log to the fleet's router.log (appended): one at WARNING each.
        routers = {
            "off": fleet.start_router("kv-p2p", base),
            "on": fleet.start_router("kv-p2p", (*base, "--tenants", str(tenants_path))),
        }
        for url in routers.values():
            fleet.wait_router_engines(url, len(urls), 60.0)
        say(f"{len(urls)} tiny-random engines, routers off {routers['off']} on {routers['on']}")
        clients = {m: httpx.Client(base_url=u, timeout=60.0) for m, u in routers.items()}
        try:
            warm, _ = build_round(
                2 * args.tenants, args.tenants, 1, args.prompt_tokens, f"warm-up {args.seed}"
            )
            for mode, http in clients.items():
                if run_round(http, warm, headers, float("inf")) is None:
                    raise RuntimeError("warm-up did not run")
                say(f"{mode}: warmed up ({len(warm)} requests)")
            deadline = time.monotonic() + args.time_limit
            for r in range(args.rounds):
                items, share = build_round(
                    args.requests,
                    args.tenants,
                    args.docs_per_tenant,
                    args.prompt_tokens,
                    f"round {args.seed} {r}",
                )
                order = MODES if r % 2 == 0 else MODES[::-1]
                done: dict[str, dict[str, Any]] = {}
                for mode in order:
                    row = run_round(clients[mode], items, headers, deadline)
                    if row is None:
                        break
                    done[mode] = row
                    say(
                        f"round {r + 1}/{args.rounds} {mode}: overhead p50"
                        f" {row['overhead_ms'].get('p50')} p99 {row['overhead_ms'].get('p99')}"
                        f" ms, e2e p50 {row['e2e_ms'].get('p50')} ms (outside the engine"
                        f" {row['outside_engine_ms'].get('p50')} ms), hit share"
                        f" {row['hit_share']:.3f} (expected {share:.3f}),"
                        f" failed {row['failed']}"
                    )
                if len(done) < len(MODES):
                    say(f"time limit reached in round {r + 1}: that round is left out")
                    break
                expected.append(share)
                for mode, row in done.items():
                    rounds_by_mode[mode].append(row)
        finally:
            for http in clients.values():
                http.close()

    if not expected:
        raise RuntimeError("no round finished within --time-limit")
    summary = {m: summarize(rounds_by_mode[m]) for m in MODES}
    result: dict[str, object] = {
        "engines": "2 x tiny-random (kvatlas.cli.engine --num-threads 1)",
        "engine_nice": args.engine_nice,
        "policy": "kv-p2p",
        "router_flags": "--tokenizer tiny-random --expose-route-header",
        "tenants": args.tenants,
        "docs_per_tenant": args.docs_per_tenant,
        "prompt_tokens": args.prompt_tokens,
        "requests_per_round": args.requests,
        "expected_hit_share": round(statistics.median(expected), 4),
        "summary": summary,
        "rounds": rounds_by_mode,
        "tenant_step_us": step,
        "tenant_step_fleet_body_us": step_fleet,
    }
    m = machine
    result["machine"] = m
    print(
        f"\n{args.rounds} rounds x {args.requests} requests per mode requested,"
        f" {len(expected)} done; {args.tenants} tenants x {args.docs_per_tenant} documents,"
        f" {args.prompt_tokens}-token prompts (3/4 document); medians over rounds, the rounds'"
        f" range in brackets. Machine: {m['cores']} cores, {m['cpu']}; commit {m['commit']}."
    )
    print(
        "\n| tenants | router overhead p50 ms | overhead p99 ms | e2e p50 ms"
        " | e2e - engine TTFT p50 ms | cached-token share (expected) | router-found share"
        " | of cached, from a peer | failed |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for mode in MODES:
        s = summary[mode]
        print(
            f"| {mode} | {_cell(s['overhead_p50_ms'])} | {_cell(s['overhead_p99_ms'])}"
            f" | {_cell(s['e2e_p50_ms'], 2)} | {_cell(s['outside_engine_p50_ms'], 2)}"
            f" | {s['hit_share']['median']:.3f} ({result['expected_hit_share']:.3f})"
            f" | {s['router_found_share']['median']:.3f} | {_cell(s['peer_share'])}"
            f" | {s['failed']}/{s['requests']} |"
        )
    pr = paired(rounds_by_mode["off"], rounds_by_mode["on"])
    result["paired"] = pr
    cells = [_cell(pr[k]["ratio"]) if "ratio" in pr[k] else "-" for k in _FIGURES]
    print(f"| on / off, paired | {' | '.join(cells)} | |")
    diffs = [
        f"{label} {d['median'] * 1e3:.0f} ({d['min'] * 1e3:.0f} to {d['max'] * 1e3:.0f})"
        for label, d in (
            ("router overhead p50", pr["overhead_p50_ms"]["diff"]),
            ("e2e p50", pr["e2e_p50_ms"]["diff"]),
            ("e2e - engine TTFT p50", pr["outside_engine_p50_ms"]["diff"]),
        )
    ]
    print(f"\nOn - off, paired (median, range), us: {', '.join(diffs)}.")
    same = [
        a["cached_tokens"] == b["cached_tokens"]
        for a, b in zip(rounds_by_mode["off"], rounds_by_mode["on"], strict=True)
    ]
    result["same_cached_tokens_every_pass"] = all(same)
    print(
        "Cached tokens the same on as off in every pass: "
        + ("yes" if all(same) else f"NO (differ in {same.count(False)} of {len(same)})")
    )
    for st in (step, step_fleet):
        print(
            f"Tenant step in this process ({int(st['body_bytes'])}-byte body, us per call,"
            f" median of repeats): by_key {st['by_key']}, request_salt {st['request_salt']},"
            f" salt_for {st['salt_for']}, with_salt {st['with_salt']}; all four {st['total']},"
            f" of which {st['on_only']} only with tenants."
        )
    out = Path("bench/results")
    out.mkdir(parents=True, exist_ok=True)
    (out / "tenant_router.json").write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
