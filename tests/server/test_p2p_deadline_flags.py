"""`kvatlas server`'s P2P deadline flags reach the config (and the deadline policy), and
out-of-range values are refused naming the flag."""

from __future__ import annotations

import pytest

from kvatlas.cli.server import build_parser, config_from_args
from kvatlas.core.errors import ConfigError
from kvatlas.core.server.peer_timing import DeadlinePolicy

BASE = [
    "--instance-id", "node-a", "--coordinator-url", "http://127.0.0.1:9300",
    "--p2p-advertise-url", "127.0.0.1:9400",
]  # fmt: skip


def test_defaults_and_flags_reach_the_deadline_policy() -> None:
    p2p = config_from_args(build_parser().parse_args(BASE), {}).p2p
    assert p2p.deadline_policy == DeadlinePolicy()
    assert DeadlinePolicy() == DeadlinePolicy(0.025, 4.0, 0.1, 4.0)
    flags = [
        "--p2p-lock-deadline-floor-s", "0.01", "--p2p-lock-deadline-factor", "6",
        "--p2p-lock-deadline-prior-s", "0.3", "--p2p-load-deadline-factor", "2.5",
    ]  # fmt: skip
    p2p = config_from_args(build_parser().parse_args([*BASE, *flags]), {}).p2p
    assert p2p.deadline_policy == DeadlinePolicy(0.01, 6.0, 0.3, 2.5)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--p2p-lock-deadline-floor-s", "0"], "--p2p-lock-deadline-floor-s must be positive"),
        (["--p2p-lock-deadline-prior-s", "-1"], "--p2p-lock-deadline-prior-s must be positive"),
        (["--p2p-lock-deadline-factor", "0.5"], "--p2p-lock-deadline-factor must be >= 1"),
        (["--p2p-load-deadline-factor", "nan"], "--p2p-load-deadline-factor must be >= 1"),
        (
            ["--p2p-lock-deadline-prior-s", "5", "--p2p-lookup-timeout-s", "2"],
            "--p2p-lock-deadline-prior-s .5.0. must not exceed --p2p-lookup-timeout-s",
        ),
    ],
)
def test_out_of_range_is_refused_naming_the_flag(flags: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        config_from_args(build_parser().parse_args([*BASE, *flags]), {})
