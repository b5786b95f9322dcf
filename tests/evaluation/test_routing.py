"""The routing phase's pure parts: the seeded workload, the offline one-cache limit, the
targets and the report (the runs themselves need SmolLM2 engines: ``kvatlas bench fleet
--routing``, docs/fleet-evaluation/routing/)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvatlas.evaluation.routing import (
    Pace,
    Request,
    RoutingConfig,
    arrival_rate,
    calibration_prompts,
    one_cache_hits,
    one_cache_limit,
    short_of_limit,
    targets,
    workload,
)
from kvatlas.evaluation.routing_report import write_routing


def test_the_workload_is_seeded_and_mixes_the_three_kinds() -> None:
    cfg = RoutingConfig(requests=60, seed=3)
    a, b = workload(cfg), workload(cfg)
    assert [r.tokens for r in a] == [r.tokens for r in b]
    assert [r.tokens for r in workload(RoutingConfig(requests=60, seed=4))] != [r.tokens for r in a]
    kinds = {k: sum(r.kind == k for r in a) for k in ("doc", "chat", "unique")}
    assert all(n >= 8 for n in kinds.values()), kinds
    docs = [r.tokens[: cfg.doc_tokens] for r in a if r.kind == "doc"]
    assert len({tuple(d) for d in docs}) <= cfg.hot_docs  # questions share hot documents


def test_the_arrival_rate_is_the_load_of_the_fleets_prefill_capacity() -> None:
    # 4 engines at 200 tokens/s recompute 800 tokens/s: 1 request/s of 800 tokens is
    # load 1; at load 0.9, 0.9 requests/s
    assert arrival_rate(1.0, 4, 200.0, 800.0) == pytest.approx(1.0)
    assert arrival_rate(0.9, 4, 200.0, 800.0) == pytest.approx(0.9)
    # twice the engines or half the prompt: twice the rate
    assert arrival_rate(0.9, 8, 200.0, 800.0) == pytest.approx(1.8)
    assert arrival_rate(0.9, 4, 200.0, 400.0) == pytest.approx(1.8)
    for bad in ((0.0, 4, 200.0, 800.0), (0.9, 0, 200.0, 800.0), (0.9, 4, 0.0, 800.0),
                (0.9, 4, 200.0, 0.0), (-1.0, 4, 200.0, 800.0)):  # fmt: skip
        with pytest.raises(ValueError, match="positive"):
            arrival_rate(*bad)


def test_the_first_calibration_sets_the_rate_of_every_run() -> None:
    pace = Pace(load=0.5, mean_prompt_tokens=500.0)
    assert pace.rate(4, [100.0, 300.0]) == pytest.approx(0.5 * 4 * 200.0 / 500.0)
    assert pace.prefill_tokens_per_s == pytest.approx(200.0)
    assert pace.rate(4, [1000.0, 1000.0]) == pytest.approx(0.8)  # later runs: unchanged
    given = Pace(load=0.5, mean_prompt_tokens=500.0, rate_per_s=2.5)
    assert given.rate(4, [100.0]) == 2.5 and given.prefill_tokens_per_s is None


def test_calibration_prompts_are_the_mean_length_and_share_no_chunk_with_the_workload() -> None:
    cfg = RoutingConfig(requests=60, seed=3, calibration_rounds=3)
    reqs = workload(cfg)
    prompts = calibration_prompts(cfg, 700.4)
    assert len(prompts) == 3 and {len(p) for p in prompts} == {700}
    assert prompts == calibration_prompts(cfg, 700.4)
    first_chunks = {tuple(r.tokens[:256]) for r in reqs} | {tuple(p[:256]) for p in prompts[1:]}
    assert tuple(prompts[0][:256]) not in first_chunks


def test_the_one_cache_limit_serves_leading_chunks_under_lru() -> None:
    x, y, z = [1] * 4, [2] * 4, [3] * 4
    reqs = [Request("doc", x + y), Request("doc", x + y + [9]), Request("doc", x + z)]
    # capacity 2: x|x+y cached after the first; the second hits both (8 of 9 tokens);
    # the third hits x only
    assert one_cache_limit(reqs, 2, 4) == (0 + 8 + 4) / (8 + 9 + 8)
    # capacity 1: only the last chunk stays, so nothing leading is ever cached
    assert one_cache_limit(reqs, 1, 4) == 0.0


def test_the_shortfall_traces_each_miss_to_a_prefix_in_flight_or_not_found() -> None:
    x, y = [1] * 4, [2] * 4
    reqs = [Request("doc", x + y), Request("doc", x + y + [5]), Request("doc", x + y + [6])]
    hits = one_cache_hits(reqs, 8, 4)
    assert hits == [0, 8, 8]

    def rec(cached: int, ttft_ms: float) -> dict[str, Any]:
        return {"ok": True, "cached": cached, "ttft_ms": ttft_ms}

    # at 1 request/s: the first reaches its first token at 1.5 s, after the second was
    # sent (1 s: in flight) and before the third (2 s: computed, not found)
    done = [rec(0, 1500), rec(0, 900), rec(4, 100)]
    assert short_of_limit(reqs, hits, done, 1.0, 4) == {
        "requests": 2, "in_flight": 8, "not_found": 4,
    }  # fmt: skip
    # the third's missing chunk (x+y) was ready from the second too (1 s + 0.9 s)
    everything = [rec(0, 1500), rec(8, 900), rec(8, 100)]
    assert short_of_limit(reqs, hits, everything, 1.0, 4)["requests"] == 0
    failed = [rec(0, 1500), {"ok": False, "error": "x"}, rec(0, 100)]
    assert short_of_limit(reqs, hits, failed, 1.0, 4) == {
        "requests": 1, "in_flight": 0, "not_found": 8,
    }  # fmt: skip


def _run(mean: float, hot_p99: float, share: float, imbalance: float) -> dict[str, Any]:
    return {
        "ttft_ms": {"mean": mean, "p50": mean, "p99": mean * 2},
        "ttft_ms_hot_doc": {"p99": hot_p99},
        "ttft_ms_all": [mean, mean * 2],
        "router_overhead_ms": {"p50": 0.5, "p99": 1.5},
        "cached_share": share,
        "recomputed_tokens": 10,
        "peer_cached_tokens": 5,
        "engine_requests": {"a": 1, "b": 1},
        "engine_busy_s": {"a": 1.0, "b": 1.2},
        "busy_imbalance": imbalance,
        "failed": 0,
        "ttft_ms_mean_by_kind": {"chat": mean / 2, "doc": mean, "unique": mean * 2},
        "queue_ms": {"mean": mean / 4, "p99": mean},
        "busy_share": 0.55,
        "prefill_tokens_per_s": [201.4, 198.6],
        "short_of_limit": {"requests": 2, "in_flight": 512, "not_found": 256},
    }


def test_targets_and_report(tmp_path: Path) -> None:
    runs = {
        "round-robin, P2P off": _run(900, 1500, 0.1, 1.0),
        "round-robin, P2P on": _run(500, 900, 0.3, 1.0),
        "kv": _run(400, 1200, 0.4, 1.6),
        "kv-p2p": _run(250, 600, 0.39, 1.1),
    }
    t = targets(runs, 0.4)
    assert t["kv_p2p_ttft_mean_le_third_of_rr_off"]["met"]
    assert t["kv_p2p_ttft_mean_below_rr_on"]["met"]
    assert t["kv_p2p_cached_share_ge_95pct_of_limit"]["met"]
    assert t["kv_p2p_hot_doc_p99_below_kv"]["met"]
    assert t["router_overhead_p99_le_5ms"]["met"]
    slow = targets({**runs, "kv-p2p": _run(600, 1300, 0.2, 1.4)}, 0.4)
    assert not any(v["met"] for k, v in slow.items() if k not in {"evaluated",
                   "router_overhead_p99_le_5ms"})  # fmt: skip
    assert targets({"kv": runs["kv"]}, 0.4) == {"evaluated": False}
    result: dict[str, Any] = {
        "command": "kvatlas bench fleet --routing",
        "routing": {
            "model": "smollm2-135m",
            "config": {
                "engines": 2,
                "l1_size_mb": 512,
                "seed": 7,
                "requests": 2,
                "rate_per_s": None,
                "hot_docs": 3,
                "doc_tokens": 768,
                "sessions": 4,
                "max_tokens": 8,
            },
            "kinds": {"doc": 1, "chat": 1, "unique": 0},
            "prompt_tokens": 100,
            "mean_prompt_tokens": 50.0,
            "arrival": {
                "rate_per_s": 7.2,
                "given": False,
                "load": 0.9,
                "prefill_tokens_per_s": 200.0,
            },
            "one_cache_limit": 0.4,
            "one_cache_capacity_chunks": 90,
            "runs": {**runs, "random": {"skipped": "ProcessError: boom"}},
            "targets": t,
        },
    }
    names = {p.name for p in write_routing(result, tmp_path)}
    assert {"report.md", "result.json", "routing_ttft.png", "routing_busy.png"} <= names
    md = (tmp_path / "report.md").read_text()
    assert "| kv-p2p | 250 ms |" in md and "skipped: ProcessError: boom" in md
    assert "| kv_p2p_ttft_mean_le_third_of_rr_off | 0.278 | <= 0.333 | yes |" in md
    assert "| kv-p2p | 125 ms | 250 ms | 500 ms | 62 ms | 250 ms | 55% | 201/199 |" in md
    assert "2 requests at 7.2/s" in md
    assert "**7.2/s**, is load 0.9 of" in md and "0.9 x 2 engines x 200 tokens/s" in md
    given = {**result, "routing": {**result["routing"], "arrival": {
        "rate_per_s": 0.6, "given": True, "load": 0.9, "prefill_tokens_per_s": None}}}  # fmt: skip
    write_routing(given, tmp_path)
    assert (
        "The arrival rate, 0.6/s, was given (`--routing-rate`)."
        in (tmp_path / "report.md").read_text()
    )
    assert "| kv-p2p | 2 | 768 | 512 | 256 |" in md  # short of the limit
    assert "niceness" not in md  # the engines ran at the fleet's priority
    # where the CPU went, for the runs that measured it
    runs["kv-p2p"] |= {
        "cpu_s": {"engines": 150.46, "servers": 4.9, "router": 1.4, "client": 0.3},
        "machine": {"busy": 0.8216, "idle": 0.1727, "steal": 0.0057},
    }
    result["routing"]["config"]["engine_nice"] = 10
    write_routing(result, tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "| kv-p2p | 150 s | 5 s |  | 1 s | 0 s | 82.2% | 17.3% | 0.6% |" in md
    assert "| round-robin, P2P on | 0 s" not in md
    assert "The engines run at niceness 10 above the rest of the fleet" in md
