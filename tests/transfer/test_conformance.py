"""One conformance suite for every transfer engine (HOUSE_STYLE habit 6).

Scenarios live in ``scenarios.py``. Engines that listen on 0.0.0.0 whatever they are
told (mooncake) run each scenario in a child process inside a private network namespace
with only loopback (``unshare -rn``, root in CI); the others run in this process. An
engine is skipped only when its package cannot be imported, with the reason.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from transfer.harness import ENGINES, NETNS_ENGINES, importable, netns_command, python_env
from transfer.scenarios import SCENARIOS, TCP_ONLY

CASES = [
    pytest.param(scenario, engine, id=f"{engine}-{scenario}")
    for scenario in SCENARIOS
    for engine in ENGINES
    if scenario not in TCP_ONLY or engine == "tcp"
]


@pytest.mark.parametrize(("scenario", "engine"), CASES)
def test_conformance(scenario: str, engine: str) -> None:
    missing = importable(engine)
    if missing is not None:
        pytest.skip(f"{engine} cannot be imported here: {missing}")
    if engine not in NETNS_ENGINES:
        SCENARIOS[scenario](engine)
        return
    argv = [sys.executable, "-m", "transfer.scenarios", scenario, engine]
    proc = subprocess.run(
        netns_command(argv),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=python_env(),
    )
    assert proc.returncode == 0 and "PASSED" in proc.stdout, (
        f"{engine}/{scenario} failed in its network namespace (rc {proc.returncode}):\n"
        + proc.stdout[-4000:]
        + "\n"
        + "\n".join(line for line in proc.stderr.splitlines() if not line.startswith("I1"))[-6000:]
    )
