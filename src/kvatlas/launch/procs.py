"""The one process launcher of the evaluation, the benchmarks and the test suites.

Owns starting a child process (any command line: a kvatlas coordinator, cache server,
engine or router, the tansu broker, an LMCache server) with its output in a log file;
waiting until it is ready on observable state with a bounded deadline (its HTTP endpoint
answering 200, a TCP port accepting connections, a line in its log, or a probe the caller
gives), failing at once with the log's tail when it exits first; and stopping it by its
pid: a signal (SIGTERM unless asked otherwise, with SIGCONT so that a frozen process
handles it), then SIGKILL after a grace period. On Linux every child gets SIGKILL when
the launching process dies (``PR_SET_PDEATHSIG``). Also owns the free loopback ports its
callers hand to their children: below the kernel's ephemeral range, so that no outgoing
connection of the child itself takes one before it binds, and all held while they are
chosen, so that two picks in one go never collide.

Must not: signal any process it did not start (only through the child's own ``Popen``,
never by name), bind or probe beyond 127.0.0.1, or know what its processes are for (the
callers build their command lines).

Exceptions: `ProcessError` when a process did not start, did not become ready in time, or
exited while awaited (its log's tail attached).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import errno
import logging
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Self, TypeVar

import httpx

from kvatlas.core.errors import KvatlasError

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
"""The only address the launched processes bind and the launcher probes."""

POLL_S = 0.05
"""How often a readiness wait looks again."""
PROBE_TIMEOUT_S = 0.5
"""Bound of one readiness probe (an HTTP request, a TCP connect)."""
TAIL_CHARS = 4000
"""How much of a log an error message carries."""


class ProcessError(KvatlasError):
    """A child process did not start, did not become ready, or stopped unexpectedly."""


# ---------------------------------------------------------------------------- ports

_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST_PORT = 10_000
"""Ports are picked from here up to the ephemeral range's start (32768 by default)."""
_RANDOM = random.SystemRandom()
"""Not the module's generator: a test that seeds it must not make two runs pick alike."""


def _pick_range() -> tuple[int, int] | None:
    """Ports [low, high) outside the kernel's ephemeral range, or None where that range
    is unknown or leaves too little room below it (then the kernel picks, port 0)."""
    try:
        first = int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return (_LOWEST_PORT, first) if first - _LOWEST_PORT >= 4096 else None


def free_ports(count: int) -> list[int]:
    """``count`` distinct free TCP ports on 127.0.0.1: all are held while they are
    chosen, since a port just released is often the next one handed out.

    Picked at random below the ephemeral range: a port the kernel hands out for
    port 0 is also what it hands out to outgoing connections, so a child that connects
    somewhere before it binds (an LMCache server registers first) could take its own
    port with that connection; and random picks keep concurrent runs apart."""
    span = _pick_range()
    held: list[socket.socket] = []
    try:
        while len(held) < count:
            s = socket.socket()
            port = 0 if span is None else _RANDOM.randrange(*span)
            try:
                s.bind((HOST, port))
            except OSError as exc:
                s.close()
                if exc.errno != errno.EADDRINUSE:
                    raise
                continue
            held.append(s)
        return [int(s.getsockname()[1]) for s in held]
    finally:
        for s in held:
            s.close()


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    return free_ports(1)[0]


# ---------------------------------------------------------------------------- logs

_log_dirs: list[Path] = []
"""The folder of the logs no caller named, made at the first such launch."""


def default_log(name: str) -> Path:
    """A fresh log file in one folder of this process, removed when the process exits."""
    if not _log_dirs:
        _log_dirs.append(Path(tempfile.mkdtemp(prefix="kvatlas-logs-")))
        atexit.register(shutil.rmtree, _log_dirs[0], True)
    fd, path = tempfile.mkstemp(prefix=f"{name}-", suffix=".log", dir=_log_dirs[0])
    os.close(fd)
    return Path(path)


def python_module(module: str, *args: str) -> list[str]:
    """The command line of ``python -m module args`` with this interpreter."""
    return [sys.executable, "-m", module, *args]


# ---------------------------------------------------------------------------- processes

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:  # pragma: no cover - runs in the child
    """Ask Linux to SIGKILL the calling process when its parent dies."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _child_setup(nice: int) -> Callable[[], None] | None:
    """What a child runs before it executes: it dies with its parent (Linux), and lowers
    its priority by ``nice``."""
    if sys.platform != "linux" and not nice:
        return None

    def setup() -> None:  # pragma: no cover - runs in the child
        if sys.platform == "linux":
            die_with_parent()
        if nice:
            os.nice(nice)

    return setup


@dataclass(eq=False)
class Proc:
    """One child process: its command line, its log, and (once started) its ``Popen``.

    ``start`` may be called again after the process exited (a restart at the same
    address); the log is appended to, with a marker line from the second start on."""

    name: str
    argv: list[str]
    log: Path
    http_port: int = 0
    """The port of its HTTP endpoint on 127.0.0.1; 0 when it has none."""
    env: Mapping[str, str] | None = field(default=None, repr=False)
    """Its whole environment; this process's when None."""
    cwd: Path | None = None
    pipes: bool = False
    """stdin and stdout are text pipes (a line protocol); only stderr goes to the log."""
    nice: int = 0
    """Added to its niceness at its start: 0 runs it at the launcher's own priority."""
    starts: int = field(default=0, init=False)
    _popen: subprocess.Popen[str] | None = field(default=None, init=False, repr=False)

    # ---- state

    @property
    def started(self) -> bool:
        return self._popen is not None

    @property
    def popen(self) -> subprocess.Popen[str]:
        if self._popen is None:
            raise ProcessError(f"{self.name} was never started")
        return self._popen

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<http_port>``."""
        if not self.http_port:
            raise ProcessError(f"{self.name} has no HTTP endpoint")
        return f"http://{HOST}:{self.http_port}"

    @property
    def returncode(self) -> int | None:
        """Its exit status; None while it runs (or was never started)."""
        return self._popen.poll() if self._popen is not None else None

    def alive(self) -> bool:
        return self._popen is not None and self._popen.poll() is None

    def text(self) -> str:
        """Everything it logged so far."""
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def tail(self, chars: int = TAIL_CHARS) -> str:
        return self.text()[-chars:]

    # ---- starting

    def start(self) -> Self:
        """Start it (again, once it has exited); returns at once, without waiting."""
        if self.alive():
            raise ProcessError(f"{self.name} (pid {self.pid}) is still running")
        self._close_pipes()
        self.starts += 1
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as out:
            if self.starts > 1:
                out.write(f"--- start {self.starts} ---\n".encode())
                out.flush()
            self._popen = subprocess.Popen(
                list(self.argv),
                stdin=subprocess.PIPE if self.pipes else subprocess.DEVNULL,
                stdout=subprocess.PIPE if self.pipes else out,
                stderr=out if self.pipes else subprocess.STDOUT,
                text=True,
                env=dict(self.env) if self.env is not None else None,
                cwd=self.cwd,
                preexec_fn=_child_setup(self.nice),  # noqa: PLW1509 (no threads in the child)
            )
        return self

    # ---- waiting

    def wait_until(
        self,
        ready: Callable[[], bool],
        what: str,
        timeout: float = 30.0,
        ignore: tuple[type[BaseException], ...] = (OSError, httpx.HTTPError),
    ) -> None:
        """Until ``ready()`` is true (exceptions of ``ignore`` count as "not yet");
        `ProcessError` with the log's tail at once if the process exits first, or when
        ``timeout`` seconds pass."""
        deadline = time.monotonic() + timeout
        while True:
            if not self.alive():
                raise ProcessError(
                    f"{self.name} exited with {self.returncode} before {what}:\n{self.tail()}"
                )
            with contextlib.suppress(*ignore):
                if ready() and self.alive():  # ours answered, not whoever took the port
                    return
            if time.monotonic() >= deadline:
                raise ProcessError(
                    f"{self.name} did not get to {what} in {timeout:.1f}s:\n{self.tail()}"
                )
            time.sleep(POLL_S)

    def wait_http(self, path: str = "/healthz", timeout: float = 30.0) -> None:
        """Until ``GET path`` on its HTTP port (or ``path`` itself when it is a whole
        URL) answers 200."""
        url = path if path.startswith(("http://", "https://")) else self.url + path
        with httpx.Client(timeout=PROBE_TIMEOUT_S, trust_env=False) as client:
            self.wait_until(lambda: client.get(url).status_code == 200, f"{url} answers", timeout)

    def wait_port(self, port: int, timeout: float = 30.0) -> None:
        """Until something accepts TCP connections on ``port`` of 127.0.0.1."""

        def listening() -> bool:
            socket.create_connection((HOST, port), timeout=PROBE_TIMEOUT_S).close()
            return True

        self.wait_until(listening, f"listening on port {port}", timeout)

    def wait_log(self, pattern: str, timeout: float = 30.0) -> re.Match[str]:
        """Until a line of its log matches the regular expression ``pattern``; the match."""
        rx = re.compile(pattern, re.MULTILINE)
        found: list[re.Match[str]] = []

        def logged() -> bool:
            m = rx.search(self.text())
            if m is not None:
                found.append(m)
            return m is not None

        self.wait_until(logged, f"logging /{pattern}/", timeout)
        return found[0]

    def wait_exit(self, timeout: float = 60.0) -> int:
        """Its exit status, once it has exited by itself (`ProcessError` after
        ``timeout``; the process is left running)."""
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            raise ProcessError(
                f"{self.name} (pid {self.pid}) still runs after {timeout:g}s:\n{self.tail()}"
            ) from None

    # ---- signals

    def send(self, sig: int) -> None:
        """Send ``sig`` to its pid while it runs (never to an exited, reaped pid)."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                self.popen.send_signal(sig)

    def freeze(self) -> None:
        """SIGSTOP: it keeps its sockets open but answers nothing."""
        self.send(signal.SIGSTOP)

    def thaw(self) -> None:
        """SIGCONT after ``freeze``."""
        self.send(signal.SIGCONT)

    def stop(self, sig: int = signal.SIGTERM, grace_s: float = 20.0) -> int | None:
        """Send ``sig`` to its pid, SIGKILL after ``grace_s``; its exit status (None when
        it was never started)."""
        p = self._popen
        if p is None:
            return None
        if p.poll() is None:
            self.send(sig)
            if sig not in (signal.SIGKILL, signal.SIGSTOP):
                self.send(signal.SIGCONT)  # a frozen process handles ``sig`` only then
            try:
                p.wait(grace_s)
            except subprocess.TimeoutExpired:
                log.warning("%s (pid %d) outlived its stop signal; killing it", self.name, p.pid)
                p.kill()
                p.wait(10)
        self._close_pipes()
        return p.returncode

    def kill(self) -> int | None:
        """SIGKILL: it dies without cleaning anything up."""
        return self.stop(signal.SIGKILL)

    def _close_pipes(self) -> None:
        if self._popen is None:
            return
        for pipe in (self._popen.stdin, self._popen.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()

    @classmethod
    def launch(
        cls,
        argv: Sequence[str],
        *,
        name: str,
        log: Path | None = None,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        pipes: bool = False,
        nice: int = 0,
        http_port: int = 0,
        http_path: str = "/healthz",
        tcp_port: int = 0,
        log_line: str = "",
        wait: bool = True,
        timeout: float = 30.0,
        on_start: Callable[[Proc], None] | None = None,
        **fields: Any,
    ) -> Self:
        """Start ``argv`` as one of this class (built with ``fields``); with ``wait``,
        return once it is ready: ``http_path`` answers 200 on ``http_port`` (when given),
        ``tcp_port`` accepts connections (when given), and a log line matches
        ``log_line`` (when given).

        Its output goes to ``log`` (a fresh file of this process when None). ``on_start``
        sees the process as soon as it runs (before the wait). A process that is not ready
        within ``timeout`` seconds (all the waits together), or exits first, is killed and
        `ProcessError` raised.
        """
        proc = cls(
            name=name,
            argv=list(argv),
            log=log or default_log(name),
            http_port=http_port,
            env=env,
            cwd=cwd,
            pipes=pipes,
            nice=nice,
            **fields,
        )
        proc.start()
        if on_start is not None:
            on_start(proc)
        if wait:
            deadline = time.monotonic() + timeout

            def left() -> float:
                return max(0.0, deadline - time.monotonic())

            try:
                if http_port:
                    proc.wait_http(http_path, left())
                if tcp_port:
                    proc.wait_port(tcp_port, left())
                if log_line:
                    proc.wait_log(log_line, left())
            except BaseException:
                proc.kill()
                raise
        return proc

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


P = TypeVar("P", bound=Proc)
"""A `Proc` or a subclass of it (the caller's fields, ``Proc.launch``'s return)."""

launch = Proc.launch
"""Start a `Proc` and wait until it is ready (`Proc.launch`)."""
