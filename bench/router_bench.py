"""Router-added latency (tokenize + lookup + pick) for 4,096-token prompts.

    python -m bench.router_bench [--requests 100] [--prompt-tokens 4096] [--time-limit 300]

Starts a real loopback fleet (a coordinator, 2 cache servers with P2P, 2 reference engines
on the tiny random model: byte tokens, so a prefill of 4k tokens costs milliseconds, not
the seconds SmolLM2 takes on a CPU) and ``kvatlas router --policy kv-p2p`` in front, once per
tokenizing mode:

- ``router``: ``--tokenizer tiny-random`` (the engines' own tokenizer, in the router);
- ``engine``: no ``--tokenizer``, the router asks an engine's ``/tokenize``;
- ``router-bpe``: ``--tokenizer smollm2-135m``, the cost of a real BPE tokenizer (its ids
  are not the tiny engines' bytes, so its lookups find no holders: the tokenize part is
  what this mode measures), with the router's piece cache (``--tokenizer-cache-mb``, on
  by default);
- ``router-bpe-nocache``: the same with ``--tokenizer-cache-mb 0``: every prompt encoded
  whole, as a prompt that shares nothing with recent ones is;
- ``router-bpe-tokenizers``: ``router-bpe`` with ``--tokenizer-encoder tokenizers``:
  Hugging Face tokenizers' own encoder instead of fastokens (the router's default), side
  by side.

What "``--prompt-tokens`` tokens" means: tokens as the router's tokenizer counts them,
which is the model's own. For ``router`` and ``engine`` that is the tiny engines' byte
tokens, checked against each answer's ``usage.prompt_tokens``. For the ``router-bpe``
modes the prompt text is built word by word so that SmolLM2's tokenizer yields exactly
that many tokens (checked here on the whole text, and against the router's own count,
``kvatlas_router_prompt_tokens_total``); the tiny engines behind count the same text in
bytes (more than one per token: the "engine prompt tokens" column), which is not what is measured.

Each mode sends the same kind of mix, one request at a time through one keep-alive
client: ``/v1/completions`` with ``max_tokens=1``, prompts of a few shared prefixes (3/4 of
the prompt, one of ``--prefixes`` in turn) with unique tails, so the coordinator's lookup
finds holders and the router's piece cache sees the prefixes again (the first request of
each prefix finds nothing: with 4 prefixes in 100 requests, those 4 are the p99; the
``repeat`` figures leave them out). The router's own figure is read from each response's
``X-Kvatlas-Route`` header (``overhead_ms=``); the client-observed total is shown beside it
for context. The target is p99 <= 5 ms.

Before the fleet, the ``router-bpe`` prompts' tokenizing alone, in this process (each
call's wall and process CPU time; the ids must be equal): the engine's path
(transformers, as ``/tokenize`` runs it), and the router's with each encoder (Hugging
Face tokenizers' Rust encoder: whole, with ``--tokenizer-threads`` (up to 4 pieces at
once), with the piece cache (the mix's prefixes come again); fastokens: whole, and with
the piece cache, the router's default). CPU time shows the cost where a shared machine's
wall time shows mostly the wait for a core.
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
from kvatlas.evaluation.fleet import Fleet, FleetConfig
from kvatlas.tokenize.prompts import load_prompt_tokenizer, pack_ids, tokenize_ids
from kvatlas.tokenize.request_shapes import decode_tokenize

TARGET_P99_MS = 5.0
MODES = {
    "router": ("--tokenizer", "tiny-random"),
    "engine": (),
    "router-bpe": ("--tokenizer", "smollm2-135m"),
    "router-bpe-nocache": ("--tokenizer", "smollm2-135m", "--tokenizer-cache-mb", "0"),
    "router-bpe-tokenizers": ("--tokenizer", "smollm2-135m", "--tokenizer-encoder", "tokenizers"),
}
_OVERHEAD = re.compile(r"overhead_ms=([0-9.]+)")
_CACHED = re.compile(r"cached=(\d+)")
_CACHE_BYTES = 64 << 20
"""The router's default ``--tokenizer-cache-mb``, for the in-process comparison."""
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


def router_counts(metrics: str) -> dict[str, float]:
    """The router's own count of the prompt tokens it tokenized and looked up
    (``prompt_tokens``), and its piece cache's tokens by result (``cache_hit_tokens``,
    ``cache_miss_tokens``; absent without a cache)."""
    out: dict[str, float] = {}
    found = re.search(r"^kvatlas_router_prompt_tokens_total (\S+)$", metrics, re.M)
    if found:
        out["prompt_tokens"] = float(found.group(1))
    for result in ("hit", "miss"):
        found = re.search(
            rf'^kvatlas_router_tokenize_cache_tokens_total\{{result="{result}"\}} (\S+)$',
            metrics,
            re.M,
        )
        if found:
            out[f"cache_{result}_tokens"] = float(found.group(1))
    return out


def _words(rng: random.Random, n_chars: int) -> str:
    """``n_chars`` of ASCII words (one byte per character, so one tiny-model token each)."""
    out: list[str] = []
    size = 0
    while size < n_chars:
        w = "".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9)))
        out.append(w)
        size += len(w) + 1
    return (" ".join(out) + "x")[:n_chars]  # the join is n_chars - 1 long at times


def _bpe_words(rng: random.Random, n_tokens: int, backend: Any, lead: bool) -> str:
    """ASCII words, each after a space (but the first unless ``lead``), of exactly
    ``n_tokens`` tokens of ``backend`` (a byte-level BPE's Rust tokenizer): a space after
    a word always starts a new pre-token, so the text's tokens are its words' tokens
    added up; single letters (one token each) fill the end."""
    words = _words(rng, n_tokens * 6).split(" ")
    spaced = [w if k == 0 and not lead else " " + w for k, w in enumerate(words)]
    counts = [len(e.ids) for e in backend.encode_batch_fast(spaced, add_special_tokens=False)]
    out: list[str] = []
    total = 0
    for w, c in zip(spaced, counts, strict=True):
        if total + c > n_tokens:
            break
        out.append(w)
        total += c
    while total < n_tokens:
        out.append(" a" if out or lead else "a")
        total += 1
    return "".join(out)


def build_prompts(
    n: int, prompt_tokens: int, prefixes: int, seed: int, bpe: bool
) -> tuple[list[str], list[int]]:
    """``n`` prompts of ``prompt_tokens`` tokens (bytes, or SmolLM2 BPE tokens with ``bpe``):
    a shared prefix of 3/4 of the prompt (one of ``prefixes``, in turn) and a unique tail;
    and each prompt's token count, by the bench's own tokenizer on the whole text
    (RuntimeError if a BPE prompt is not exactly ``prompt_tokens``)."""
    rng = random.Random(seed)
    head = prompt_tokens * 3 // 4
    if not bpe:
        heads = [_words(rng, head) for _ in range(prefixes)]
        prompts = [heads[i % prefixes] + _words(rng, prompt_tokens - head) for i in range(n)]
        return prompts, [len(p.encode()) for p in prompts]
    hf = load_tokenizer("smollm2-135m")
    assert isinstance(hf, HFTokenizer)
    backend = hf.inner.backend_tokenizer  # its Rust tokenizer, as the router's
    heads = [_bpe_words(rng, head, backend, False) for _ in range(prefixes)]
    prompts = [
        heads[i % prefixes] + _bpe_words(rng, prompt_tokens - head, backend, True) for i in range(n)
    ]
    counted = [len(e.ids) for e in backend.encode_batch_fast(prompts, add_special_tokens=False)]
    if any(c != prompt_tokens for c in counted):
        raise RuntimeError(f"BPE prompts of {sorted(set(counted))} tokens, not {prompt_tokens}")
    return prompts, counted


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
    fleet: Fleet, mode: str, bodies: list[bytes], engines: int, deadline: float, prefixes: int
) -> dict[str, Any]:
    router = fleet.start_router("kv-p2p", ("--seed", "1", *MODES[mode]))
    fleet.wait_router_engines(router, engines, 60.0)
    overhead: list[float] = []
    repeat: list[float] = []
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
            if i >= prefixes:
                repeat.append(overhead[-1])
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
        metrics = http.get("/metrics").text
        means = stage_means_ms(metrics)
        counts = router_counts(metrics)
    fleet.stop(fleet.extras.pop())  # this mode's router: the next mode starts its own
    return {
        "mode": mode,
        "router_flags": list(MODES[mode]),
        "requests": len(overhead) + failed,
        "failed": failed,
        "overhead_ms": percentiles(overhead),
        "overhead_each_ms": overhead,
        "overhead_repeat_ms": percentiles(repeat),
        "router_counts": counts,
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
    rust = load_prompt_tokenizer("smollm2-135m", fast=False)
    pieces = load_prompt_tokenizer("smollm2-135m", threads, fast=False)
    rust_cached = load_prompt_tokenizer("smollm2-135m", 1, _CACHE_BYTES, fast=False)
    fast = load_prompt_tokenizer("smollm2-135m")
    fast_cached = load_prompt_tokenizer("smollm2-135m", 1, _CACHE_BYTES)
    ways: dict[str, Any] = {
        "engine (transformers)": lambda b: pack_ids(tokenize_ids(hf, decode_tokenize(b), None)),
        "router, tokenizers (rust), whole, no cache": rust.blob,
        f"router, tokenizers, --tokenizer-threads {threads}, no cache": pieces.blob,
        "router, tokenizers, piece cache (the mix's prefixes again)": rust_cached.blob,
        "router, fastokens, whole, no cache": fast.blob,
        "router, fastokens, piece cache (the router's default)": fast_cached.blob,
    }
    out: dict[str, Any] = {}
    first: list[bytes] = []
    warm = json.dumps({"prompt": "warm up the tokenizer's paths", "max_tokens": 1}).encode()
    for name, way in ways.items():
        wall: list[float] = []
        cpu: list[float] = []
        ids = []
        way(warm)
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
    ap.add_argument(
        "--engine-nice",
        type=int,
        default=10,
        help="niceness of the engines above the router's (default 10: their prefill stands"
        " in for accelerator work, which a real router does not wait for a CPU behind;"
        " 0: all alike)",
    )
    args = ap.parse_args(argv)
    if not 0 <= args.engine_nice <= 19:
        ap.error(f"--engine-nice must be 0 to 19, not {args.engine_nice}")

    rows: list[dict[str, Any]] = []
    bpe, _ = build_prompts(args.requests, args.prompt_tokens, args.prefixes, args.seed, True)
    costs = tokenize_costs(
        [json.dumps({"model": "x", "prompt": p, "max_tokens": 1}).encode() for p in bpe]
    )
    with Fleet(FleetConfig(nodes=2, l1_size_mb=256.0)) as fleet:
        fleet.start(lambda m: print(f"[router] {m}", flush=True))
        urls = fleet.start_engines("tiny-random", ("--num-threads", "1"), nice=args.engine_nice)
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
            row = run_mode(
                fleet, mode, bodies, len(urls), time.monotonic() + args.time_limit, args.prefixes
            )
            row["bench_prompt_tokens"] = percentiles([float(c) for c in counted])
            routed = row["requests"] - row["failed"]
            counted_by_router = row["router_counts"].get("prompt_tokens", 0.0)
            row["router_prompt_tokens_mean"] = round(counted_by_router / routed, 1) if routed else 0
            if mode != "engine" and routed == len(bodies) and counted_by_router != sum(counted):
                raise RuntimeError(
                    f"{mode}: the router counted {counted_by_router:.0f} prompt tokens, the"
                    f" bench {sum(counted)}"
                )
            rows.append(row)

    result: dict[str, object] = {
        "machine": describe(),
        "engines": "2 x tiny-random (kvatlas.cli.engine --num-threads 1)",
        "engine_nice": args.engine_nice,
        "policy": "kv-p2p",
        "target_p99_ms": TARGET_P99_MS,
        "rows": rows,
        "tokenize_smollm2": costs,
    }
    print(
        "\n| tokenizing | prompt tokens (router's count, mean) | engine prompt tokens (p50)"
        " | router-added p50 | p99 | p99 without each prefix's first"
        " | mean tokenize / hash / lookup (coordinator's part) / pick"
        " | cache hit tokens | client total p50 / p99 | p99 <= 5 ms | failed |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        o, c, m = r["overhead_ms"], r["client_total_ms"], r["router_mean_ms"]
        counts = r["router_counts"]
        hit = counts.get("cache_hit_tokens")
        seen = hit + counts.get("cache_miss_tokens", 0.0) if hit is not None else 0.0
        share = f"{hit / seen:.0%}" if hit is not None and seen else "-"
        print(
            f"| {r['mode']} {' '.join(r['router_flags'])} | {r['router_prompt_tokens_mean']}"
            f" | {r['engine_prompt_tokens'].get('p50')}"
            f" | {o.get('p50')} ms | {o.get('p99')} ms | {r['overhead_repeat_ms'].get('p99')} ms"
            f" | {m.get('tokenize')} / {m.get('hash')} / {m.get('lookup')}"
            f" ({m.get('lookup_server')}) / {m.get('pick')} ms | {share}"
            f" | {c.get('p50')} / {c.get('p99')} ms"
            f" | {'yes' if r['meets_target'] else 'no'} | {r['failed']}/{r['requests']} |"
        )
    print(
        f"\n| SmolLM2 tokenizing, {args.prompt_tokens} tokens, in this process"
        " | wall p50 / p99 | CPU p50 / p99 |"
    )
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
