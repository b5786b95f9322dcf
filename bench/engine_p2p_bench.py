"""TTFT cold vs warm through P2P on SmolLM2, measured side by side in one run.

    python -m bench.engine_p2p_bench [--lengths 1024 2048 4096] [--repeats 3]

A coordinator, two cache servers with P2P (tcp) and two reference engines on 127.0.0.1.
For each prompt length and repeat, a fresh prompt (random token ids, a whole number of
256-token chunks) goes to engine A (cold: full prefill), then to engine B, which never
saw it (warm: its server reads the KV from A's L1), then to A again (warm, local L1).
Reports medians of TTFT per case, the cold/warm ratio, and where the warm time went, for
B (through P2P) and A (local L1) side by side: the engine's
`cached_token_stats.breakdown_ms` (lookup round trip with the server's P2P steps inside
it, checksum verification, building the model cache, the suffix prefill with the one
copy of the prefix) and `other`, the rest of the TTFT (HTTP parsing, the queue to the
model worker, sampling the first token).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench.machine import describe
from kvatlas.evaluation.fleet import Fleet, FleetConfig

VOCAB = (100, 45000)
# the steps that add up to the engine's TTFT; p2p_* are parts of "lookup"
_TOP_STEPS = ("lookup", "verify", "build_cache", "prefill")


def _complete(http: httpx.Client, url: str, prompt: list[int]) -> dict[str, Any]:
    body = {
        "prompt": prompt,
        "max_tokens": 2,
        "temperature": 0,
        "kv_transfer_params": {"cached_token_stats": True},
    }
    resp = http.post(f"{url}/v1/completions", json=body)
    resp.raise_for_status()
    stats: dict[str, Any] = resp.json()["cached_token_stats"]
    return stats


def _breakdown(stats: list[dict[str, Any]]) -> dict[str, float]:
    """Median of each step over the repeats, with ``ttft`` and ``other`` (TTFT minus the
    engine's steps: HTTP, queueing, sampling)."""
    per_run = []
    for st in stats:
        steps = dict(st.get("breakdown_ms", {}))
        steps["ttft"] = st["ttft_ms"]
        steps["other"] = st["ttft_ms"] - sum(steps.get(k, 0.0) for k in _TOP_STEPS)
        per_run.append(steps)
    keys = {k for steps in per_run for k in steps}
    return {k: statistics.median(steps.get(k, 0.0) for steps in per_run) for k in keys}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--transfer-engine", default="tcp")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(7)
    cfg = FleetConfig(
        nodes=2,
        l1_size_mb=2048.0,
        p2p_transfer_engine=args.transfer_engine,
        p2p_lookup_timeout_s=5.0,
        p2p_load_timeout_s=20.0,
        instance_timeout_s=10.0,
        start_timeout_s=600.0,
    )
    rows: list[dict[str, Any]] = []
    with Fleet(cfg) as fleet:
        fleet.start(lambda m: print(f"[engine-p2p] {m}", flush=True))
        urls = fleet.start_engines(
            names=("engine-a", "engine-b"),
            on_start=lambda name, _url: print(f"[engine-p2p] loading {name}", flush=True),
        )
        fleet.wait_p2p_peers(30.0)
        with httpx.Client(timeout=600.0) as http:
            _complete(http, urls[0], rng.integers(*VOCAB, 300).tolist())  # warm up the model
            _complete(http, urls[1], rng.integers(*VOCAB, 300).tolist())
            for n in args.lengths:
                for r in range(args.repeats):
                    prompt = rng.integers(*VOCAB, n).tolist()
                    cold = _complete(http, urls[0], prompt)
                    time.sleep(0.5)  # the directory learns of A's chunks (flush interval)
                    warm_p2p = _complete(http, urls[1], prompt)
                    warm_local = _complete(http, urls[0], prompt)
                    print(
                        f"[engine-p2p] {n} tokens, repeat {r + 1}: cold {cold['ttft_ms']:.0f} ms,"
                        f" P2P {warm_p2p['ttft_ms']:.0f} ms"
                        f" ({warm_p2p['num_peer_cached_tokens']} tokens from the peer),"
                        f" local {warm_local['ttft_ms']:.0f} ms",
                        flush=True,
                    )
                    rows.append(
                        {"tokens": n, "cold": cold, "warm_p2p": warm_p2p, "warm_local": warm_local}
                    )
    summary = []
    print(
        "\n| prompt tokens | TTFT cold (A) | TTFT warm via P2P (B) | TTFT warm local (A) |"
        " cold / P2P | tokens from peer | target |\n|---|---|---|---|---|---|---|"
    )
    for n in args.lengths:
        mine = [r for r in rows if r["tokens"] == n]
        cold = statistics.median(r["cold"]["ttft_ms"] for r in mine)
        p2p = statistics.median(r["warm_p2p"]["ttft_ms"] for r in mine)
        local = statistics.median(r["warm_local"]["ttft_ms"] for r in mine)
        peer = min(r["warm_p2p"]["num_peer_cached_tokens"] for r in mine)
        target = ">= 60x" if n == 4096 else ""
        print(
            f"| {n} | {cold:,.0f} ms | {p2p:,.0f} ms | {local:,.0f} ms | {cold / p2p:.1f}x |"
            f" {peer} | {target} |"
        )
        summary.append(
            {"tokens": n, "cold_ms": cold, "warm_p2p_ms": p2p, "warm_local_ms": local,
             "ratio": cold / p2p, "peer_tokens_min": peer,
             "warm_p2p_breakdown_ms": _breakdown([r["warm_p2p"] for r in mine]),
             "warm_local_breakdown_ms": _breakdown([r["warm_local"] for r in mine])}
        )  # fmt: skip
    print("\nWhere the warm time goes (medians, ms; p2p_* steps are inside lookup):\n")
    order = ["lookup", "p2p_", "verify", "build_cache", "prefill", "other", "ttft"]
    keys = sorted(
        {k for s in summary for case in ("p2p", "local") for k in s[f"warm_{case}_breakdown_ms"]},
        key=lambda k: (order.index("p2p_" if k.startswith("p2p_") else k), k),
    )
    heads = [f"{s['tokens']} tokens, {case}" for s in summary for case in ("P2P (B)", "local (A)")]
    print("| step | " + " | ".join(heads) + " |")
    print("|---|" + "---|" * len(heads))
    for k in keys:
        cells = " | ".join(
            f"{s[f'warm_{case}_breakdown_ms'].get(k, 0.0):.1f}"
            for s in summary
            for case in ("p2p", "local")
        )
        print(f"| {k} | {cells} |")
    out = Path("bench/results")
    out.mkdir(parents=True, exist_ok=True)
    (out / "engine_p2p.json").write_text(
        json.dumps({"machine": describe(), "summary": summary, "runs": rows}, indent=2)
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
