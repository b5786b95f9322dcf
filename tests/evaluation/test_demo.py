"""`kvatlas demo` as a user runs it: real processes, the real SmolLM2, one command."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_demo_serves_node_b_from_node_a_and_leaves_nothing_running(tmp_path: Path) -> None:
    work = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "kvatlas.cli.demo", "--prompt-tokens", "700",
         "--max-tokens", "8", "--l1-size-mb", "256", "--workdir", str(work)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )  # fmt: skip
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "identical: yes" in out
    assert "loading smollm2-135m" in out  # progress while the models load
    assert "every process stopped" in out
    warm = next(line for line in out.splitlines() if line.startswith("  of which from peers"))
    assert int(warm.split()[-1].replace(",", "")) >= 512  # B's tokens came from A
    assert "the coordinator's view of the fleet" in out
    # nothing the demo started is still alive: servers and coordinator name the workdir,
    # and the engines' ports (printed while they load) no longer answer
    leftovers = subprocess.run(
        ["pgrep", "-f", str(work)], capture_output=True, text=True, check=False
    )
    assert leftovers.stdout.strip() == ""
    ports = [int(p) for p in re.findall(r"for engine [AB] on http://127\.0\.0\.1:(\d+)", out)]
    assert len(ports) == 2, out
    for port in ports:
        with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            pass


@pytest.mark.slow
def test_demo_through_the_router_says_where_each_request_went(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvatlas.cli.demo", "--prompt-tokens", "700",
         "--max-tokens", "8", "--l1-size-mb", "256", "--workdir", str(tmp_path / "demo"),
         "--router"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )  # fmt: skip
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "identical: yes" in out and "sees both engines" in out
    reasons = next(line for line in out.splitlines() if line.startswith("router's reason"))
    # cold: nobody holds the prompt; warm: the router expected its full chunks cached
    assert "kv-p2p: load (expected 0 cached)" in reasons, reasons
    assert re.search(r"kv-p2p: prefix \(expected (512|768) cached\)", reasons), reasons
