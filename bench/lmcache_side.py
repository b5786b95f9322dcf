"""The processes of the side-by-side benchmark: `lmcache server` (LMCache 0.5.6, from
.venv-lmcache) and `kvatlas server`, started with the same flags, and the coordinators of
their P2P fleets (`lmcache coordinator` for LMCache, as in LMCache's P2P guide;
`kvatlas coordinator` for kvatlas).

Owns their argv, ports (free ports on 127.0.0.1), log files, what answers once they are
up, how they are stopped (SIGINT, LMCache's clean stop, then SIGKILL after 20 s: by pid,
through the one launcher, ``kvatlas.launch.procs``), and removing the engine-driven
SHM pool a stopped server left behind (only the pool names this process chose). Must
not: signal a process it did not start, bind anything but 127.0.0.1.

A server that exits while starting, or does not answer in time, is a `Refused` with the
tail of its log: the benchmark reports it for that target and carries on.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvatlas.launch import procs as launch
from kvatlas.launch.procs import HOST, free_ports

ROOT = Path(__file__).resolve().parents[1]
LMCACHE_VENV = Path(os.environ.get("KVATLAS_LMCACHE_VENV", ROOT / ".venv-lmcache"))
QUIET = {"LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1", "LMCACHE_DISABLE_BANNER": "1"}
LINKS = ("wire", "same_host")
"""How the P2P fleets' peers read each other's KV, each target with its own transport:

- ``wire``: what crosses hosts. LMCache's NIXL with UCX on TCP only (``UCX_TLS=tcp``,
  on loopback), kvatlas' ``tcp``.
- ``same_host``: the shortcut for peers on one host. LMCache's NIXL with UCX free to
  pick cross-memory attach as well (``tcp,cma``: UCX takes CMA, one ``process_vm_readv``
  copy by the reader), kvatlas' ``shm`` (the reader maps the owner's region read-only
  and copies).
"""
NIXL_UCX = {
    "wire": {"UCX_NET_DEVICES": "lo", "UCX_TLS": "tcp,self"},
    "same_host": {"UCX_NET_DEVICES": "lo", "UCX_TLS": "tcp,cma,self"},
}
"""LMCache's NIXL P2P environment per link: UCX on the loopback device."""
KVATLAS_TRANSPORT = {"wire": "tcp", "same_host": "shm"}
"""kvatlas' ``--p2p-transfer-engine`` per link."""
TARGETS = ("lmcache", "kvatlas")
START_TIMEOUT_S = 120.0


class Refused(Exception):
    """A process did not come up: it exited, or did not answer in time."""


def lmcache_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {**os.environ, **QUIET, **(extra or {})}
    env["PATH"] = f"{LMCACHE_VENV / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env.pop("PYTHONPATH", None)  # kvatlas' sources stay out of LMCache's interpreter
    return env


def kvatlas_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT / "src"), env.get("PYTHONPATH", "")) if p
    )
    return env


def tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its live descendants (0 once gone)."""
    tick = os.sysconf("SC_CLK_TCK")
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
            for task in Path(f"/proc/{p}/task").iterdir():
                todo.extend(int(k) for k in (task / "children").read_text().split())
        except (OSError, ValueError, IndexError):
            continue
    return total


@dataclass(eq=False, kw_only=True)
class Proc(launch.Proc):
    """One child process of the benchmark (the one launcher's), with how it is stopped and
    what it answers when it is up."""

    health_urls: tuple[str, ...]
    """Up once any of these answers 200."""
    stop_signal: int = signal.SIGINT
    shm_pools: tuple[str, ...] = ()

    def last_lines(self, lines: int = 4) -> str:
        """The last ``lines`` non-empty lines of its log (where a CLI says why it quit)."""
        return "\n".join([ln for ln in self.text().splitlines() if ln.strip()][-lines:])

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        """Until one of ``health_urls`` answers 200; `Refused` when it exits first or
        does not answer in ``timeout`` seconds."""

        def up() -> bool:
            return any(_answers(url) for url in self.health_urls)

        try:
            self.wait_until(up, f"answering {self.health_urls}", timeout)
        except launch.ProcessError:
            raise Refused(
                f"{self.name} exited with {self.returncode} or did not answer"
                f" {self.health_urls} in {timeout:.0f} s:\n{self.last_lines()}"
            ) from None

    def stop(self, sig: int | None = None, grace_s: float = 20.0) -> int | None:
        """``stop_signal`` (unless ``sig``), SIGKILL after ``grace_s``; then the SHM pools
        this process named, which a killed server leaves behind."""
        code = super().stop(self.stop_signal if sig is None else sig, grace_s)
        for pool in self.shm_pools:
            with contextlib.suppress(OSError):
                Path("/dev/shm", pool).unlink()
        return code


def _answers(url: str) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(url, timeout=1.0).status_code == 200
    return False


@dataclass(frozen=True)
class ServerSpec:
    """One cache server's flags: the same for `lmcache server` and `kvatlas server`
    (`lmcache_cpu_flags` adds what LMCache needs for the CPU transfer modes)."""

    instance_id: str
    l1_gb: float
    coordinator_url: str = ""
    p2p: bool = False
    link: str = "wire"
    """With ``p2p``: the transport kind (``LINKS``), which each target spells its own way."""
    warm_restart: bool = False
    """kvatlas only: keep its L1 for a warm restart (under a state dir in the log dir).
    Off by default, so that each run starts cold, as LMCache's server does."""

    def flags(self, port: int, http_port: int, p2p_port: int) -> list[str]:
        """LMCache's P2P guide's `lmcache server` flags, which `kvatlas server` takes as
        they are (the L1 size and the ports are the benchmark's)."""
        flags = [
            "--instance-id", self.instance_id,
            "--host", HOST, "--port", str(port), "--http-port", str(http_port),
            "--l1-size-gb", f"{self.l1_gb:g}", "--eviction-policy", "LRU",
            "--l1-align-bytes", "65536",
        ]  # fmt: skip
        if self.coordinator_url:
            flags += [
                "--coordinator-url", self.coordinator_url,
                "--coordinator-advertise-ip", HOST,
                "--coordinator-heartbeat-interval", "1",
            ]  # fmt: skip
        if self.p2p:
            flags += ["--p2p-advertise-url", f"{HOST}:{p2p_port}"]
        return flags


def lmcache_cpu_flags(shm_name: str) -> list[str]:
    """What `lmcache server` needs besides for both CPU transfer modes: engine-driven
    transfer next to its default lmcache-driven one (``--supported-transfer-mode auto``)
    and a shared-memory pool for it (``--shm-name``, which needs an L1 allocated up
    front: ``--no-l1-use-lazy``; without a pool its clients pickle KV over ZeroMQ).
    `kvatlas server` needs none of them: it serves both modes, and its L1 region is
    always the shared-memory pool, allocated up front."""
    return ["--supported-transfer-mode", "auto", "--shm-name", shm_name, "--no-l1-use-lazy"]


@dataclass
class Server:
    target: str
    spec: ServerSpec
    proc: Proc
    rpc_url: str
    http_url: str


def start_server(target: str, spec: ServerSpec, log_dir: Path) -> Server:
    """`lmcache server` or `kvatlas server` with ``spec``'s flags, started (not waited)."""
    port, http_port, p2p_port = free_ports(3)
    shm_name = f"kvb{os.getpid()}{spec.instance_id}"
    flags = spec.flags(port, http_port, p2p_port)
    http_url = f"http://{HOST}:{http_port}"
    if target == "lmcache":
        argv = [str(LMCACHE_VENV / "bin" / "lmcache"), "server", *flags]
        argv += lmcache_cpu_flags(shm_name)
        env = lmcache_env(NIXL_UCX[spec.link] if spec.p2p else None)
        stop_sig = signal.SIGINT  # SIGINT: LMCache's clean stop (it deregisters)
    else:
        argv = [sys.executable, "-m", "kvatlas.cli.server", *flags]
        argv += ["--state-dir", str(log_dir / f"state-{spec.instance_id}")]
        if not spec.warm_restart:
            argv.append("--no-l1-warm-restart")
        if spec.p2p:
            argv += ["--p2p-transfer-engine", KVATLAS_TRANSPORT[spec.link]]
        env = kvatlas_env()
        stop_sig = signal.SIGTERM
    proc = Proc(
        name=f"{target}-server-{spec.instance_id}",
        argv=argv,
        env=env,
        cwd=ROOT,
        log=log_dir / f"{target}-server-{spec.instance_id}.log",
        health_urls=(f"{http_url}/healthcheck", f"{http_url}/healthz"),
        stop_signal=stop_sig,
        shm_pools=(shm_name, f"lmcache_l1_pool_{shm_name}"),
    )
    proc.start()
    return Server(target, spec, proc, f"tcp://{HOST}:{port}", http_url)


def start_coordinator(target: str, log_dir: Path) -> tuple[Proc, str]:
    (port,) = free_ports(1)
    url = f"http://{HOST}:{port}"
    if target == "lmcache":
        argv = [str(LMCACHE_VENV / "bin" / "lmcache"), "coordinator", "--host", HOST,
                "--port", str(port), "--disable-metrics"]  # fmt: skip
        proc = Proc(name=f"{target}-coordinator", argv=argv, env=lmcache_env(), cwd=ROOT,
                    log=log_dir / f"{target}-coordinator.log",
                    health_urls=(f"{url}/instances",))  # fmt: skip
    else:
        argv = [sys.executable, "-m", "kvatlas.cli.coordinator", "--host", HOST,
                "--port", str(port), "--snapshot-interval-s", "0"]  # fmt: skip
        proc = Proc(name=f"{target}-coordinator", argv=argv, env=kvatlas_env(), cwd=ROOT,
                    log=log_dir / f"{target}-coordinator.log",
                    health_urls=(f"{url}/healthz",), stop_signal=signal.SIGTERM)  # fmt: skip
    proc.start()
    return proc, url


def p2p_peer_counts(servers: list[Server]) -> list[int]:
    """Each server's connected peers by its `/status` (``p2p_peer_count`` where it says
    so, LMCache's field; -1 where its status does not tell)."""
    counts = []
    for s in servers:
        try:
            status = httpx.get(f"{s.http_url}/status", timeout=2).json()
        except (httpx.HTTPError, ValueError):
            counts.append(0)
            continue
        found = _find(status, "p2p_peer_count", -1)
        counts.append(found if isinstance(found, int) else -1)
    return counts


def _find(obj: object, key: str, default: object) -> object:
    if isinstance(obj, dict):
        if key in obj:
            return obj[key]
        obj = list(obj.values())
    if isinstance(obj, list):
        for item in obj:
            got = _find(item, key, None)
            if got is not None:
                return got
    return default
