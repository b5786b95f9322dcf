"""``kvatlas bench trace``'s flags: bad values are usage errors naming the flag."""

from __future__ import annotations

import pytest

from kvatlas.cli.bench import main as bench_main
from kvatlas.cli.bench_trace import build_trace_parser, trace_config_from_args


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
