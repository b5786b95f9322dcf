"""Every one of LMCache's coordinator routes (0.5.6's 25, 0.5.7rc2's 26), answered alike
by kvatlas or by a named, reasoned difference (``differences.py``): one hand-written
scenario per route, sent to both coordinators, every exchange judged; each module's
pair runs once per LMCache version (``conftest.VERSIONS``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from .differences import DIFFERENCES
from .harness import Pair, Target, report
from .ops import Run
from .routes import ROUTES, ROUTES_BY_VERSION
from .scenarios import SCENARIO_VERSIONS, SCENARIOS, TARGET_SCENARIOS

pytestmark = [pytest.mark.lmcache]


def run_scenario(route: str, pair: Pair, request: pytest.FixtureRequest) -> int:
    since = len(pair.verdicts)
    run = Run(pair)
    try:
        if route in TARGET_SCENARIOS:
            target: Target = request.getfixturevalue("target")
            TARGET_SCENARIOS[route](run, target)
        else:
            SCENARIOS[route](run)
    finally:
        run.close()
    return since


def test_every_route_has_a_scenario() -> None:
    assert set(SCENARIOS) | set(TARGET_SCENARIOS) == set(ROUTES)
    assert len(ROUTES_BY_VERSION["0.5.6"]) == 25
    assert len(ROUTES_BY_VERSION["0.5.7rc2"]) == 26
    assert set(ROUTES_BY_VERSION["0.5.7rc2"]) == set(ROUTES)


def runs_on(fn: object, version: str) -> bool:
    """Does a scenario's LMCache version serve what it sends?"""
    versions = SCENARIO_VERSIONS.get(fn, ())
    return not versions or version in versions


@pytest.mark.parametrize("route", ROUTES)
def test_route_answered_alike(route: str, pair: Pair, request: pytest.FixtureRequest) -> None:
    """The route's own exchanges in its scenario (the other routes a scenario sends are
    judged by their own tests and, all together, by the last test here)."""
    if route not in ROUTES_BY_VERSION[pair.version]:
        pytest.skip(f"LMCache {pair.version} has no {route}")
    since = run_scenario(route, pair, request)
    met = {v.exchange.route for v in pair.verdicts[since:]}
    assert route in met, f"the scenario never sent {route}"
    bad = [v for v in pair.mismatches(since) if v.exchange.route == route]
    if bad:
        pytest.fail(report(bad), pytrace=False)


def test_every_listed_difference_is_documented() -> None:
    """docs/migrating-from-lmcache.md lists the same differences for users."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "migrating-from-lmcache.md").read_text()
    missing = [d.name for d in DIFFERENCES if f"`{d.name}`" not in doc]
    assert not missing, f"not in docs/migrating-from-lmcache.md: {missing}"


def test_all_scenarios_alike_and_every_listed_difference_met(
    pair: Pair, request: pytest.FixtureRequest
) -> None:
    """Every scenario in turn, every exchange judged; and the list names what happens:
    each entry excuses something."""
    since = len(pair.verdicts)
    target: Target = request.getfixturevalue("target")
    for fn in dict.fromkeys([*SCENARIOS.values()]):
        if not runs_on(fn, pair.version):
            continue
        run = Run(pair)
        try:
            fn(run)
        finally:
            run.close()
    for tfn in dict.fromkeys([*TARGET_SCENARIOS.values()]):
        run = Run(pair)
        try:
            tfn(run, target)
        finally:
            run.close()
    bad = pair.mismatches(since)
    if bad:
        pytest.fail(report(bad), pytrace=False)
    used = pair.used(since)
    unused = sorted(
        d.name
        for d in DIFFERENCES
        if d.name not in used and (not d.versions or pair.version in d.versions)
    )
    assert not unused, f"listed differences no exchange needed: {unused}"
