"""`kvatlas bench faults`' flags: bad values are refused naming the flag (exit 2), good
ones reach the campaign's config."""

from __future__ import annotations

import pytest

from kvatlas.cli.bench import build_faults_parser, faults_config_from_args, main
from kvatlas.evaluation.faults import FAULT_NAMES


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--faults", "server_kill,nope"], "--faults"),
        (["--nodes", "1"], "--nodes"),
        (["--rate", "0"], "--rate"),
        (["--hold-s", "-1"], "--hold-s"),
    ],
)
def test_bad_flags_are_refused_naming_the_flag(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["faults", *argv])
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err


def test_flags_reach_the_config() -> None:
    args = build_faults_parser().parse_args(
        ["--nodes", "4", "--rate", "2.5", "--hold-s", "3", "--faults", "slow_peer,server_kill"]
    )
    cfg = faults_config_from_args(args)
    assert (cfg.nodes, cfg.rate_per_node, cfg.hold_s) == (4, 2.5, 3.0)
    assert cfg.faults == ("slow_peer", "server_kill")
    assert faults_config_from_args(build_faults_parser().parse_args([])).faults == FAULT_NAMES


def test_bench_without_a_known_subcommand_prints_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["nope"]) == 2
    assert "fleet,faults" in capsys.readouterr().out
