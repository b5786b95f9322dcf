"""The router's load accounting per engine (``router/engines.py``)."""

from __future__ import annotations

import pytest

from kvatlas.router.engines import RATE_SMOOTHING, EngineState, EngineTable, RateMeter
from kvatlas.router.health import samples_of as _samples


def test_a_probe_taken_during_the_routers_own_request_does_not_outlive_it() -> None:
    e = EngineState("http://127.0.0.1:1", "node-a")
    e.begin(512, now=0.0)
    e.probed(True, running=1, reason="", now=0.1)  # the engine counts the router's request
    assert e.load == 1
    e.end(512, now=0.2)
    # Before: max(in_flight, reported) kept it at 1 until the next probe, so sequential
    # requests all avoided this engine.
    assert e.load == 0


def test_other_clients_requests_count_on_top_of_the_routers_own() -> None:
    e = EngineState("http://127.0.0.1:1", "node-a")
    e.begin(512, now=0.0)
    e.probed(True, running=3, reason="", now=0.1)  # two that the router did not send
    assert e.load == 3
    e.begin(512, now=0.2)
    assert e.load == 4
    e.end(512, now=0.3)
    e.end(512, now=0.4)
    assert e.load == 2
    e.probed(True, running=0, reason="", now=0.5)
    assert e.load == 0


def test_a_rate_meter_averages_the_intervals_that_counted_tokens() -> None:
    m = RateMeter()
    m.sample(tokens=0, seconds=0)
    assert m.s_per_token is None  # nothing counted yet
    m.sample(tokens=1000, seconds=2.0)
    assert m.s_per_token == 0.002
    m.sample(tokens=1000, seconds=2.0)  # an idle interval changes nothing
    assert m.s_per_token == 0.002
    m.sample(tokens=2000, seconds=3.0)  # 0.001 s per token in this interval
    assert m.s_per_token == 0.002 + RATE_SMOOTHING * (0.001 - 0.002)
    m.sample(tokens=500, seconds=2.5)  # the engine restarted: its totals since then
    assert m.s_per_token == pytest.approx(0.0017 + RATE_SMOOTHING * (0.005 - 0.0017))


def test_the_p2p_weight_is_the_fleets_read_cost_over_the_engines_prefill_cost() -> None:
    table = EngineTable()
    table.add_static("http://127.0.0.1:1", "node-a")
    table.add_static("http://127.0.0.1:2", "node-b")
    a, b = table.engines.values()
    assert table.p2p_weight(a) is None  # the flag applies until both rates are measured
    a.prefill.sample(1000, 4.0)  # 4 ms per computed token
    assert table.p2p_weight(a) is None
    b.p2p.sample(2048, 0.2048)  # 0.1 ms per token read from a peer
    assert table.p2p_weight(a) == pytest.approx(0.1 / 4)
    assert table.p2p_weight(b) == pytest.approx(0.1 / 4)  # b: the fleet's prefill rate
    b.prefill.sample(1000, 2.0)
    assert table.p2p_weight(b) == pytest.approx(0.1 / 2)
    assert table.p2p_s_per_token() == pytest.approx(0.0001)


def test_a_probe_reads_labelled_and_plain_samples_and_skips_malformed_ones() -> None:
    text = "\n".join(
        [
            "# HELP vllm:num_requests_running Requests running.",
            'vllm:num_requests_running{model_name="a b"} 3.0',
            "kvatlas_engine_prefilled_tokens_total 1000.0",
            "kvatlas_engine_prefill_seconds_total 2.5 1700000000",
            "kvatlas_engine_prefill_seconds_created 1.7e9",
            "kvatlas_engine_peer_fetch_seconds_total not-a-number",
        ]
    )
    assert _samples(text) == {
        "vllm:num_requests_running": 3.0,
        "kvatlas_engine_prefilled_tokens_total": 1000.0,
        "kvatlas_engine_prefill_seconds_total": 2.5,
    }
