"""docs/deploy.md's single-machine setup, run as written: the coordinator and the two
``kvatlas server`` command lines are parsed from the document (so that it cannot drift),
started as real processes on their documented ports, and checked to come up, see each
other as P2P peers and move a chunk from node A to node B.

``python -m p2p.deploy_doc TMPDIR`` runs it as one script; ``test_deploy_doc`` starts it
inside a private network namespace (``unshare -rn``) when it can, so that the fixed ports
of the document never meet another process of this machine.
"""

from __future__ import annotations

import operator
import shlex
import socket
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from kvatlas.connector.client import CacheClient
from support.launch import Proc, launch, python_module
from support.wait import wait_until

DEPLOY_MD = Path(__file__).resolve().parents[2] / "docs" / "deploy.md"
SECTION = "## Single-machine test"
SERVER_OVERRIDES = ("--l1-size-gb", "0.05")
"""Appended to each documented server command (argparse keeps the last value): the
document's 2 GiB of prefaulted L1 per server is more than a test needs to check ports."""
CHUNK_TOKENS = 256
"""The servers' default chunk size: the documented commands set none."""


@dataclass(frozen=True)
class Command:
    subcommand: str
    args: tuple[str, ...]

    def flag(self, name: str) -> str:
        return self.args[self.args.index(name) + 1]


def documented_commands(text: str | None = None) -> list[Command]:
    """The ``kvatlas coordinator`` and ``kvatlas server`` lines of the single-machine
    section's shell block, line continuations joined, in order."""
    text = DEPLOY_MD.read_text() if text is None else text
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    commands = []
    for line in block.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        if words[:1] == ["kvatlas"] and words[1] in ("coordinator", "server"):
            commands.append(Command(words[1], tuple(words[2:])))
    return commands


def _start(cmd: Command, log: Path, http_port: str, extra: tuple[str, ...] = ()) -> Proc:
    """The documented command through the one launcher, once its /healthz answers."""
    argv = python_module(f"kvatlas.cli.{cmd.subcommand}", *cmd.args, *extra)
    return launch(argv, name=log.stem, log=log, http_port=int(http_port))


def _status(http_port: str) -> dict[str, Any]:
    return dict(httpx.get(f"http://127.0.0.1:{http_port}/status", timeout=5).json())


def _peers_of(http_port: str) -> tuple[str, list[str]]:
    st = _status(http_port)
    return st["p2p_state"], list(st["p2p_peers"])


def run(tmp: Path) -> None:
    commands = documented_commands()
    coord = [c for c in commands if c.subcommand == "coordinator"]
    servers = [c for c in commands if c.subcommand == "server"]
    assert len(coord) == 1 and len(servers) == 2, commands
    coordinator_url = f"http://{coord[0].flag('--host')}:{coord[0].flag('--port')}"
    procs: list[Proc] = []
    try:
        procs.append(_start(coord[0], tmp / "coordinator.log", coord[0].flag("--port")))
        for i, cmd in enumerate(servers):
            assert cmd.flag("--coordinator-url") == coordinator_url
            state = ("--state-dir", str(tmp / f"state-{i}"))
            log = tmp / f"server-{i}.log"
            procs.append(_start(cmd, log, cmd.flag("--http-port"), SERVER_OVERRIDES + state))
        ids = [cmd.flag("--instance-id") for cmd in servers]
        for cmd, me in zip(servers, ids, strict=True):
            want = ("registered", [i for i in ids if i != me])
            port = cmd.flag("--http-port")
            wait_until(
                partial(_peers_of, port),
                partial(operator.eq, want),
                what=f"{me} registered, with its peer",
                timeout=60,
            )
        check_endpoints(coordinator_url, commands)
        move_a_chunk(servers)
    finally:
        codes = [proc.stop() for proc in reversed(procs)]
    assert codes == [0] * len(procs), f"exit codes after SIGTERM, last started first: {codes}"


def check_endpoints(coordinator_url: str, commands: list[Command]) -> None:
    """Each node registered its control URL as documented and the data port its tcp
    transport bound, which is none of the documented ports and accepts connections."""
    listing = httpx.get(coordinator_url + "/instances", timeout=5).json()["instances"]
    by_id = {i["instance_id"]: i for i in listing}
    documented = {
        int(c.flag(f).rpartition(":")[2])
        for c in commands
        for f in ("--port", "--http-port", "--p2p-advertise-url")
        if f in c.args
    }
    for cmd in (c for c in commands if c.subcommand == "server"):
        entry = by_id[cmd.flag("--instance-id")]
        assert entry["p2p_advertised_url"] == cmd.flag("--p2p-advertise-url")
        url = _status(cmd.flag("--http-port"))["p2p"]["transfer_url"]
        assert url in entry["metadata"]["p2p_endpoint"]
        host, _, port = url.removeprefix("tcp://").rpartition(":")
        assert host == "127.0.0.1" and int(port) not in documented, url
        socket.create_connection((host, int(port)), timeout=5).close()


def move_a_chunk(servers: list[Command]) -> None:
    """Node A's engine stores two chunks; node B's, which never saw them, gets both
    through P2P over the announced data port."""
    a, b = (CacheClient(f"tcp://127.0.0.1:{cmd.flag('--port')}", timeout_s=30) for cmd in servers)
    with a, b:
        for client in (a, b):
            client.register("deploy-doc", "float16", (2, 2, 8), chunk_size=CHUNK_TOKENS)
        tokens = list(range(2 * CHUNK_TOKENS))
        data = [np.full(4096, i + 1, np.uint8) for i in range(2)]
        assert a.store_chunks(tokens, data).stored == 2

        wait_until(
            lambda: b.lookup(tokens).hit_chunks,
            lambda hit: hit == 2,
            what="node B reads node A's chunks through P2P",
            timeout=30,
        )
        b_status = _status(servers[1].flag("--http-port"))
        assert b_status["p2p"]["chunks_fetched"] == 2


if __name__ == "__main__":
    run(Path(sys.argv[1]))
    print("DEPLOY-DOC-OK")
