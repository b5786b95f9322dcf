"""The coordinator, server and router commands of each deployment, started here.

Containers cannot start on these machines, so each deployment's own commands run as
processes on 127.0.0.1 instead: the same flags, with addresses on loopback, ports mapped
to free ones (a port named twice maps to one port, so a URL still reaches the process it
named), paths in a scratch folder, L1 small; the Kubernetes set also with its Kafka
events, on the tests' tansu broker. The server must register with the coordinator its
URL names, and each process must answer ``/healthz`` and stop on SIGTERM.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import httpx
import pytest

from deploy.manifests import (
    PORT_FLAGS,
    URL_FLAGS,
    DeployCommand,
    all_commands,
    on_loopback,
    parse,
    split_flags,
    url_port,
)
from kvatlas.launch.procs import free_ports
from support.launch import Proc, launch, python_module
from support.wait import wait_until

ROLES = ("coordinator", "server", "router")
SOURCES = ["compose", "systemd", pytest.param("k8s", marks=pytest.mark.kafka)]


def _deployed_ports(cmds: list[DeployCommand]) -> list[int]:
    ports = set()
    for cmd in cmds:
        for flag, value in split_flags(cmd.words[2:]):
            if value is None:
                continue
            if flag in PORT_FLAGS and value != "0":
                ports.add(int(value))
            elif flag in URL_FLAGS:
                ports.add(url_port(value))
    return sorted(ports)


def _http_port(cmd: DeployCommand) -> int:
    a = parse(cmd)
    return int(a.http_port if cmd.role == "server" else a.port)


@pytest.mark.slow
@pytest.mark.parametrize("source", SOURCES)
def test_the_deployed_commands_run_on_loopback(
    source: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    cmds = {c.role: c for c in all_commands() if c.source == source and c.role in ROLES}
    assert sorted(cmds) == sorted(ROLES)
    deployed = _deployed_ports(list(cmds.values()))
    ports = dict(zip(deployed, free_ports(len(deployed)), strict=True))
    replace: dict[str, str] = {}
    headers: dict[str, str] = {}
    if any("--auth-token-file" in w for c in cmds.values() for w in c.words):
        token = uuid.uuid4().hex
        (tmp_path / "token").write_text(f"{token}\n")
        replace["--auth-token-file"] = str(tmp_path / "token")
        headers["Authorization"] = f"Bearer {token}"
    if source == "k8s":
        broker = request.getfixturevalue("kafka_broker")
        topic = f"deploy-{uuid.uuid4().hex[:8]}"
        broker.create_topic(topic)
        replace["--kafka-bootstrap-servers"] = broker.bootstrap
        replace["--kafka-topic"] = topic
    procs: list[Proc] = []
    try:
        for role in ROLES:
            cmd = cmds[role]
            argv = on_loopback(cmd, ports, tmp_path, replace)
            procs.append(
                launch(
                    python_module("kvatlas.cli.main", *argv),
                    name=f"{source}-{role}",
                    http_port=ports[_http_port(cmd)],
                    timeout=60,
                )
            )
        instance = parse(cmds["server"]).instance_id
        coordinator = f"http://127.0.0.1:{ports[_http_port(cmds['coordinator'])]}"

        def listed() -> list[str]:
            answer = httpx.get(f"{coordinator}/instances", headers=headers, timeout=5)
            answer.raise_for_status()
            return [i["instance_id"] for i in answer.json()["instances"]]

        wait_until(listed, lambda ids: instance in ids, what=f"{instance} registered", timeout=30)
        router = f"http://127.0.0.1:{ports[_http_port(cmds['router'])]}"
        assert httpx.get(f"{router}/healthz", timeout=5).status_code == 200
    finally:
        codes = {proc.name: (proc.stop(), proc.tail()) for proc in reversed(procs)}
    for name, (code, tail) in codes.items():
        assert code == 0, f"{name} exited {code} on SIGTERM:\n{tail}"
