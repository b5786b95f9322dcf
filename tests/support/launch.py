"""The one process launcher of the test suites.

Owns starting a child process (a kvatlas coordinator, cache server or engine, any
``python -m`` module, or the tansu broker) with its output captured to a log file,
waiting until it answers (its HTTP ``/healthz``, or a TCP port), and stopping it by its
pid: SIGTERM (or the signal asked for), then SIGKILL after a grace period. A start that
fails raises with the tail of the log; every launched process is remembered so that a
failed test's report carries the tails of the logs of the processes it started (see
``tests/conftest.py``). Free ports and the HTTP wait are ``kvatlas.runtime.procs``'.

Must not: signal anything but the process it started, by pid (never by name), or know
what the processes are for (``services.py`` builds their command lines).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from kvatlas.runtime.procs import HOST, ProcessError, die_with_parent, wait_http
from support.wait import wait_until

LAUNCHED: list[Proc] = []
"""Every process launched in this test session, oldest first (for failure reports)."""

_log_dirs: list[Path] = []
"""The folder of the logs no test named, made at the first such launch."""

P = TypeVar("P", bound="Proc")


def _default_log(name: str) -> Path:
    """A fresh log file in one folder of this session, removed when the session ends."""
    if not _log_dirs:
        _log_dirs.append(Path(tempfile.mkdtemp(prefix="kvatlas-test-logs-")))
        atexit.register(shutil.rmtree, _log_dirs[0], True)
    fd, path = tempfile.mkstemp(prefix=f"{name}-", suffix=".log", dir=_log_dirs[0])
    os.close(fd)
    return Path(path)


@dataclass(eq=False)
class Proc:
    """A process a test started; stop it with ``stop()`` (or use it as a context manager)."""

    name: str
    popen: subprocess.Popen[str]
    log: Path
    http_port: int = 0
    """The port of its HTTP endpoint on 127.0.0.1; 0 when it has none."""

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<http_port>``."""
        assert self.http_port, f"{self.name} has no HTTP endpoint"
        return f"http://{HOST}:{self.http_port}"

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    def alive(self) -> bool:
        return self.popen.poll() is None

    def text(self) -> str:
        """Everything it logged so far."""
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def tail(self, chars: int = 4000) -> str:
        return self.text()[-chars:]

    # ---- waiting

    def wait_http(self, path: str = "/healthz", timeout: float = 30.0) -> None:
        """Until ``path`` answers 200; ProcessError with the log's tail if it exits first."""
        wait_http(self.url + path, self.popen, self.log, timeout)  # type: ignore[arg-type]

    def wait_port(self, port: int, timeout: float = 30.0) -> None:
        """Until something accepts TCP connections on ``port``; fails at once if the
        process exits first."""

        def listening() -> bool:
            if not self.alive():
                raise ProcessError(f"{self.name} exited with {self.returncode}:\n{self.tail()}")
            try:
                socket.create_connection((HOST, port), timeout=0.2).close()
            except OSError:
                return False
            return True

        wait_until(listening, what=f"{self.name} listening on port {port}", timeout=timeout)

    def wait_exit(self, timeout: float = 60.0) -> int:
        """Its exit status, once it has exited by itself."""
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"{self.name} (pid {self.pid}) still runs after {timeout:g}s:\n{self.tail()}"
            ) from None

    # ---- stopping

    def stop(self, sig: int = signal.SIGTERM, grace_s: float = 20.0) -> int:
        """Send ``sig`` to its pid, SIGKILL after ``grace_s``; the exit status."""
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.popen.send_signal(sig)
            try:
                self.popen.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)
        self._close_pipes()
        return self.popen.returncode

    def kill(self) -> int:
        """SIGKILL: it dies without cleaning anything up."""
        return self.stop(signal.SIGKILL)

    def _close_pipes(self) -> None:
        for pipe in (self.popen.stdin, self.popen.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()

    def __enter__(self) -> Proc:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def python_module(module: str, *args: str) -> list[str]:
    """The command line of ``python -m module args`` with this interpreter."""
    return [sys.executable, "-m", module, *args]


def launch(
    argv: Sequence[str],
    *,
    name: str,
    log: Path | None = None,
    env: Mapping[str, str] | None = None,
    http_port: int = 0,
    wait: bool = True,
    tcp_port: int = 0,
    timeout: float = 30.0,
    pipes: bool = False,
    cls: type[P] = Proc,  # type: ignore[assignment]
    **fields: Any,
) -> P:
    """Start ``argv`` as a ``cls`` (built with ``fields``); by default wait until it answers.

    Its stdout and stderr go to ``log`` (a fresh file of this session when None); with
    ``pipes``, stdin and stdout are text pipes for a line protocol and only stderr goes
    to the log. ``env`` is its whole environment (this process's when None). With
    ``http_port`` (and ``wait``), returns once ``/healthz`` answers 200; with
    ``tcp_port``, once the port accepts connections. The child is killed if this process
    dies, and killed when it fails to start.
    """
    log = log or _default_log(name)
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        popen = subprocess.Popen(
            list(argv),
            stdin=subprocess.PIPE if pipes else subprocess.DEVNULL,
            stdout=subprocess.PIPE if pipes else out,
            stderr=out,
            text=True,
            env=dict(env) if env is not None else None,
            preexec_fn=die_with_parent,  # noqa: PLW1509 (no threads start in the child)
        )
    proc = cls(name=name, popen=popen, log=log, http_port=http_port, **fields)
    LAUNCHED.append(proc)
    if wait:
        try:
            if http_port:
                proc.wait_http(timeout=timeout)
            if tcp_port:
                proc.wait_port(tcp_port, timeout)
        except BaseException:
            proc.kill()
            raise
    return proc
