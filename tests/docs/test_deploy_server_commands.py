"""docs/migrating-from-lmcache.md's drop-in for `lmcache server`, run from the document.

The section's first shell block is LMCache's P2P guide's five terminals with `kvatlas
coordinator` and `kvatlas server` in place of LMCache's. Its commands are read from the
document, so that it cannot drift from what runs:

- statically: the server flags and the vLLM command lines are the guide's, word for
  word (``GUIDE_*`` below, copied from the guide), each vLLM points at its node's server,
  and vLLM's environment gains only the transfer mode;
- for real (marker ``lmcache``): the coordinator and both servers start from the
  documented argv (the documented ports moved to free loopback ports, the 50 GiB L1 cut
  to 0.0625 GiB, a private --state-dir), and each ``vllm serve``, which cannot run here
  (no GPU), is replaced by LMCache 0.5.6's own vLLM adapters (``tests/lmcache_mp/
  mp_driver.py``, run by .venv-lmcache's Python: the code ``LMCacheMPConnector`` runs)
  on CPU KV, connected where that command's ``kv_connector_extra_config`` points
  (``lmcache.mp.host``, default ``tcp://localhost``, and ``lmcache.mp.port``) with the
  transfer mode of its environment. A prompt stored through one node is fetched through
  the other, in both directions: every chunk, byte for byte.
"""

from __future__ import annotations

import json
import operator
import os
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvatlas.launch.procs import HOST, free_ports
from lmcache_mp.driver import Driver
from support.launch import Proc, launch, python_module
from support.wait import wait_until

ROOT = Path(__file__).resolve().parents[2]
DEPLOY_MD = ROOT / "docs" / "migrating-from-lmcache.md"
SECTION = "## Drop-in for `lmcache server`"
CHUNK = 256
SERVER_OVERRIDES = ("--l1-size-gb", "0.0625")
"""Appended to each documented server command (argparse keeps the last value): the
guide's 50 GiB of L1 per server is more than this machine has to spare."""

GUIDE_SERVER = """
  --host 127.0.0.1 --port {port} --http-port {http} \\
  --l1-size-gb 50 --eviction-policy LRU \\
  --l1-align-bytes 65536 \\
  --instance-id node-{node} \\
  --coordinator-url http://127.0.0.1:9300 \\
  --coordinator-advertise-ip 127.0.0.1 \\
  --p2p-advertise-url 127.0.0.1:{p2p}
"""
"""The flags of LMCache's P2P guide's `lmcache server` (terminals 2 and 4)."""
GUIDE_VLLM = (
    "vllm serve Qwen/Qwen3-14B --port {port} --kv-transfer-config "
    """'{{"kv_connector":"LMCacheMPConnector","kv_role":"kv_both","""
    """"kv_load_failure_policy":"recompute","""
    """"kv_connector_extra_config":{{"lmcache.mp.port":{mp}}}}}'"""
)
"""The guide's `vllm serve` (terminals 3 and 5), after ``CUDA_VISIBLE_DEVICES=N``."""


def _words(text: str) -> list[str]:
    return shlex.split(text.replace("\\\n", " "))


GUIDE = [
    ("server", _words(GUIDE_SERVER.format(port=6555, http=7555, node="a", p2p=8555))),
    ("vllm", _words(GUIDE_VLLM.format(port=8000, mp=6555))),
    ("server", _words(GUIDE_SERVER.format(port=6556, http=7556, node="b", p2p=8556))),
    ("vllm", _words(GUIDE_VLLM.format(port=8001, mp=6556))),
]


@dataclass(frozen=True)
class Command:
    """One command of the block: ``kind`` is coordinator, server or vllm."""

    kind: str
    args: tuple[str, ...]
    env: dict[str, str]

    def flag(self, name: str) -> str:
        return self.args[self.args.index(name) + 1]

    def extra_config(self) -> dict[str, Any]:
        config: dict[str, Any] = json.loads(self.flag("--kv-transfer-config"))
        return dict(config["kv_connector_extra_config"])


def documented_commands(text: str | None = None) -> list[Command]:
    """The commands of the section's first shell block, line continuations joined, in
    order, with the ``VAR=value`` words before each."""
    text = DEPLOY_MD.read_text() if text is None else text
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    commands = []
    for line in block.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        env = {}
        while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
            key, _, value = words.pop(0).partition("=")
            env[key] = value
        if words[:2] in (["kvatlas", "coordinator"], ["kvatlas", "server"]):
            commands.append(Command(words[1], tuple(words[2:]), env))
        elif words[:2] == ["vllm", "serve"]:
            commands.append(Command("vllm", tuple(words), env))
        else:
            assert not words, f"a command the test does not know: {line!r}"
    return commands


def test_the_drop_in_is_the_guides_five_terminals() -> None:
    commands = documented_commands()
    assert [c.kind for c in commands] == ["coordinator", "server", "vllm", "server", "vllm"]
    coordinator, rest = commands[0], commands[1:]
    url = f"http://{coordinator.flag('--host')}:{coordinator.flag('--port')}"
    assert coordinator.flag("--port") == "9300"  # the guide's
    for (kind, guide_args), cmd in zip(GUIDE, rest, strict=True):
        assert cmd.kind == kind
        if kind == "server":
            assert list(cmd.args) == guide_args, "the guide's `lmcache server` flags"
            assert cmd.flag("--coordinator-url") == url
            assert not cmd.env
        else:  # the guide's vLLM command word for word; its environment gains one setting
            assert list(cmd.args) == guide_args
            assert cmd.env.pop("CUDA_VISIBLE_DEVICES") in ("0", "1")
            assert cmd.env == {"LMCACHE_MP_TRANSFER_MODE": "engine_driven"}
    for server, vllm in ((rest[0], rest[1]), (rest[2], rest[3])):
        assert str(vllm.extra_config()["lmcache.mp.port"]) == server.flag("--port")


# ---- run


def engine(venv: Path, url: str, mode: str, log: Path) -> Driver:
    """LMCache's vLLM adapters in .venv-lmcache, in place of one documented ``vllm
    serve``."""
    drv = Driver(venv, url, mode, log, name=log.stem)
    assert drv.ready.get("chunk") == CHUNK, drv.ready
    return drv


def moved_ports(commands: list[Command]) -> dict[str, str]:
    """Each documented port (coordinator, servers' engine, HTTP and P2P ports, vLLM's
    connector port) and the free loopback port it becomes."""
    ports = set()
    for c in commands:
        if c.kind == "vllm":
            ports.add(str(c.extra_config()["lmcache.mp.port"]))
            continue
        for name in ("--port", "--http-port", "--p2p-advertise-url", "--coordinator-url"):
            if name in c.args:
                ports.add(c.flag(name).rpartition(":")[2])
    return dict(zip(sorted(ports), (str(p) for p in free_ports(len(ports))), strict=True))


def moved(arg: str, ports: dict[str, str]) -> str:
    return re.sub(r"\b\d{4,5}\b", lambda m: ports.get(m.group(0), m.group(0)), arg)


def _fetch_fresh(engine: Driver, tokens: list[int], seed: int) -> dict[str, Any]:
    """A fetch under a request id of its own (each try of a wait is a new request)."""
    return engine.call("fetch", tokens, f"fetch-{seed}-{os.urandom(4).hex()}")


def prompt(seed: int, chunks: int = 3) -> list[int]:
    """``chunks`` full chunks and a partial one, which is never stored."""
    return [seed * 100_000 + i for i in range(chunks * CHUNK + CHUNK // 2)]


def _peers(http_port: str) -> tuple[str, list[str]]:
    status = httpx.get(f"http://{HOST}:{http_port}/status", timeout=5).json()
    return status["p2p_state"], list(status["p2p_peers"])


@pytest.fixture(scope="module")
def fleet(lmcache_venv: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The block's commands running: the coordinator, two servers, and an engine per
    documented ``vllm serve``."""
    logs = tmp_path_factory.mktemp("deploy-drop-in")
    commands = documented_commands()
    ports = moved_ports(commands)
    procs: list[Proc] = []
    engines: list[Driver] = []
    wanted: list[tuple[str, str]] = []
    """(url, transfer mode) of each documented vLLM's connector."""
    try:
        servers = []
        for i, c in enumerate(commands):
            args = [moved(a, ports) for a in c.args]
            if c.kind == "coordinator":
                argv = python_module("kvatlas.cli.coordinator", *args)
                http = moved(c.flag("--port"), ports)
                procs.append(launch(argv, name=f"coordinator-{i}", log=logs / "coordinator.log",
                                    http_port=int(http), timeout=60))  # fmt: skip
            elif c.kind == "server":
                extra = (*SERVER_OVERRIDES, "--state-dir", str(logs / f"state-{i}"))
                argv = python_module("kvatlas.cli.server", *args, *extra)
                http = moved(c.flag("--http-port"), ports)
                name = c.flag("--instance-id")
                procs.append(launch(argv, name=name, log=logs / f"{name}.log",
                                    http_port=int(http), timeout=60))  # fmt: skip
                servers.append((name, http))
            else:  # the node's engine, started once both servers see each other
                extra_config = c.extra_config()
                host = extra_config.get("lmcache.mp.host", "tcp://localhost")
                url = f"{host}:{moved(str(extra_config['lmcache.mp.port']), ports)}"
                mode = c.env.get("LMCACHE_MP_TRANSFER_MODE", "auto")
                wanted.append((url, mode))
        names = [n for n, _ in servers]
        for name, http in servers:
            want = ("registered", [n for n in names if n != name])
            wait_until(partial(_peers, http), partial(operator.eq, want),
                       what=f"{name} registered, with its peer", timeout=60)  # fmt: skip
        for i, (url, mode) in enumerate(wanted):
            engines.append(engine(lmcache_venv, url, mode, logs / f"engine-{i}.log"))
        yield servers, engines
    finally:
        for e in reversed(engines):
            e.close()
        for p in reversed(procs):
            p.stop()


@pytest.mark.lmcache
@pytest.mark.slow
def test_a_prefix_stored_on_one_node_is_fetched_on_the_other(fleet: Any) -> None:
    servers, (engine_a, engine_b) = fleet
    for seed, (writer, reader) in enumerate(((engine_a, engine_b), (engine_b, engine_a)), 1):
        tokens = prompt(seed)
        stored = writer.call("store", tokens, f"store-{seed}", seed=seed)
        assert stored["ok"] and stored["hit"] == 0 and len(stored["digests"]) == 3, stored
        # the reader's server learns who holds it from the coordinator's directory,
        # which the writer's server tells on its next event flush
        got = wait_until(
            partial(_fetch_fresh, reader, tokens, seed),
            lambda answer: answer["ok"] and answer["hit"] == 3,
            what=f"prompt {seed}: the other node's engine gets all 3 chunks through P2P",
            timeout=30,
            every=0.5,
        )
        assert got["digests"] == stored["digests"]
    for name, http in servers:
        status = httpx.get(f"http://{HOST}:{http}/status", timeout=5).json()
        assert status["p2p"]["chunks_fetched"] >= 3, (name, status["p2p"])
