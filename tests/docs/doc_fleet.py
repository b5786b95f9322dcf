"""The documented single-machine fleet the docs' tests run: docs/deploy.md's coordinator
and node A's cache server, started from their documented command lines with the ports
moved to free loopback ports, L1 cut to 0.05 GiB and a private state dir.

Must not: change a documented flag other than those three.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from docs.doc_commands import ROOT, blocks
from kvatlas.launch.procs import free_ports
from support.launch import Proc, launch, python_module

DEPLOY_MD = ROOT / "docs" / "deploy.md"
SINGLE_MACHINE = "## Single-machine test"
RUNNING = {"9300": "coordinator", "7555": "node A's server (HTTP)"}
"""The documented ports the fleet serves, and what serves them."""
DOCUMENTED_PORTS = ("9300", "6555", "7555", "8555")
"""The coordinator's port and node A's engine, HTTP and P2P ports."""


def single_machine() -> list[tuple[str, list[str]]]:
    """The coordinator and node A's server of deploy.md's single-machine block."""
    section = DEPLOY_MD.read_text().split(SINGLE_MACHINE, 1)[1]
    block = next(b for b in blocks(DEPLOY_MD, section) if b.lang == "bash")
    out = []
    for c in block.commands:
        if c.words[:2] == ("kvatlas", "coordinator"):
            out.append(("coordinator", list(c.words[2:])))
        elif c.words[:2] == ("kvatlas", "server") and "node-a" in c.words:
            out.append(("server", list(c.words[2:])))
    assert [k for k, _ in out] == ["coordinator", "server"], out
    return out


def moved(word: str, ports: dict[str, str]) -> str:
    return re.sub(r"\b\d{4,5}\b", lambda m: ports.get(m.group(0), m.group(0)), word)


@dataclass(frozen=True)
class DocFleet:
    ports: dict[str, str]
    """Documented port -> the loopback port it moved to."""
    logs: Path
    """``coordinator.log`` and ``server.log`` are there."""


@contextmanager
def documented_fleet(logs: Path) -> Iterator[DocFleet]:
    """The fleet running, until the context ends."""
    ports = dict(zip(DOCUMENTED_PORTS, map(str, free_ports(len(DOCUMENTED_PORTS))), strict=True))
    procs: list[Proc] = []
    try:
        for kind, args in single_machine():
            argv = [moved(a, ports) for a in args]
            if kind == "coordinator":
                http = int(ports["9300"])
            else:
                argv += ["--l1-size-gb", "0.05", "--state-dir", str(logs / "state")]
                http = int(ports["7555"])
            procs.append(launch(python_module(f"kvatlas.cli.{kind}", *argv), name=kind,
                                log=logs / f"{kind}.log", http_port=http, timeout=60))  # fmt: skip
        yield DocFleet(ports, logs)
    finally:
        for p in reversed(procs):
            p.stop()
