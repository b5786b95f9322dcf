"""The fault campaign's ``frozen_peer_no_estimate`` case, on real processes:
a frozen peer costs the first lookups one short lock deadline and the next ones
nothing, without an estimate from the engine; the peer is read again after SIGCONT,
byte for byte; the report lists each phase's timeline. The targets, 250 ms and 10 ms,
are the campaign's to measure (``kvatlas bench faults --faults
frozen_peer_no_estimate``); here the next lookups' cost is read from their fallback (no
peer asked), and the one wall-clock bound tells the first lookups' short deadline from
the bug's (without the learned lock deadline they wait 10.24 s) at half of it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvatlas.evaluation.fault_frozen_peer import (
    AFTER_TRIES,
    BURST,
    FROZEN_PEER,
    NEXT,
    WARM_READS,
)
from kvatlas.evaluation.faults import FAULT_NAMES, FaultsConfig, run_faults
from kvatlas.evaluation.faults_report import write_faults_report

pytestmark = pytest.mark.slow

BUG_MS = 10_240
"""What the first lookups waited without the learned lock deadline (2,048 tokens at the
default 5 ms a token)."""


def test_frozen_peer_case_runs_and_is_reported(tmp_path: Path) -> None:
    assert FROZEN_PEER in FAULT_NAMES
    lines: list[str] = []
    cfg = FaultsConfig(faults=(FROZEN_PEER,), out=tmp_path)
    result = run_faults(cfg, command="test", say=lines.append)
    write_faults_report(result, tmp_path)
    case = result["cases"][FROZEN_PEER]
    assert result["faults"] == {}
    assert [p["phase"] for p in case["phases"]] == ["cold", "warm"]
    for ph in case["phases"]:
        t = ph["targets"]
        assert t["one_breaker_opening"] and t["served_after_thaw"] and t["no_wrong_bytes"], ph
        assert ph["first_ms"]["n"] == BURST and ph["next_ms"]["n"] == NEXT, ph
        assert ph["first_ms"]["max"] < BUG_MS / 2, ph
        assert 1 <= ph["after_thaw_tries"] <= AFTER_TRIES, ph
        assert {p["fallback"] for p in ph["timeline"] if p["phase"] == "next"} == {"cooling_off"}
        assert ph["breaker_closed_after_thaw_s"] is not None
    cold, warm = case["phases"]
    assert cold["lock_deadline_ms"] == cold["lock_deadline_prior_ms"] == 100.0
    # warm: learned from A's answers (a few ms at most here), below the prior
    assert warm["healthy_lock_ms"]["n"] == WARM_READS
    assert warm["lock_deadline_ms"] < 100.0, warm
    doc = json.loads((tmp_path / "result.json").read_text())
    assert doc["cases"][FROZEN_PEER]["passed"] == case["passed"]
    assert result["passed"] == case["passed"]
    md = (tmp_path / "report.md").read_text()
    assert f"## {FROZEN_PEER}:" in md
    assert md.count("- first t=") == 2 * BURST and md.count("- next t=") == 2 * NEXT
    assert (tmp_path / f"case_{FROZEN_PEER}.png").stat().st_size > 1000
    assert any(f"{FROZEN_PEER} (cold)" in line for line in lines)
