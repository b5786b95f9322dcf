"""docs/deploy.md's single-machine commands work as written (the reference guide's port
plan: P2P on 8555 and 8556 for two nodes of one machine, no port derived from another)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from p2p.deploy_doc import documented_commands, run
from transfer.harness import netns_available, netns_command, python_env


def test_the_document_keeps_the_reference_port_plan() -> None:
    commands = documented_commands()
    assert [c.subcommand for c in commands] == ["coordinator", "server", "server"]
    a, b = commands[1:]
    assert (a.flag("--p2p-advertise-url"), b.flag("--p2p-advertise-url")) == (
        "127.0.0.1:8555",
        "127.0.0.1:8556",
    )
    assert "--p2p-data-port" not in a.args + b.args  # the default: a port the OS picks


def _ports_free(ports: set[int]) -> bool:
    for port in ports:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return False
    return True


@pytest.mark.slow
def test_documented_single_machine_setup_comes_up(tmp_path: Path) -> None:
    if netns_available():
        r = subprocess.run(
            netns_command([sys.executable, "-m", "p2p.deploy_doc", str(tmp_path)]),
            check=False, capture_output=True, text=True, timeout=240, env=python_env(),
        )  # fmt: skip
        logs = "".join(f"\n--- {p.name}\n{p.read_text()[-3000:]}" for p in tmp_path.glob("*.log"))
        assert r.returncode == 0 and "DEPLOY-DOC-OK" in r.stdout, r.stdout + r.stderr + logs
        return
    ports = {
        int(c.flag(f).rpartition(":")[2])
        for c in documented_commands()
        for f in ("--port", "--http-port", "--p2p-advertise-url")
        if f in c.args
    }
    if not _ports_free(ports):
        pytest.skip(f"no private network namespace here and a documented port is taken: {ports}")
    run(tmp_path)
