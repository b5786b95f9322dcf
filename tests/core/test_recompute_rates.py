"""Engines' prefill rates, learned per engine and per model."""

from __future__ import annotations

import pytest

from kvatlas.core.server.recompute_rates import MAX_S_PER_TOKEN, RecomputeRates


def test_unknown_until_an_engine_says() -> None:
    assert RecomputeRates().rate("m", "e1") is None


def test_an_engines_own_rate_first_then_its_models() -> None:
    r = RecomputeRates()
    assert r.observe("m", "e1", 0.001)
    assert r.rate("m", "e1") == 0.001
    assert r.rate("m", "e2") == 0.001  # another engine of the model
    r.observe("m", "e2", 0.004)
    assert r.rate("m", "e1") == 0.001
    assert r.rate("m", "e2") == 0.004
    assert r.rate("other", "e1") is None


def test_rates_are_ewmas() -> None:
    r = RecomputeRates()
    r.observe("m", "e", 0.001)
    r.observe("m", "e", 0.002)
    assert r.rate("m", "e") == pytest.approx(0.0013)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), MAX_S_PER_TOKEN * 2])
def test_implausible_rates_are_refused_and_counted(bad: float) -> None:
    r = RecomputeRates()
    assert not r.observe("m", "e", bad)
    assert r.rate("m", "e") is None and r.ignored == 1


def test_engines_are_bounded_least_recently_heard_first() -> None:
    r = RecomputeRates(max_engines=2)
    r.observe("m", "e1", 0.001)
    r.observe("m", "e2", 0.002)
    r.observe("m", "e1", 0.001)
    r.observe("m", "e3", 0.003)
    assert r.engines() == 2
    assert r.rate("m", "e2") == r.by_model()["m"]  # e2 forgotten: the model's rate
    assert r.rate("m", "e1") == 0.001
