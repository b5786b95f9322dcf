"""The trace simulation: each policy against hand-computed tiny traces, then invariants on
the real conversation trace (full, and a 5-minute window)."""

from __future__ import annotations

import math

import pytest

from kvatlas.core.errors import ConfigError
from kvatlas.evaluation.trace.mooncake import Trace, TraceRequest, bundled_conversation_trace
from kvatlas.evaluation.trace.simulate import (
    POLICIES,
    CostProfile,
    PolicyResult,
    SimConfig,
    capacity_sweep,
    format_sweep,
    format_table,
    main,
    simulate,
    simulate_all,
)

BT = 4  # tokens per block in the tiny traces
FAST = CostProfile("fast", 1e-3, 0.0, 1)  # queues stay empty at 1 request per second
SLOW = CostProfile("slow", 1.0, 0.0, 1)  # 1 s per token: a node stays busy


def tiny(*reqs: tuple[float, int, tuple[int, ...]]) -> Trace:
    return Trace(
        tuple(TraceRequest(int(t * 1000), n, 1, ids) for t, n, ids in reqs), block_tokens=BT
    )


ABC = tiny((0, 8, (1, 2)), (1, 8, (1, 3)), (2, 8, (1, 2)), (3, 4, (4,)))


def run(trace: Trace, policy: str, blocks: int, profile: CostProfile = FAST) -> PolicyResult:
    cfg = SimConfig(nodes=2, capacity_tokens=blocks * BT, profile=profile)
    return simulate(trace, policy, cfg)  # type: ignore[arg-type]


def test_theoretical_is_the_leading_blocks_seen_before() -> None:
    r = run(ABC, "theoretical", 1)
    assert r.hit_tokens == 4 + 8  # r2: block 1; r3: blocks 1, 2
    assert r.input_tokens == 28
    assert r.share_of_theoretical != r.share_of_theoretical  # nan until simulate_all


def test_local_least_loaded_alternates_idle_nodes() -> None:
    # idle nodes are taken in turn: r1, r3 on node 0, r2, r4 on node 1; r3 hits both blocks
    r = run(ABC, "local-least-loaded", 2)
    assert r.hit_tokens == 8
    assert r.node_prefill_tokens == (8, 12)
    assert r.p2p_tokens == 0


def test_pooled_lru_evicts_least_recent_block() -> None:
    # pooled: 2 nodes x 1 block = 2 blocks. r2 hits 1; storing 3 evicts 2, so r3 hits 1 only
    assert run(ABC, "pooled-lru", 1).hit_tokens == 4 + 4
    assert run(ABC, "pooled-lru", 2).hit_tokens == 12  # 4 blocks: the theoretical maximum


def test_a_request_keeps_its_prefix_over_its_tail() -> None:
    # 3 blocks into a 2-block cache: the tail goes, not the shared head
    t = tiny((0, 12, (1, 2, 3)), (1, 12, (1, 2, 5)))
    assert run(t, "pooled-lru", 1).hit_tokens == 8


def test_partial_last_block_counts_its_own_tokens() -> None:
    t = tiny((0, 6, (1, 2)), (1, 6, (1, 2)), (2, 8, (1, 2)))
    assert run(t, "theoretical", 1).hit_tokens == 6 + 8


# r1 keeps node 0 busy for 8 s (1 s per token); r2 arrives at 1 s with block 1 in common
BUSY = tiny((0, 8, (1, 2)), (1, 8, (1, 3)))


def test_global_reads_the_prefix_from_the_busy_peer() -> None:
    r = run(BUSY, "global", 1, SLOW)
    # r2: node 0 has 7 s (7 tokens) queued, node 1 none: node 1, block 1 read from node 0
    assert r.hit_tokens == 4
    assert r.p2p_tokens == 4
    assert r.p2p_bytes == 4
    assert r.node_prefill_tokens == (8, 4)
    assert r.ttft_s[0] == pytest.approx(8.0)
    assert r.ttft_s[1] == pytest.approx(4.0)  # no wait, 4 tokens (+ a 4-byte read)


def test_local_prefix_weighs_the_queue_against_the_prefix() -> None:
    # node 0 costs 4 to compute + 7 queued, node 1 costs 8: node 1, nothing cached there
    r = run(BUSY, "local-prefix", 1, SLOW)
    assert r.hit_tokens == 0
    assert r.node_prefill_tokens == (8, 8)
    # the prefix alone waits 7 s behind node 0 for its 4 cached tokens
    only = run(BUSY, "local-prefix-only", 1, SLOW)
    assert only.hit_tokens == 4
    assert only.node_prefill_tokens == (12, 0)
    assert only.ttft_s[1] == pytest.approx(7.0 + 4.0)


def test_global_prefers_the_local_prefix_when_idle() -> None:
    # idle fleet: r2 goes where block 1 is, so no read, and its block 3 evicts block 2
    # from node 0's two: r3 finds block 1 only; r4 (no match) goes to node 1 in turn
    r = run(ABC, "global", 2)
    assert r.hit_tokens == 4 + 4
    assert r.p2p_tokens == 0
    assert r.node_prefill_tokens == (16, 4)
    # with three blocks per node, block 2 stays: r3 hits both
    assert run(ABC, "global", 3).hit_tokens == 4 + 8


def test_a_peer_read_leaves_a_copy_on_the_reader() -> None:
    # r2 reads block 1 from busy node 0 and stores 1, 2 on node 1; at 20 s, idle, r3 goes
    # to node 1 (the longest local match) and hits both blocks there, reading nothing
    t = tiny((0, 8, (1, 9)), (1, 8, (1, 2)), (20, 12, (1, 2, 3)))
    r = run(t, "global", 2, SLOW)
    assert r.hit_tokens == 4 + 8
    assert r.p2p_tokens == 4


def test_random_is_seeded() -> None:
    a = run(ABC, "local-random", 2)
    b = run(ABC, "local-random", 2)
    assert a == b


def test_bad_configs_are_refused() -> None:
    with pytest.raises(ConfigError, match="no 4-token block"):
        simulate(ABC, "global", SimConfig(capacity_tokens=3))
    with pytest.raises(ConfigError, match="--capacity-tokens"):
        run(ABC, "global", 0)
    with pytest.raises(ConfigError, match="--nodes"):
        simulate(ABC, "global", SimConfig(nodes=0))
    with pytest.raises(ConfigError, match="unknown policy"):
        simulate(ABC, "lru", SimConfig())  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def full() -> dict[str, PolicyResult]:
    return simulate_all(
        bundled_conversation_trace(), SimConfig(nodes=10, capacity_tokens=3_000_000)
    )


def test_full_trace_invariants(full: dict[str, PolicyResult]) -> None:
    top, pooled, glob = full["theoretical"], full["pooled-lru"], full["global"]
    local = full["local-prefix"]
    assert top.hit_rate >= pooled.hit_rate >= local.hit_rate
    assert glob.hit_rate >= local.hit_rate
    assert glob.hit_rate >= 0.95 * pooled.hit_rate  # the target
    assert full["local-least-loaded"].hit_rate < 0.5 * top.hit_rate  # the paper's Figure 9
    for r in full.values():
        assert 0.0 <= r.share_of_theoretical <= 1.0
        assert 0.0 <= r.prefill_saved <= r.hit_rate + 0.02
        assert r.ttft_p50_s <= r.ttft_p90_s <= r.ttft_p99_s
        assert r.load_spread >= 1.0
        assert sum(r.node_prefill_tokens) == r.input_tokens - r.hit_tokens
        assert len(r.hit_rate_per_minute) == 59
        assert len(r.ttft_s) == 12_031
        assert (r.p2p_tokens > 0) == (r.policy == "global")
    assert full["local-prefix-only"].load_spread > 5  # the universal first block: one node
    assert "| global |" in format_table(full)


def test_five_minute_window() -> None:
    w = bundled_conversation_trace().window(0, 300)
    assert 900 < len(w) < 1200
    res = simulate_all(w, SimConfig(nodes=10, capacity_tokens=3_000_000))
    assert set(res) == set(POLICIES)
    assert res["theoretical"].share_of_theoretical == 1.0
    assert res["global"].share_of_theoretical >= 0.9
    assert res["global"].hit_rate >= res["local-prefix"].hit_rate
    assert res["local-least-loaded"].share_of_theoretical <= 0.8
    assert all(not math.isnan(v) for v in res["global"].hit_rate_per_minute)


def test_capacity_sweep_grows_with_capacity() -> None:
    w = bundled_conversation_trace().window(0, 300)
    s = capacity_sweep(w, 4, [100_000, 1_000_000, 10_000_000])
    for p in ("local-prefix", "global", "pooled-lru"):
        rates = [s.hit_rate(p, c) for c in (100_000, 1_000_000, 10_000_000)]
        assert rates == sorted(rates)
        assert rates[-1] <= s.theoretical_hit_rate
    assert s.hit_rate("global", 1_000_000) >= s.hit_rate("local-prefix", 1_000_000)
    assert "1,000,000" in format_sweep(s)


def test_main_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--duration-s", "60", "--nodes", "3", "--capacity-tokens", "500000"]) == 0
    out, err = capsys.readouterr()
    assert "| pooled-lru |" in out
    assert "[1/7] theoretical" in err
