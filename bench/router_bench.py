"""Router-added latency (tokenize + lookup + pick) for 4,096-token prompts (#16 item 5).

    python -m bench.router_bench [--requests 100] [--prompt-tokens 4096] [--time-limit 300]

Starts a real loopback fleet (a coordinator, 2 cache servers with P2P, 2 reference engines
on the tiny random model: byte tokens, so a prefill of 4k tokens costs milliseconds, not
the ~18 s SmolLM2 takes on a CPU) and ``kvatlas router --policy kv-p2p`` in front, once per
tokenizing mode:

- ``router``: ``--tokenizer tiny-random`` (the engines' own tokenizer, in the router);
- ``engine``: no ``--tokenizer``, the router asks an engine's ``/tokenize``;
- ``router-bpe``: ``--tokenizer smollm2-135m``, the cost of a real BPE tokenizer on a
  4k-token prompt (its ids are not the tiny engines' bytes, so its lookups find no
  holders: the tokenize part is what this mode measures);
- ``router-bpe-threads``: the same with ``--tokenizer-threads 2`` (the prompt in two
  pieces at once).

Each mode sends the same mix, one request at a time through one keep-alive client:
``/v1/completions`` with ``max_tokens=1``, prompts of a few shared prefixes (3/4 of the
prompt) with unique tails, so the coordinator's lookup finds holders. The router's own
figure is read from each response's ``X-Kvatlas-Route`` header (``overhead_ms=``); the
client-observed total is shown beside it for context. Each prompt's length as the engine
sees it is checked from the response's usage. The target is p99 <= 5 ms.

Before the fleet, the ``router-bpe`` prompts' tokenizing alone, in this process, three
ways (each call's wall and process CPU time; the ids must be equal): the engine's path
(transformers, as ``/tokenize`` runs it), the router's (``--tokenizer``: Rust), and the
router's with ``--tokenizer-threads`` (up to 4 pieces at once). CPU time shows the cost
where a shared machine's wall time shows mostly the wait for a core.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import string
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported

import httpx
import numpy as np

from bench.machine import describe
from kvatlas.engine.model import HFTokenizer, load_tokenizer
from kvatlas.engine.openai_proto import decode_tokenize
from kvatlas.engine.prompts import load_prompt_tokenizer, tokenize_ids
from kvatlas.evaluation.fleet import Fleet, FleetConfig

TARGET_P99_MS = 5.0
MODES = {
    "router": ("--tokenizer", "tiny-random"),
    "engine": (),
    "router-bpe": ("--tokenizer", "smollm2-135m"),
    "router-bpe-threads": ("--tokenizer", "smollm2-135m", "--tokenizer-threads", "2"),
}
_OVERHEAD = re.compile(r"overhead_ms=([0-9.]+)")
_CACHED = re.compile(r"cached=(\d+)")
_STAGES = ("tokenize", "hash", "lookup", "lookup_server", "pick", "overhead_gc", "overhead")
"""The router's histograms of each step (``kvatlas_router_<step>_seconds``)."""


def stage_means_ms(metrics: str) -> dict[str, float]:
    """Mean of each of the router's step histograms (its /metrics), and the seconds its
    process spent in the garbage collector (``gc_total``)."""
    out: dict[str, float] = {}
    for stage in _STAGES:
        base = f"kvatlas_router_{stage}_seconds"
        total = re.search(rf"^{base}_sum (\S+)$", metrics, re.M)
        count = re.search(rf"^{base}_count (\S+)$", metrics, re.M)
        if total and count and float(count.group(1)) > 0:
            out[stage] = round(float(total.group(1)) / float(count.group(1)) * 1e3, 3)
    paused = re.findall(r"^kvatlas_router_gc_pause_seconds_total\{[^}]*\} (\S+)$", metrics, re.M)
    if paused:
        out["gc_total"] = round(sum(map(float, paused)) * 1e3, 3)
    return out


def _words(rng: random.Random, n_chars: int) -> str:
    """``n_chars`` of ASCII words (one byte per character, so one tiny-model token each)."""
    out: list[str] = []
    size = 0
    while size < n_chars:
        w = "".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9)))
        out.append(w)
        size += len(w) + 1
    return " ".join(out)[:n_chars]


def _bpe_fit(text: str, n_tokens: int, encode: Any) -> str:
    """The longest prefix of ``text`` (cut at a space) of at most ``n_tokens`` BPE tokens."""
    lo, hi = 0, len(text)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(encode(text[:mid])) <= n_tokens:
            lo = mid
        else:
            hi = mid - 1
    return text[:lo]


def build_prompts(
    n: int, prompt_tokens: int, prefixes: int, seed: int, bpe: bool
) -> tuple[list[str], list[int]]:
    """``n`` prompts of ``prompt_tokens`` tokens (bytes, or SmolLM2 BPE tokens with ``bpe``):
    a shared prefix of 3/4 of the prompt (one of ``prefixes``, in turn) and a unique tail;
    and each prompt's token count by the bench's own tokenizer."""
    rng = random.Random(seed)
    head = prompt_tokens * 3 // 4
    if not bpe:
        heads = [_words(rng, head) for _ in range(prefixes)]
        prompts = [heads[i % prefixes] + _words(rng, prompt_tokens - head) for i in range(n)]
        return prompts, [len(p.encode()) for p in prompts]
    encode = load_tokenizer("smollm2-135m").encode
    # ~4 characters per BPE token on random words is an overestimate: fit from more text.
    heads = [_bpe_fit(_words(rng, head * 6), head, encode) for _ in range(prefixes)]
    prompts = []
    for i in range(n):
        h = heads[i % prefixes]
        tail = _bpe_fit(_words(rng, (prompt_tokens - head) * 6), prompt_tokens - head, encode)
        prompts.append(h + tail)
    return prompts, [len(encode(p)) for p in prompts]


def percentiles(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {}
    a = np.asarray(xs)
    return {
        "n": len(xs),
        "p50": round(float(np.percentile(a, 50)), 3),
        "p99": round(float(np.percentile(a, 99)), 3),
        "mean": round(float(a.mean()), 3),
        "max": round(float(a.max()), 3),
    }


def run_mode(
    fleet: Fleet, mode: str, bodies: list[bytes], engines: int, deadline: float
) -> dict[str, Any]:
    router = fleet.start_router("kv-p2p", ("--seed", "1", *MODES[mode]))
    fleet.wait_router_engines(router, engines, 60.0)
    overhead: list[float] = []
    total: list[float] = []
    engine_tokens: list[int] = []
    cached = 0
    failed = 0
    headers = {"content-type": "application/json"}
    with httpx.Client(base_url=router, timeout=60.0) as http:
        for i, body in enumerate(bodies):
            if time.monotonic() > deadline:
                print(f"[router] {mode}: time limit reached after {i} requests", flush=True)
                break
            t = time.perf_counter()
            resp = http.post("/v1/completions", content=body, headers=headers)
            elapsed = (time.perf_counter() - t) * 1e3
            route = resp.headers.get("x-kvatlas-route", "")
            m = _OVERHEAD.search(route)
            if resp.status_code != 200 or m is None:
                failed += 1
                continue
            overhead.append(float(m.group(1)))
            total.append(elapsed)
            c = _CACHED.search(route)
            cached += int(c.group(1)) if c else 0
            engine_tokens.append(int(resp.json()["usage"]["prompt_tokens"]))
            if (i + 1) % 20 == 0:
                print(
                    f"[router] {mode}: {i + 1}/{len(bodies)}, overhead p50"
                    f" {np.percentile(overhead, 50):.2f} ms",
                    flush=True,
                )
        means = stage_means_ms(http.get("/metrics").text)
    fleet.stop(fleet.extras.pop())  # this mode's router: the next mode starts its own
    return {
        "mode": mode,
        "router_flags": list(MODES[mode]),
        "requests": len(overhead) + failed,
        "failed": failed,
        "overhead_ms": percentiles(overhead),
        "client_total_ms": percentiles(total),
        "router_mean_ms": means,
        "expected_cached_tokens": cached,
        "engine_prompt_tokens": percentiles([float(t) for t in engine_tokens]),
        "meets_target": bool(overhead) and float(np.percentile(overhead, 99)) <= TARGET_P99_MS,
    }


def tokenize_costs(bodies: list[bytes]) -> dict[str, Any]:
    """Wall and CPU ms per body of SmolLM2's tokenizing, the engine's way and the
    router's (see the module doc); RuntimeError if their ids differ."""
    hf = load_tokenizer("smollm2-135m")
    assert isinstance(hf, HFTokenizer)
    threads = min(4, os.cpu_count() or 1)
    router = load_prompt_tokenizer("smollm2-135m")
    pieces = load_prompt_tokenizer("smollm2-135m", threads)
    ways: dict[str, Any] = {
        "engine (transformers)": lambda b: tokenize_ids(hf, decode_tokenize(b), None),
        "router (--tokenizer: rust, one piece)": router.ids,
        f"router, --tokenizer-threads {threads}": pieces.ids,
    }
    out: dict[str, Any] = {}
    first: list[list[int]] = []
    for name, way in ways.items():
        wall: list[float] = []
        cpu: list[float] = []
        ids = []
        way(bodies[0])  # warm
        for b in bodies:
            t, c = time.perf_counter(), time.process_time()
            ids.append(way(b))
            cpu.append((time.process_time() - c) * 1e3)
            wall.append((time.perf_counter() - t) * 1e3)
        if not first:
            first = ids
        elif ids != first:
            raise RuntimeError(f"{name}: ids differ from the engine's")
        out[name] = {"wall_ms": percentiles(wall), "cpu_ms": percentiles(cpu)}
        print(f"[router] tokenize {name}: wall {out[name]['wall_ms']}", flush=True)
    return out


def main(argv: list[str] | None = None) -> dict[str, object]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=100, help="requests per mode")
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--prefixes", type=int, default=4, help="shared prefixes in the mix")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--time-limit", type=float, default=300.0, help="seconds per mode")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    rows: list[dict[str, Any]] = []
    bpe, _ = build_prompts(args.requests, args.prompt_tokens, args.prefixes, args.seed, True)
    costs = tokenize_costs(
        [json.dumps({"model": "x", "prompt": p, "max_tokens": 1}).encode() for p in bpe]
    )
    with Fleet(FleetConfig(nodes=2, l1_size_mb=256.0)) as fleet:
        fleet.start(lambda m: print(f"[router] {m}", flush=True))
        urls = fleet.start_engines("tiny-random", ("--num-threads", "1"))
        print(f"[router] {len(urls)} tiny-random engines up", flush=True)
        for k, mode in enumerate(args.modes):
            # A seed per mode: each mode starts with its prefixes not yet cached anywhere.
            prompts, counted = build_prompts(
                args.requests,
                args.prompt_tokens,
                args.prefixes,
                args.seed + k,
                mode.startswith("router-bpe"),
            )
            bodies = [
                json.dumps({"model": "tiny-random", "prompt": p, "max_tokens": 1}).encode()
                for p in prompts
            ]
            print(
                f"[router] {mode}: {len(bodies)} prompts of {min(counted)}-{max(counted)}"
                " tokens (bench's count)",
                flush=True,
            )
            row = run_mode(fleet, mode, bodies, len(urls), time.monotonic() + args.time_limit)
            row["bench_prompt_tokens"] = percentiles([float(c) for c in counted])
            rows.append(row)

    result: dict[str, object] = {
        "machine": describe(),
        "engines": "2 x tiny-random (kvatlas.cli.engine --num-threads 1)",
        "policy": "kv-p2p",
        "target_p99_ms": TARGET_P99_MS,
        "rows": rows,
        "tokenize_smollm2": costs,
    }
    print(
        "\n| tokenizing | engine prompt tokens (p50) | router-added p50 | router-added p99"
        " | mean tokenize / hash / lookup (coordinator's part) / pick | client total p50 / p99"
        " | p99 <= 5 ms | failed |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        o, c, m = r["overhead_ms"], r["client_total_ms"], r["router_mean_ms"]
        print(
            f"| {r['mode']} {' '.join(r['router_flags'])} | {r['engine_prompt_tokens'].get('p50')}"
            f" | {o.get('p50')} ms | {o.get('p99')} ms"
            f" | {m.get('tokenize')} / {m.get('hash')} / {m.get('lookup')}"
            f" ({m.get('lookup_server')}) / {m.get('pick')} ms"
            f" | {c.get('p50')} / {c.get('p99')} ms"
            f" | {'yes' if r['meets_target'] else 'no'} | {r['failed']}/{r['requests']} |"
        )
    print("\n| SmolLM2 tokenizing, 4k tokens | wall p50 / p99 | CPU p50 / p99 |")
    print("|---|---|---|")
    for name, cost in costs.items():
        if isinstance(cost, dict):
            w, c = cost["wall_ms"], cost["cpu_ms"]
            print(f"| {name} | {w['p50']} / {w['p99']} ms | {c['p50']} / {c['p99']} ms |")
    out = Path("bench/results")
    out.mkdir(parents=True, exist_ok=True)
    (out / "router.json").write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
