"""The processes of the LMCache compatibility suite, each on 127.0.0.1 and stopped by pid.

- `KvatlasCoordinator`: `kvatlas coordinator` from this checkout (the test's Python).
- `LMCacheCoordinator`: `lmcache coordinator` 0.5.6 from .venv-lmcache, for comparison.
- `LMCacheServer`: `lmcache server` (MP mode, CPU) reporting to one of them, or to a
  `Tee` that sends each of its calls to both and records both answers.
- `Engine`: `lmcache_driver.py` in .venv-lmcache, a stand-in engine that stores and
  retrieves KV through LMCache's own client path (CPU tensors over POSIX shared memory).

The launcher and the wait are the test suites' (`support.launch`, `support.wait`);
nothing else here starts or signals a process. Every LMCache process runs with
LMCACHE_TRACK_USAGE=false and DO_NOT_TRACK=1, so nothing phones home.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, NamedTuple

import httpx

from kvatlas.launch.procs import HOST, free_ports
from support.launch import Proc, launch

ROOT = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("lmcache_driver.py")
QUIET = {
    "LMCACHE_TRACK_USAGE": "false",
    "DO_NOT_TRACK": "1",
    "LMCACHE_DISABLE_BANNER": "1",
}
NIXL_ON_LOOPBACK = {"UCX_NET_DEVICES": "lo", "UCX_TLS": "tcp,cma,self"}
"""UCX may use loopback TCP and cross-memory attach only: nothing leaves 127.0.0.1."""
MODEL = "test-model"
"""The model name LMCache's client path stores under."""
CHUNK = 256
WAIT_S = 30.0
"""How long the suite waits for what an LMCache process does next (its heartbeats and
event flushes come every second or less)."""


def lmcache_env(venv: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {**os.environ, **QUIET, **(extra or {})}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env.pop("PYTHONPATH", None)  # kvatlas' sources stay out of LMCache's interpreter
    return env


class Process:
    """One child started by the one launcher, with its log file; `stop` signals only its
    pid (SIGTERM, or the signal given, then SIGKILL)."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        log_dir: Path,
        env: dict[str, str],
        *,
        http_port: int = 0,
        pipes: bool = False,
    ) -> None:
        self.name = name
        self.log = log_dir / f"{name}.log"
        self.launched: Proc = launch(
            argv, name=name, log=self.log, env=env, http_port=http_port, wait=False, pipes=pipes
        )
        self.proc = self.launched.popen

    def stop(self, sig: int = signal.SIGTERM) -> int | None:
        return self.launched.stop(sig)

    def pause(self) -> None:
        """SIGSTOP: the process stays alive but sends nothing (heartbeats stop)."""
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def log_text(self) -> str:
        return self.launched.text()


class KvatlasCoordinator(Process):
    def __init__(self, log_dir: Path, *flags: str) -> None:
        (self.port,) = free_ports(1)
        self.url = f"http://{HOST}:{self.port}"
        super().__init__(
            "kvatlas-coordinator",
            [
                sys.executable,
                "-m",
                "kvatlas.cli.coordinator",
                "--host",
                HOST,
                "--port",
                str(self.port),
                "--snapshot-interval",
                "0",
                *flags,
            ],
            log_dir,
            {**os.environ, "PYTHONPATH": str(ROOT / "src")},
            http_port=self.port,
        )
        self.http = httpx.Client(base_url=self.url, timeout=10)

    def wait(self) -> None:
        self.launched.wait_http("/healthz")

    def stop(self, sig: int = signal.SIGTERM) -> int | None:
        self.http.close()
        return super().stop(sig)


class LMCacheCoordinator(Process):
    def __init__(self, log_dir: Path, venv: Path, *flags: str) -> None:
        (self.port,) = free_ports(1)
        self.url = f"http://{HOST}:{self.port}"
        super().__init__(
            "lmcache-coordinator",
            [
                str(venv / "bin" / "lmcache"),
                "coordinator",
                "--host",
                HOST,
                "--port",
                str(self.port),
                "--disable-metrics",
                *flags,
            ],
            log_dir,
            lmcache_env(venv),
            http_port=self.port,
        )
        self.http = httpx.Client(base_url=self.url, timeout=10)

    def wait(self) -> None:
        self.launched.wait_http("/instances", timeout=60)

    def stop(self, sig: int = signal.SIGINT) -> int | None:
        self.http.close()
        return super().stop(sig)


class LMCacheServer(Process):
    """`lmcache server` on the CPU: an L1 of ``l1_gb`` GiB, events flushed every 0.2 s,
    heartbeats (and, with P2P, peer polls) every second; with ``l2_gb`` an L2 of that
    size (LMCache's ``mock`` adapter, in memory). With NIXL P2P the L1's byte
    size must be a multiple of its 4 KiB alignment (LMCache registers it page by page;
    otherwise it fails at startup with NIXL_ERR_NOT_FOUND)."""

    def __init__(
        self,
        log_dir: Path,
        venv: Path,
        instance_id: str,
        coordinator_url: str,
        *,
        l1_gb: float = 0.0625,
        p2p: bool = False,
        l2_gb: float = 0.0,
    ) -> None:
        self.instance_id = instance_id
        self.port, self.http_port, p2p_port = free_ports(3)
        self.rpc_url = f"tcp://{HOST}:{self.port}"
        self.http_url = f"http://{HOST}:{self.http_port}"
        self.p2p_url = f"{HOST}:{p2p_port}" if p2p else ""
        argv = [
            str(venv / "bin" / "lmcache"),
            "server",
            "--instance-id",
            instance_id,
            "--host",
            HOST,
            "--port",
            str(self.port),
            "--http-host",
            HOST,
            "--http-port",
            str(self.http_port),
            "--chunk-size",
            str(CHUNK),
            "--l1-size-gb",
            str(l1_gb),
            "--no-l1-use-lazy",
            "--eviction-policy",
            "LRU",
            "--coordinator-url",
            coordinator_url,
            "--coordinator-advertise-ip",
            HOST,
            "--coordinator-heartbeat-interval",
            "1",
            "--coordinator-event-reporting",
            "--coordinator-event-flush-interval",
            "0.2",
        ]
        if p2p:
            argv += ["--p2p-advertise-url", self.p2p_url, "--p2p-transfer-engine", "nixl"]
        if l2_gb:  # LMCache's in-memory L2 adapter (its "fs" one is not built here)
            l2 = {"type": "mock", "max_size_gb": l2_gb, "mock_bandwidth_gb": 10.0}
            argv += ["--l2-adapter", json.dumps(l2)]
        super().__init__(
            f"lmcache-server-{instance_id}",
            argv,
            log_dir,
            lmcache_env(venv, NIXL_ON_LOOPBACK if p2p else None),
            http_port=self.http_port,
        )

    def wait(self) -> None:
        self.launched.wait_http("/healthcheck", timeout=90)

    def stop(self, sig: int = signal.SIGINT) -> int | None:
        """SIGINT: LMCache's server stops cleanly on it (and deregisters); SIGTERM kills
        it before its shutdown runs."""
        return super().stop(sig)


class Engine(Process):
    """The stand-in engine of one server (`lmcache_driver.py`), spoken to over pipes."""

    def __init__(self, log_dir: Path, venv: Path, server: LMCacheServer) -> None:
        super().__init__(
            f"engine-{server.instance_id}",
            [str(venv / "bin" / "python"), str(DRIVER), server.rpc_url, server.http_url],
            log_dir,
            lmcache_env(venv),
            pipes=True,
        )
        self._ready = False

    def call(self, op: str, tokens: list[int] | None = None, **extra: Any) -> dict[str, Any]:
        if not self._ready:
            self._read()  # the driver announces itself once its KV is registered
            self._ready = True
        assert self.proc.stdin is not None
        line = json.dumps({"op": op, "tokens": tokens or [], **extra}) + "\n"
        self.proc.stdin.write(line)
        self.proc.stdin.flush()
        return self._read()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name} exited:\n{self.log_text()[-3000:]}")
        out: dict[str, Any] = json.loads(line)
        return out

    def stop(self, sig: int = signal.SIGTERM) -> int | None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            try:
                self.proc.stdin.write('{"op": "quit"}\n')
                self.proc.stdin.close()
                self.proc.wait(20)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                pass
        return super().stop(sig)


class Exchange(NamedTuple):
    """One call an LMCache server made through the `Tee`, and both answers."""

    method: str
    path: str
    body: bytes
    kv_status: int
    kv_answer: bytes
    lm_status: int
    lm_answer: bytes

    def json(self) -> tuple[Any, Any, Any]:
        """(what LMCache sent, what kvatlas answered, what LMCache's coordinator answered)."""
        return tuple(
            json.loads(b) if b else None for b in (self.body, self.kv_answer, self.lm_answer)
        )  # type: ignore[return-value]


class Tee:
    """An HTTP front on 127.0.0.1 that sends every request an LMCache server makes to
    kvatlas' coordinator (whose answer the server gets) and then to LMCache's own, and
    records both answers: the two coordinators receive the very same calls, in the same
    order, so their answers can be compared call by call."""

    def __init__(self, kvatlas_url: str, lmcache_url: str) -> None:
        self.exchanges: list[Exchange] = []
        lock = threading.Lock()
        kv = httpx.Client(base_url=kvatlas_url, timeout=10)
        lm = httpx.Client(base_url=lmcache_url, timeout=10)
        record = self.exchanges

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _forward(self) -> None:
                n = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(n) if n else b""
                headers = {"content-type": self.headers.get("content-type", "application/json")}
                with lock:  # one call at a time, in the same order at both
                    a = kv.request(self.command, self.path, content=body, headers=headers)
                    b = lm.request(self.command, self.path, content=body, headers=headers)
                    record.append(
                        Exchange(
                            self.command,
                            self.path,
                            body,
                            a.status_code,
                            a.content,
                            b.status_code,
                            b.content,
                        )
                    )
                self.send_response(a.status_code)
                self.send_header("content-type", a.headers.get("content-type", "application/json"))
                self.send_header("content-length", str(len(a.content)))
                self.end_headers()
                self.wfile.write(a.content)

            do_GET = do_POST = do_PUT = do_DELETE = _forward  # noqa: N815 (http.server names)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer((HOST, 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://{HOST}:{self._server.server_address[1]}"
        self._clients = (kv, lm)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def calls(self, method: str, path_prefix: str) -> list[Exchange]:
        return [
            e for e in list(self.exchanges) if e.method == method and e.path.startswith(path_prefix)
        ]

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        for c in self._clients:
            c.close()


def prompt(first: int, chunks: int) -> list[int]:
    """``chunks`` full chunks of distinct tokens, plus the one token never cached."""
    return list(range(first, first + chunks * CHUNK + 1))
