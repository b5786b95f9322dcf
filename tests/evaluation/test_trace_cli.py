"""``kvatlas bench trace``'s flags: bad values are usage errors naming the flag."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvatlas.cli.bench import main as bench_main
from kvatlas.cli.bench_trace import build_trace_parser, trace_config_from_args
from kvatlas.evaluation.trace import run as run_mod
from kvatlas.evaluation.trace.mooncake import bundled_conversation_trace
from kvatlas.evaluation.trace.replay import FellBehind
from kvatlas.evaluation.trace.report import write_trace_report


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--policies", "global,nope"], "--policies"),
        (["--nodes", "0"], "--nodes"),
        (["--check-capacities", "1,x"], "--check-capacities"),
        (["--sweep-capacities", "-5"], "--sweep-capacities"),
        (["--speed", "0"], "--speed"),
    ],
)
def test_a_bad_flag_is_named(argv: list[str], flag: str) -> None:
    args = build_trace_parser().parse_args(argv)
    with pytest.raises(ValueError, match=flag):
        trace_config_from_args(args)


def test_the_defaults_are_the_papers_setup() -> None:
    cfg = trace_config_from_args(build_trace_parser().parse_args([]))
    assert (cfg.nodes, cfg.node_capacity_tokens) == (10, 3_000_000)
    assert set(cfg.policies) == {"local-random", "local-least-loaded", "local-prefix", "global"}


def test_a_missing_trace_file_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as err:
        bench_main(["trace", "--trace", "/nonexistent.jsonl", "--simulate-only"])
    assert err.value.code == 2
    assert "nonexistent" in capsys.readouterr().err


def test_a_replay_that_breaks_off_is_reported_and_the_rest_go_on(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A replay that falls behind is one failed entry of the report, not a lost run."""

    def behind(*_a: object, **_k: object) -> None:
        raise FellBehind("request 7 went out 31.0 s after its time on the trace clock")

    monkeypatch.setattr(run_mod, "replay", behind)
    trace = bundled_conversation_trace().window(0, 20)
    cfg = run_mod.TraceBenchConfig(
        nodes=2, node_capacity_tokens=100_000, policies=("global",), sweep_capacities=(100_000,)
    )
    res = run_mod.run_trace_bench(trace, cfg)
    assert list(res.failed) == ["global"] and "31.0 s" in res.failed["global"]
    assert res.real == {} and res.simulated["global"]["requests"] == len(trace)
    write_trace_report(res, tmp_path)
    assert "## Replays that did not finish" in (tmp_path / "report.md").read_text()
