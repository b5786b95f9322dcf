"""One conformance suite for every transport (HOUSE_STYLE habit 6).

Scenarios live in ``scenarios.py``. Transports that listen on 0.0.0.0 whatever they are
told (mooncake) run each scenario in a child process inside a private network namespace
with only loopback (``unshare -rn``, root in CI); the others run in this process. An
transport is skipped only when its package cannot be imported, with the reason.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvatlas.transfer.factory import TRANSPORTS
from transfer.harness import NETNS_TRANSPORTS, importable, netns_command, python_env
from transfer.scenarios import SCENARIOS, TCP_ONLY

CASES = [
    pytest.param(
        scenario,
        transport,
        id=f"{transport}-{scenario}",
        # a child process and its import of the transport per case: 5 to 12 s each
        # measured on the 2-core VM, about a minute in all
        marks=pytest.mark.slow if transport in NETNS_TRANSPORTS else (),
    )
    for scenario in SCENARIOS
    for transport in TRANSPORTS
    if scenario not in TCP_ONLY or transport == "tcp"
]


@pytest.mark.parametrize(("scenario", "transport"), CASES)
def test_conformance(scenario: str, transport: str) -> None:
    missing = importable(transport)
    if missing is not None:
        pytest.skip(f"{transport} cannot be imported here: {missing}")
    if transport not in NETNS_TRANSPORTS:
        SCENARIOS[scenario](transport)
        return
    argv = [sys.executable, "-m", "transfer.scenarios", scenario, transport]
    proc = subprocess.run(
        netns_command(argv),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=python_env(),
    )
    assert proc.returncode == 0 and "PASSED" in proc.stdout, (
        f"{transport}/{scenario} failed in its network namespace (rc {proc.returncode}):\n"
        + proc.stdout[-4000:]
        + "\n"
        + "\n".join(line for line in proc.stderr.splitlines() if not line.startswith("I1"))[-6000:]
    )
