"""Each role's extra is enough for its commands, and holds nothing of ``dev``.

Every command runs through only_extra.py, which refuses any third-party import that a
``pip install 'kvatlas[ROLE]'`` would not have installed: ``--help`` of each role, the
three services started on loopback (the server registering with the coordinator, over
HTTP and, with the kafka marker, over Kafka), ``kvatlas bench`` with the bench extra,
and the messages that name the extra when it is missing.
"""

from __future__ import annotations

import subprocess
import sys
import time
import tomllib
from pathlib import Path

import httpx
import pytest
from packaging.requirements import Requirement

from docs.doc_commands import ROOT
from kvatlas.launch.broker import Broker
from kvatlas.launch.procs import free_ports
from support.launch import Proc, launch

ONLY_EXTRA = Path(__file__).with_name("only_extra.py")
ROLES = ("coordinator", "server", "router")
DEV_ONLY = {"pytest", "pytest-timeout", "hypothesis", "ruff", "mypy", "import-linter",
            "playwright", "openai", "pyyaml", "setuptools"}  # fmt: skip
"""What only the tests and the checks need."""


def only(extras: str, *args: str) -> list[str]:
    return [sys.executable, str(ONLY_EXTRA), extras, "--", *args]


def run(extras: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        only(extras, *args), capture_output=True, text=True, timeout=120, check=False, cwd=ROOT
    )


def optional_dependencies() -> dict[str, list[str]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps: dict[str, list[str]] = project["optional-dependencies"]
    return deps


def _name(requirement: str) -> str:
    return Requirement(requirement).name.lower()


@pytest.mark.parametrize("extra", [*ROLES, "engine", "bench"])
def test_a_role_extra_holds_nothing_of_dev(extra: str) -> None:
    names = {_name(r) for r in optional_dependencies()[extra]}
    assert not names & DEV_ONLY, f"{extra} installs test tools: {names & DEV_ONLY}"


@pytest.mark.parametrize("role", ROLES)
def test_help_runs_with_the_roles_extra_alone(role: str) -> None:
    done = run(role, role, "--help")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "usage:" in done.stdout


def test_only_extra_refuses_what_the_extra_lacks() -> None:
    done = run("server", "engine", "--help")
    assert done.returncode != 0
    assert "No module named 'torch' (not in this install)" in done.stderr


def _fleet(tmp_path: Path, extra_args: dict[str, list[str]]) -> list[Proc]:
    """coordinator, server, router, each with its own extra alone, on loopback."""
    coord, engine_port, http_port, router_port = free_ports(4)
    url = f"http://127.0.0.1:{coord}"
    argv = {
        "coordinator": ["coordinator", "--host", "127.0.0.1", "--port", str(coord)],
        "server": [
            "server", "--host", "127.0.0.1", "--port", str(engine_port), "--http-port",
            str(http_port), "--l1-size-gb", "0.0625", "--no-l1-prefault", "--instance-id",
            "only-extra", "--state-dir", str(tmp_path / "state"), "--l2-path",
            str(tmp_path / "l2"), "--l2-size-gb", "0.25", "--coordinator-url", url,
        ],
        "router": ["router", "--host", "127.0.0.1", "--port", str(router_port),
                   "--coordinator-url", url],
    }  # fmt: skip
    ports = {"coordinator": coord, "server": http_port, "router": router_port}
    procs: list[Proc] = []
    try:
        for role in ROLES:
            args = argv[role] + extra_args.get(role, [])
            procs.append(launch(only(role, *args), name=f"only-{role}", http_port=ports[role]))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            listed = httpx.get(f"{url}/instances", timeout=5).json()["instances"]
            if any(i["instance_id"] == "only-extra" for i in listed):
                break
            time.sleep(0.2)
        else:
            raise AssertionError("the server never registered")
    except BaseException:
        for proc in reversed(procs):
            proc.stop()
        raise
    return procs


def _stop(procs: list[Proc]) -> None:
    codes = {p.name: (p.stop(), p.tail()) for p in reversed(procs)}
    for name, (code, tail) in codes.items():
        assert code == 0, f"{name} exited {code}:\n{tail}"


@pytest.mark.slow
def test_the_roles_run_with_their_extras_alone(tmp_path: Path) -> None:
    _stop(_fleet(tmp_path, {}))


@pytest.mark.slow
@pytest.mark.kafka
def test_kafka_events_run_with_the_role_extras_alone(tmp_path: Path, kafka_broker: Broker) -> None:
    topic = f"only-extra-{time.monotonic_ns()}"
    kafka_broker.create_topic(topic)
    kafka = ["--event-transport", "kafka", "--kafka-bootstrap-servers", kafka_broker.bootstrap,
             "--kafka-topic", topic]  # fmt: skip
    _stop(_fleet(tmp_path, {"coordinator": kafka, "server": kafka}))


@pytest.mark.parametrize("command", ["fleet", "faults", "trace"])
def test_bench_help_runs_with_the_bench_extra(command: str) -> None:
    done = run("bench", "bench", command, "--help")
    assert done.returncode == 0, done.stderr[-3000:]


def test_bench_runs_with_the_bench_extra(tmp_path: Path) -> None:
    """The trace benchmark's simulation and its report (plots) on the bench extra alone."""
    out = tmp_path / "trace"
    done = run("bench", "bench", "trace", "--simulate-only", "--window-s", "30", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    assert (out / "report.md").is_file() and list(out.glob("*.png"))


@pytest.mark.parametrize(
    ("extras", "args", "says"),
    [
        ("router", ("bench", "fleet", "--help"), "pip install 'kvatlas[bench]'"),
        ("router", ("bench", "trace", "--simulate-only"), "pip install 'kvatlas[bench]'"),
        ("bench", ("bench", "fleet", "--engines"), "pip install 'kvatlas[engine]'"),
        (
            "bench",
            ("bench", "faults", "--faults", "frozen_engine"),
            "pip install 'kvatlas[engine]'",
        ),
    ],
)
def test_a_missing_extra_is_named(extras: str, args: tuple[str, ...], says: str) -> None:
    done = run(extras, *args)
    assert done.returncode == 2, done.stderr[-3000:]
    assert says in done.stderr and "Traceback" not in done.stderr
