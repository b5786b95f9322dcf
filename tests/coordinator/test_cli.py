"""`kvatlas coordinator` flags: environment, validation messages naming the flag."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvatlas.cli.coordinator import config_from_args, main
from kvatlas.coordinator.app import Coordinator
from kvatlas.coordinator.config import CoordinatorConfig
from kvatlas.coordinator.host import cpu_latency
from kvatlas.coordinator.host.cpu_latency import current_limit_us, why_not_held
from kvatlas.core.coordinator.fleet import FleetState
from kvatlas.core.errors import ConfigError
from kvatlas.core.keys import CHAINS
from kvatlas.launch.procs import free_port
from support.launch import Proc, launch, python_module


def test_defaults_and_env_token() -> None:
    cfg = config_from_args([], {"KVATLAS_AUTH_TOKEN": "tok"})
    assert cfg.auth_token == "tok"
    assert (cfg.port, cfg.instance_timeout, cfg.chunk_size) == (9300, 30.0, 256)
    assert cfg.kafka_topic == "kvatlas-cache-events"
    assert config_from_args(["--auth-token", "x"], {"KVATLAS_AUTH_TOKEN": "tok"}).auth_token == "x"
    cfg = config_from_args(
        [
            "--event-transport",
            "kafka",
            "--kafka-bootstrap-servers",
            "h:1",
            "--enable-blend-lookup",
            "--chunk-size",
            "16",
        ],
        {},
    )
    assert (cfg.event_transport, cfg.enable_blend_lookup, cfg.chunk_size) == ("kafka", True, 16)
    assert config_from_args([], {}).max_connections == 0  # from the open-file limit
    assert config_from_args(["--max-connections", "64"], {}).max_connections == 64
    assert (
        config_from_args([], {}).max_buffered_bytes == 4 * config_from_args([], {}).max_body_bytes
    )
    buffered = config_from_args(["--max-buffered-bytes", "99999999"], {}).max_buffered_bytes
    assert config_from_args([], {}).l2_retention_s == 86400.0
    edge = config_from_args(
        ["--header-timeout-s", "2", "--body-timeout-s", "3", "--min-body-rate", "100"], {}
    )
    assert (edge.header_timeout_s, edge.body_timeout_s, edge.min_body_rate) == (2.0, 3.0, 100.0)
    assert config_from_args(["--l2-retention-s", "0"], {}).l2_retention_s == 0.0
    assert buffered == 99999999


@pytest.mark.parametrize(
    ("overrides", "flag"),
    [
        ({"port": 70000}, "--port"),
        ({"instance_timeout": 0}, "--instance-timeout"),
        ({"health_check_interval": 60}, "--health-check-interval"),
        ({"chunk_size": 0}, "--chunk-size"),
        ({"event_transport": "kafka"}, "--kafka-bootstrap-servers"),
        ({"snapshot_interval": -1}, "--snapshot-interval"),
        ({"max_body_bytes": 0}, "--max-body-bytes"),
        ({"max_lookup_tokens": -5}, "--max-lookup-tokens"),
        ({"max_connections": -1}, "--max-connections"),
        ({"max_buffered_bytes": 1024}, "--max-buffered-bytes"),
        ({"l2_retention_s": -1.0}, "--l2-retention-s"),
        ({"header_timeout_s": 0.0}, "--header-timeout-s"),
        ({"body_timeout_s": -1.0}, "--body-timeout-s"),
        ({"min_body_rate": 0.0}, "--min-body-rate"),
        ({"drop_token_ids": True, "enable_blend_lookup": True}, "--drop-token-ids"),
        ({"token_hash_memo_bytes": -1}, "--token-hash-memo-bytes"),
        ({"cpu_latency_us": -1}, "--cpu-latency-us"),
    ],
)
def test_validation_names_the_flag(overrides: dict[str, object], flag: str) -> None:
    with pytest.raises(ConfigError, match=flag):
        CoordinatorConfig(**overrides).validate()  # type: ignore[arg-type]


def test_main_exits_2_with_a_message(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--chunk-size", "0"]) == 2
    assert "--chunk-size" in capsys.readouterr().err


def test_the_token_hash_memo_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert config_from_args([], {}).token_hash_memo_bytes == 32 << 20
    assert config_from_args(["--token-hash-memo-bytes", "0"], {}).token_hash_memo_bytes == 0
    if "compiled" not in CHAINS:
        pytest.skip("the memo serves the compiled chain, not built here")
    # Under one set of four links: refused at start, naming the flag and the least size.
    assert main(["--host", "127.0.0.1", "--port", "0", "--token-hash-memo-bytes", "100"]) == 2
    err = capsys.readouterr().err
    assert "--token-hash-memo-bytes" in err
    assert "at least 4416 bytes" in err


def test_snapshot_of_other_chunk_size_is_refused(tmp_path: Path) -> None:

    snap = tmp_path / "s.snap"
    snap.write_bytes(FleetState(chunk_size=128).snapshot())
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvatlas.cli.coordinator",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--snapshot-path",
            str(snap),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert r.returncode == 2
    assert "--chunk-size 128" in r.stderr
    snap.write_bytes(b"garbage")
    assert main(["--host", "127.0.0.1", "--port", "0", "--snapshot-path", str(snap)]) == 2


def test_the_cpu_latency_flag(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert config_from_args([], {}).cpu_latency_us is None
    assert config_from_args(["--cpu-latency-us", "0"], {}).cpu_latency_us == 0
    assert main(["--cpu-latency-us", "-1"]) == 2
    assert "--cpu-latency-us must be 0-2000000000 us, got -1" in capsys.readouterr().err
    # Where the device cannot be opened (no root): refused at start, naming the flag.
    monkeypatch.setattr(cpu_latency, "DEVICE", tmp_path / "no_such_device")
    assert main(["--host", "127.0.0.1", "--port", "0", "--cpu-latency-us", "0"]) == 2
    err = capsys.readouterr().err
    assert "--cpu-latency-us: cannot open" in err and "no CPU latency QoS device" in err


@pytest.mark.skipif(why_not_held() is not None, reason="needs the kernel's PM QoS device")
def test_the_coordinator_holds_the_cpu_latency_while_it_lives() -> None:
    before = current_limit_us()
    assert before is not None
    coordinator = Coordinator(
        CoordinatorConfig(host="127.0.0.1", port=0, cpu_latency_us=9, token_hash_memo_bytes=0)
    )
    try:
        assert current_limit_us() == min(before, 9)
        assert b"kvatlas_coordinator_cpu_latency_hold_us 9.0" in coordinator.metrics.render()
    finally:
        coordinator.shutdown()
    assert current_limit_us() == before


@pytest.mark.skipif(why_not_held() is not None, reason="needs the kernel's PM QoS device")
def test_a_frozen_coordinator_keeps_the_hold_and_a_killed_one_drops_it(
    tmp_path: Path, pm_qos_device: None
) -> None:
    """The hold lives exactly as long as the process: SIGSTOP keeps it (the process still
    exists), SIGKILL drops it with no shutdown code run, and the next coordinator holds
    its own."""

    def start(us: int) -> Proc:
        port = free_port()
        argv = python_module("kvatlas.cli.coordinator", "--host", "127.0.0.1", "--port", str(port))
        argv += ["--cpu-latency-us", str(us)]
        return launch(argv, name=f"coordinator-{us}", log=tmp_path / f"c-{us}.log", http_port=port)

    before = current_limit_us()
    assert before is not None
    proc = start(13)
    try:
        assert current_limit_us() == min(before, 13)
        proc.freeze()
        time.sleep(0.2)  # not synchronisation: a while frozen, in which it must not let go
        assert current_limit_us() == min(before, 13)  # frozen: still held
        proc.kill()  # delivered to a stopped process too
    finally:
        proc.kill()
    assert current_limit_us() == before
    proc = start(17)
    try:
        assert current_limit_us() == min(before, 17)
    finally:
        assert proc.stop() == 0
    assert current_limit_us() == before
