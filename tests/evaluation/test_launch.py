"""The one launcher: starting a process with its log, readiness on observable state with a
bounded deadline (HTTP, TCP port, log line), stopping by pid (the signal, then SIGKILL),
restarts, and free-port picking (outside the kernel's ephemeral range, distinct,
bindable). Real child processes on loopback."""

from __future__ import annotations

import os
import signal
import socket
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvatlas.launch import procs
from kvatlas.launch.procs import (
    HOST,
    Proc,
    ProcessError,
    free_port,
    free_ports,
    launch,
    python_module,
)
from support.wait import wait_until

EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")


@pytest.mark.skipif(not EPHEMERAL.exists(), reason="Linux only: the ephemeral port range")
def test_ports_come_from_below_the_ephemeral_range_and_can_be_bound() -> None:
    first_ephemeral = int(EPHEMERAL.read_text().split()[0])
    ports = free_ports(64)
    assert len(set(ports)) == 64
    # An outgoing connection (ours or a child's) never gets one of these ports.
    assert all(10_000 <= p < first_ephemeral for p in ports)
    for port in ports[:8]:
        with socket.socket() as s:
            s.bind((HOST, port))


def test_a_port_in_use_is_never_picked(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as taken:
        taken.bind((HOST, 0))
        taken.listen()
        busy = taken.getsockname()[1]
        monkeypatch.setattr(procs, "_pick_range", lambda: (busy, busy + 2))
        assert free_ports(1) == [busy + 1]


def test_without_the_range_the_kernel_picks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(procs, "_EPHEMERAL_RANGE", Path("/nonexistent/ip_local_port_range"))
    ports = free_ports(3)
    assert len(set(ports)) == 3 and all(p > 0 for p in ports)


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


def test_a_process_is_ready_once_its_http_endpoint_answers_and_stops_on_sigterm(
    tmp_path: Path,
) -> None:
    port = free_port()
    argv = python_module("http.server", "--bind", HOST, str(port))
    with launch(argv, name="web", log=tmp_path / "web.log", http_port=port, http_path="/") as p:
        assert p.alive() and p.url == f"http://{HOST}:{port}"
        assert p.starts == 1
    assert p.returncode == -signal.SIGTERM
    assert p.stop() == -signal.SIGTERM  # stopping again signals nothing


def test_readiness_on_a_tcp_port_and_on_a_log_line(tmp_path: Path) -> None:
    port = free_port()
    code = f"""
        import socket, time
        s = socket.socket(); s.bind(("{HOST}", {port})); s.listen()
        print("listening on {port}", flush=True)
        time.sleep(60)
    """
    p = launch(_python(code), name="tcp", tcp_port=port, log_line=r"^listening on \d+$")
    try:
        assert p.wait_log(r"listening on (\d+)").group(1) == str(port)
        assert "listening on" in p.text()
    finally:
        p.stop()
    assert p.log.parent.exists()  # a log no caller named goes to this process's folder


def test_a_process_that_exits_before_it_is_ready_fails_at_once_with_its_log(
    tmp_path: Path,
) -> None:
    code = """
        import sys
        print("bad flag --frobnicate", file=sys.stderr)
        sys.exit(3)
    """
    t0 = time.monotonic()
    with pytest.raises(ProcessError, match=r"(?s)exited with 3.*bad flag --frobnicate"):
        launch(_python(code), name="bad", log=tmp_path / "bad.log", http_port=free_port())
    assert time.monotonic() - t0 < 25  # not the 30 s deadline: its exit ended the wait


def test_a_process_that_never_gets_ready_is_killed_at_the_deadline(tmp_path: Path) -> None:
    started: list[Proc] = []
    with pytest.raises(ProcessError, match=r"did not get to logging /ready/ in 0\.5s"):
        launch(
            _python("import time; time.sleep(60)"),
            name="slow",
            log=tmp_path / "slow.log",
            log_line="ready",
            timeout=0.5,
            on_start=started.append,
        )
    (p,) = started
    assert not p.alive() and p.returncode == -signal.SIGKILL


def test_a_process_that_ignores_sigterm_is_killed_after_the_grace(tmp_path: Path) -> None:
    code = """
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("ignoring", flush=True)
        time.sleep(60)
    """
    p = launch(_python(code), name="stubborn", log=tmp_path / "s.log", log_line="ignoring")
    assert p.stop(grace_s=0.3) == -signal.SIGKILL


def test_a_frozen_process_still_stops_on_sigterm_and_thaws(tmp_path: Path) -> None:
    p = launch(_python("import time; time.sleep(60)"), name="frozen", log=tmp_path / "f.log")
    p.freeze()
    wait_until(lambda: _state(p.pid), lambda s: s == "T", what="the child stopped")
    p.thaw()
    wait_until(lambda: _state(p.pid), lambda s: s != "T", what="the child running again")
    p.freeze()
    wait_until(lambda: _state(p.pid), lambda s: s == "T", what="the child stopped again")
    assert p.stop(grace_s=10) == -signal.SIGTERM


def _state(pid: int) -> str:
    """The process's scheduler state letter (``T``: stopped, ``Z``: a zombie)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_a_restart_appends_to_the_log_and_counts_the_start(tmp_path: Path) -> None:
    p = Proc("twice", _python("print('hello')"), tmp_path / "twice.log")
    assert p.stop() is None and not p.started  # never started: nothing to signal
    with pytest.raises(ProcessError, match="never started"):
        _ = p.pid
    assert p.start().wait_exit(30) == 0
    assert p.start().wait_exit(30) == 0
    assert p.starts == 2
    assert p.text() == "hello\n--- start 2 ---\nhello\n"


def test_a_running_process_is_not_started_twice(tmp_path: Path) -> None:
    p = Proc("once", _python("import time; time.sleep(60)"), tmp_path / "once.log").start()
    try:
        with pytest.raises(ProcessError, match="still running"):
            p.start()
        with pytest.raises(ProcessError, match=r"still runs after 0\.1s"):
            p.wait_exit(0.1)
    finally:
        p.stop()


def test_pipes_carry_a_line_protocol_and_env_and_nice_reach_the_child(tmp_path: Path) -> None:
    code = """
        import os, sys
        print(os.environ["KVATLAS_TEST_VALUE"], os.nice(0), flush=True)
        for line in sys.stdin:
            print(line.strip().upper(), flush=True)
        print("bye", file=sys.stderr)
    """
    env = {"KVATLAS_TEST_VALUE": "seven", "PATH": "/usr/bin:/bin"}
    p = launch(_python(code), name="pipes", log=tmp_path / "p.log", env=env, pipes=True, nice=3)
    out, inp = p.popen.stdout, p.popen.stdin
    assert out is not None and inp is not None
    assert out.readline().split() == ["seven", str(os.nice(0) + 3)]
    inp.write("ping\n")
    inp.flush()
    assert out.readline() == "PING\n"
    inp.close()
    assert p.wait_exit(30) == 0
    assert p.stop() == 0  # closes this side's pipes
    assert p.text() == "bye\n"  # only stderr goes to the log


def test_a_child_dies_with_the_process_that_launched_it(tmp_path: Path) -> None:
    """The launcher's child is SIGKILLed by Linux when its parent dies, even by SIGKILL."""
    pid_file = tmp_path / "grandchild.pid"
    parent_code = f"""
        import sys, time
        from kvatlas.launch.procs import Proc
        child = Proc("grandchild", [sys.executable, "-c", "import time; time.sleep(60)"],
                     __import__("pathlib").Path({str(tmp_path / "g.log")!r})).start()
        open({str(pid_file)!r}, "w").write(str(child.pid))
        print("started", flush=True)
        time.sleep(60)
    """
    parent = launch(
        _python(parent_code), name="parent", log=tmp_path / "parent.log", log_line="started"
    )
    grandchild = int(pid_file.read_text())
    assert _alive(grandchild)
    parent.kill()
    wait_until(lambda: not _alive(grandchild), what="the grandchild gone with its parent")


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        return _state(pid) != "Z"
    except OSError:
        return False
