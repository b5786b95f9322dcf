"""A five-minute window of Mooncake's conversation trace through real kvatlas fleets
(``kvatlas bench trace``'s run): the global cache and local caches with prefix routing,
each a coordinator and ten cache servers on loopback, trace engines and the router.
Bounds are on shares only, never on times: the real replays agree with the simulation,
and the global cache reaches the ideal pooled cache's hit rate."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvatlas.evaluation.trace.mooncake import bundled_conversation_trace
from kvatlas.evaluation.trace.report import write_trace_report
from kvatlas.evaluation.trace.run import TraceBenchConfig, run_trace_bench


@pytest.fixture(scope="module")
def window_result(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, Path]:
    trace = bundled_conversation_trace().window(0, 300)
    cfg = TraceBenchConfig(
        nodes=10,
        node_capacity_tokens=3_000_000,
        speed=4.0,
        policies=("global", "local-prefix"),
        sweep_capacities=(1_000_000, 3_000_000),
        max_lag_s=60.0,
        out=tmp_path_factory.mktemp("trace-report"),
    )
    res = run_trace_bench(trace, cfg, command="test")
    write_trace_report(res, cfg.out)
    return res, cfg.out


def test_the_real_replays_agree_with_the_simulation(window_result: tuple[object, Path]) -> None:
    res, _ = window_result
    assert res.real["global"]["requests"] == 918  # type: ignore[attr-defined]
    checks = res.checks  # type: ignore[attr-defined]
    assert {c["policy"] for c in checks} == {"global", "local-prefix"}
    for c in checks:
        assert abs(c["real_hit_rate"] - c["simulated_hit_rate"]) <= 0.05, c
        assert c["real_hit_rate"] > 0.05, c  # the window has reuse to find


def test_the_global_cache_reaches_the_pooled_cache(window_result: tuple[object, Path]) -> None:
    res, out = window_result
    sim = res.simulated  # type: ignore[attr-defined]
    real = res.real  # type: ignore[attr-defined]
    assert real["global"]["token_hit_rate"] >= 0.9 * sim["pooled-lru"]["hit_rate"]
    assert real["global"]["token_hit_rate"] >= real["local-prefix"]["token_hit_rate"] - 0.02
    assert real["global"]["p2p_tokens"] > 0  # peers were read
    assert real["local-prefix"]["p2p_tokens"] == 0  # P2P off
    assert sim["theoretical"]["hit_rate"] >= sim["pooled-lru"]["hit_rate"] - 1e-9
    report = (out / "report.md").read_text()
    assert "## Policies, replayed through a real fleet" in report
    for name in ("result.json", "hit_rate_over_time.png", "capacity_sweep.png", "ttft.png"):
        assert (out / name).stat().st_size > 0
