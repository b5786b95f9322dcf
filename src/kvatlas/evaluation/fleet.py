"""A loopback fleet of real processes: one coordinator and N cache servers.

Owns starting, killing, restarting and stopping the processes of an evaluation run (each
one through its real CLI, ``python -m kvatlas.cli.coordinator`` / ``kvatlas.cli.server``),
their ports (free ports on 127.0.0.1, chosen up front so that a restarted process comes
back at the same address), their log files and temporary directories, and the read-only
probes of their state, typed: each server's ``/status`` as a `ServerStatus`, and the
coordinator's instances, directory stats and lookups through one `CoordinatorClient`.

Safety: only 127.0.0.1 is used; every process is started, awaited and stopped by the one
launcher (``kvatlas.launch.procs``: by pid, SIGTERM, then SIGKILL after a grace
period; on Linux the children get SIGKILL if this process dies without cleaning up);
``close`` stops every process this object started and removes its temporary directory,
and it runs on errors and Ctrl-C through the context manager. Must not: signal any
process it did not start.

Exceptions: ``kvatlas.launch.procs.ProcessError`` when a process did not come up, or
exited early (its log tail attached).
"""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Final, Self

import httpx
import msgspec

from kvatlas.launch.procs import HOST, Proc, ProcessError, free_ports
from kvatlas.runtime.coordinator_client import CoordinatorClient, CoordinatorError
from kvatlas.server.storage.l1_journal import discard_kept, kept_region_name
from kvatlas.wire.coordinator_views import StatsResponse
from kvatlas.wire.directory_api import LookupRequest, LookupResponse
from kvatlas.wire.instances_api import InstanceWire
from kvatlas.wire.kafka_records import DEFAULT_TOPIC
from kvatlas.wire.server_status import ServerStatus, decode_status

PROBE_TIMEOUT_S = 3.0
"""Bound of each probe of a process's state."""
ENGINE_MODEL = "smollm2-135m"
"""The reference engine's model in every evaluation with engines."""


@dataclass(frozen=True, slots=True)
class FleetConfig:
    """How the fleet's processes are started."""

    nodes: int = 4
    """Cache servers."""
    chunk_size: int = 256
    """Tokens per chunk (coordinator and servers)."""
    l1_size_mb: float = 48.0
    """L1 region of each server in MiB (small enough that LRU eviction happens)."""
    heartbeat_interval_s: float = 1.0
    """Servers' heartbeat interval."""
    instance_timeout_s: float = 3.0
    """Coordinator's instance timeout (a silent server is expired and fenced after it)."""
    health_check_interval_s: float = 0.5
    """Coordinator's expiry sweep interval."""
    event_flush_interval_s: float = 0.2
    """Servers' event flush interval."""
    event_buffer_batches: int = 4096
    """Servers' publisher buffer (an outage shorter than this loses no events)."""
    p2p: bool = True
    """Start the servers with P2P (``--p2p-advertise-url``) when the flags exist."""
    p2p_transfer_engine: str = "tcp"
    """``--p2p-transfer-engine``."""
    p2p_lookup_timeout_s: float = 0.5
    """``--p2p-lookup-timeout-s``."""
    p2p_load_timeout_s: float = 2.0
    """``--p2p-load-timeout-s``."""
    engine_workers: int = 2
    """Engine API threads per server (the machine may have few cores)."""
    snapshot: bool = True
    """Give the coordinator a snapshot file (needed to restart it with its state)."""
    start_timeout_s: float = 60.0
    """How long a process may take to answer /healthz."""
    log_level: str = "WARNING"
    """Log level of the processes (logs go to files in the work dir)."""
    coordinators: int = 1
    """Coordinator replicas; the servers get every URL, the first preferred. More than one
    needs ``kafka_bootstrap`` (replicas share the directory only through the log)."""
    kafka_bootstrap: str = ""
    """A Kafka broker's address: coordinators and servers then carry events and
    membership through its topic ``kafka_topic`` (empty: HTTP only)."""
    kafka_topic: str = DEFAULT_TOPIC
    """The topic, when ``kafka_bootstrap`` is set."""
    server_args: tuple[tuple[str, ...], ...] = ()
    """More flags for server ``i`` (``server_args[i]``; servers past the end get none):
    a benchmark's fault injection on one node, say."""


@dataclass(eq=False)
class ServerProc(Proc):
    """A cache server of the fleet: its instance id and its other two ports."""

    instance_id: str = ""
    engine_port: int = 0
    p2p_port: int = 0

    @property
    def engine_url(self) -> str:
        return f"tcp://{HOST}:{self.engine_port}"


_PORT_PICKS: Final = 100
"""Rounds of ``free_ports`` a fleet tries for ports it has not handed out yet."""


class Fleet:
    """Start, probe, kill, restart and stop a coordinator and N servers on loopback."""

    def __init__(self, cfg: FleetConfig, *, workdir: Path | None = None) -> None:
        self.cfg = cfg
        self._own_dir = workdir is None
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix="kvatlas-fleet-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.p2p = cfg.p2p
        self._http = httpx.Client(timeout=PROBE_TIMEOUT_S)
        self._handed: set[int] = set()
        """Every port this fleet has handed to a process (``_free_ports``)."""
        if cfg.coordinators > 1 and not cfg.kafka_bootstrap:
            raise ValueError("coordinator replicas need kafka_bootstrap (a shared log)")
        self.coordinators = [self._coordinator_proc(i) for i in range(cfg.coordinators)]
        """The replicas, in the servers' order of preference."""
        self.coordinator = self.coordinators[0]
        self.coordinator_client = CoordinatorClient(
            [c.url for c in self.coordinators], timeout_s=PROBE_TIMEOUT_S
        )
        """The coordinators' API (any replica that answers); it reconnects to a restarted
        coordinator by itself."""
        self.replica_clients = [
            CoordinatorClient(c.url, timeout_s=PROBE_TIMEOUT_S) for c in self.coordinators
        ]
        """One client per replica, for what each replica says by itself."""
        self.servers = [self._server_proc(i) for i in range(cfg.nodes)]
        self.extras: list[Proc] = []
        """Other processes of the run (engines), stopped first by ``close``."""

    @property
    def coordinator_url(self) -> str:
        """Every replica's URL, comma-separated, as ``--coordinator-url`` takes them."""
        return ",".join(c.url for c in self.coordinators)

    def _kafka_args(self) -> list[str]:
        c = self.cfg
        if not c.kafka_bootstrap:
            return []
        return [
            "--event-transport", "kafka", "--kafka-bootstrap-servers", c.kafka_bootstrap,
            "--kafka-topic", c.kafka_topic,
        ]  # fmt: skip

    def _coordinator_proc(self, i: int) -> Proc:
        cfg = self.cfg
        name = "coordinator" if i == 0 else f"coordinator-{i}"
        (port,) = self._free_ports(1)
        snapshot = (
            [
                "--snapshot-path",
                str(self.workdir / f"{name}.snapshot"),
                "--snapshot-interval-s",
                "0",
            ]
            if cfg.snapshot
            else []
        )
        args = [
            "-m", "kvatlas.cli.coordinator", "--host", HOST, "--port", str(port),
            "--instance-timeout-s", str(cfg.instance_timeout_s),
            "--health-check-interval-s", str(cfg.health_check_interval_s),
            "--chunk-size", str(cfg.chunk_size), "--log-level", cfg.log_level, *snapshot,
            *self._kafka_args(),
        ]  # fmt: skip
        return Proc(name, [sys.executable, *args], self.workdir / f"{name}.log", port)

    def _free_ports(self, count: int) -> list[int]:
        """``count`` free ports that this fleet has not handed out before. A picked port
        is released at once and bound only when its process starts, so two separate
        picks (the coordinator's, each server's three) could return the same port, and
        the second process to bind it would exit with its port taken."""
        out: list[int] = []
        for _ in range(_PORT_PICKS):
            fresh = [p for p in free_ports(count - len(out)) if p not in self._handed]
            self._handed.update(fresh)
            out += fresh
            if len(out) == count:
                return out
        raise ProcessError(f"no {count} free ports this fleet has not used in {_PORT_PICKS} picks")

    def _server_proc(self, i: int) -> ServerProc:
        c = self.cfg
        iid = f"node-{i}"
        engine_port, http_port, p2p_port = self._free_ports(3)
        args = [
            "-m", "kvatlas.cli.server", "--host", HOST, "--port", str(engine_port),
            "--http-port", str(http_port), "--instance-id", iid,
            "--chunk-size", str(c.chunk_size), "--l1-size-gb", f"{c.l1_size_mb / 1024:.6f}",
            "--l1-align-bytes", "65536" if self.p2p else "4096",
            "--engine-workers", str(c.engine_workers),
            "--state-dir", str(self.workdir / "state"),
            "--coordinator-url", self.coordinator_url,
            "--coordinator-heartbeat-interval-s", str(c.heartbeat_interval_s),
            "--coordinator-timeout-s", "2.0",
            "--event-flush-interval-s", str(c.event_flush_interval_s),
            "--event-buffer-batches", str(c.event_buffer_batches),
            "--log-level", c.log_level, *self._kafka_args(),
        ]  # fmt: skip
        if self.p2p:
            args += [
                "--p2p-advertise-url", f"{HOST}:{p2p_port}",
                "--p2p-transfer-engine", c.p2p_transfer_engine,
                "--p2p-lookup-timeout-s", str(c.p2p_lookup_timeout_s),
                "--p2p-load-timeout-s", str(c.p2p_load_timeout_s),
            ]  # fmt: skip
        if i < len(c.server_args):
            args += c.server_args[i]
        return ServerProc(
            iid,
            [sys.executable, *args],
            self.workdir / f"{iid}.log",
            http_port,
            instance_id=iid,
            engine_port=engine_port,
            p2p_port=p2p_port if self.p2p else 0,
        )

    # ------------------------------------------------------------------ lifecycle

    def _wait_healthy(self, proc: Proc) -> None:
        """Until ``proc`` answers /healthz (`ProcessError` at once if it exits)."""
        proc.wait_http("/healthz", self.cfg.start_timeout_s)

    def start(self, on_progress: Callable[[str], None] | None = None) -> None:
        """Start the coordinator, then every server; wait until all are registered."""
        say = on_progress or (lambda _m: None)
        for i in range(len(self.coordinators)):
            self.start_coordinator(i)
        say(f"coordinator up at {self.coordinator_url}")
        for s in self.servers:
            s.start()
        for s in self.servers:
            self._wait_healthy(s)
        self.wait_registered([s.instance_id for s in self.servers])
        say(f"{len(self.servers)} cache servers registered (P2P {'on' if self.p2p else 'off'})")

    def start_coordinator(self, i: int = 0) -> None:
        """(Re)start replica ``i`` at its address; wait until it says it is ready."""
        proc, client = self.coordinators[i], self.replica_clients[i]
        proc.start()
        proc.wait_until(
            lambda: client.ready(timeout_s=0.5).ready,
            "/readyz",
            self.cfg.start_timeout_s,
            ignore=(CoordinatorError,),
        )

    def start_server(
        self, i: int, *, new_ports: bool = True, extra_args: tuple[str, ...] = ()
    ) -> None:
        """(Re)start server ``i`` with its instance id and state dir: a new incarnation.

        With ``new_ports`` it binds fresh ports, as a rescheduled node would; without, it
        comes back at the same addresses (the server binds with SO_REUSEADDR, so the old
        connections in TIME_WAIT after a kill -9 do not hold the ports). ``extra_args``
        are added to the server's flags for this start only (a fault flag, say); they
        need ``new_ports``.
        """
        s = self.servers[i]
        if s.alive():
            raise ProcessError(f"{s.name} is still running")
        if extra_args and not new_ports:
            raise ValueError("extra_args need new_ports: the flags come with a fresh start")
        if new_ports:
            fresh = self._server_proc(i)
            fresh.starts = s.starts
            fresh.argv += list(extra_args)
            self.servers[i] = s = fresh
        s.start()
        self._wait_healthy(s)

    def start_extra(self, name: str, args: list[str], http_port: int, nice: int = 0) -> Proc:
        """Start another process (``python`` + ``args``) that answers /healthz on its port,
        ``nice`` steps below the harness's priority."""
        proc = Proc(
            name, [sys.executable, *args], self.workdir / f"{name}.log", http_port, nice=nice
        )
        self.extras.append(proc)
        proc.start()
        self._wait_healthy(proc)
        return proc

    def start_engines(
        self,
        model: str = ENGINE_MODEL,
        extra_args: tuple[str, ...] = (),
        names: tuple[str, ...] | None = None,
        on_start: Callable[[str, str], None] | None = None,
        nice: int = 0,
    ) -> list[str]:
        """One reference engine in front of each server (``kvatlas.cli.engine`` with the
        fleet's chunk size); waits until each answers /healthz; returns their base URLs.
        ``on_start(name, url)`` is called before each starts (model loading takes time).
        ``nice``: the engines run that many steps below the rest of the fleet's priority
        (a benchmark whose engines' compute would sit on accelerators in a real fleet, so
        that the fleet's other processes do not wait for a CPU behind it)."""
        urls: list[str] = []
        for i, srv in enumerate(self.servers):
            name = names[i] if names else f"engine-{i}"
            (port,) = self._free_ports(1)
            url = f"http://{HOST}:{port}"
            if on_start is not None:
                on_start(name, url)
            args = [
                "-m", "kvatlas.cli.engine", "--model", model, "--host", HOST,
                "--port", str(port), "--cache-host", HOST,
                "--cache-port", str(srv.engine_port), "--chunk-size", str(self.cfg.chunk_size),
                "--log-level", "WARNING", *extra_args,
            ]  # fmt: skip
            self.start_extra(name, args, port, nice=nice)
            urls.append(url)
        return urls

    def start_router(self, policy: str, extra_args: tuple[str, ...] = ()) -> str:
        """``kvatlas router`` in front of the fleet (engines found through the
        coordinator); returns its base URL once it answers /healthz."""
        (port,) = self._free_ports(1)
        args = [
            "-m", "kvatlas.cli.router", "--host", HOST, "--port", str(port),
            "--coordinator-url", self.coordinator_url, "--policy", policy,
            "--expose-route-header", "--log-level", "WARNING", *extra_args,
        ]  # fmt: skip
        self.start_extra("router", args, port)
        return f"http://{HOST}:{port}"

    def wait_router_engines(self, url: str, engines: int, timeout_s: float) -> None:
        """Until the router at ``url`` has ``engines`` engines available (its /readyz)."""
        deadline = time.monotonic() + timeout_s
        seen: object = None
        while time.monotonic() < deadline:
            try:
                seen = httpx.get(f"{url}/readyz", timeout=2).json().get("engines_available")
            except (httpx.HTTPError, ValueError):
                seen = None
            if seen == engines:
                return
            time.sleep(0.2)
        raise ProcessError(f"the router at {url} has {seen} of {engines} engines available")

    def wait_p2p_peers(self, timeout_s: float) -> None:
        """Until every server lists at least one P2P peer (ProcessError after the timeout)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            statuses = [self.server_status(i) for i in range(len(self.servers))]
            if all(st is not None and st.p2p_peer_count >= 1 for st in statuses):
                return
            time.sleep(0.2)
        raise ProcessError("the cache servers did not discover each other as P2P peers")

    def kill(self, proc: Proc) -> None:
        """SIGKILL (no clean shutdown: no deregistration, no snapshot)."""
        proc.kill()

    def freeze(self, proc: Proc) -> None:
        """SIGSTOP: the process keeps its sockets open but answers nothing."""
        proc.freeze()

    def thaw(self, proc: Proc) -> None:
        """SIGCONT after ``freeze``."""
        proc.thaw()

    def stop(self, proc: Proc, grace_s: float = 15.0) -> int | None:
        """SIGTERM, then SIGKILL after ``grace_s``; the exit status (None if never run)."""
        return proc.stop(grace_s=grace_s)

    def close(self) -> dict[str, int | None]:
        """Stop every process (servers first); remove the work dir if this object made it."""
        codes: dict[str, int | None] = {}
        for e in self.extras:
            codes[e.name] = self.stop(e)
        for s in self.servers:
            codes[s.name] = self.stop(s)
            # the L1 region each server kept for a warm restart: this fleet is done with it
            discard_kept(kept_region_name(s.instance_id, self.workdir / "state"))
        for c in self.coordinators:
            codes[c.name] = self.stop(c)
        self._http.close()
        self.coordinator_client.close()
        for client in self.replica_clients:
            client.close()
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)
        return codes

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # ------------------------------------------------------------------ probes

    def server_status(self, i: int) -> ServerStatus | None:
        """Server ``i``'s /status; None when it does not answer (down, restarting)."""
        s = self.servers[i]
        if not s.alive():
            return None
        try:
            r = self._http.get(s.url + "/status", timeout=PROBE_TIMEOUT_S)
        except httpx.HTTPError:
            return None
        if r.status_code != 200:
            return None
        try:
            return decode_status(r.content)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None

    def instances(self) -> list[InstanceWire] | None:
        """The coordinator's live instances; None when it does not answer."""
        try:
            return self.coordinator_client.instances()
        except CoordinatorError:
            return None

    def directory_stats(self) -> StatsResponse | None:
        """The coordinator's directory stats; None when it does not answer."""
        try:
            return self.coordinator_client.directory_stats()
        except CoordinatorError:
            return None

    def lookup(self, request: LookupRequest) -> LookupResponse | None:
        """A directory lookup; None when the coordinator does not answer."""
        try:
            return self.coordinator_client.lookup(request)
        except CoordinatorError:
            return None

    def wait_registered(self, ids: list[str], timeout_s: float = 30.0) -> None:
        """Until ``GET /instances`` lists every id in ``ids``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            inst = self.instances() or []
            if set(ids) <= {i.instance_id for i in inst}:
                return
            time.sleep(0.1)
        raise ProcessError(f"instances {ids} did not all register within {timeout_s}s")


def describe_machine() -> dict[str, str]:
    """CPU model, cores, memory, Python and platform, for the report."""

    cpu = platform.processor() or ""
    mem = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem = f"{int(line.split()[1]) / 1024 / 1024:.1f} GiB"
                break
    return {
        "cpu": cpu,
        "cores": str(os.cpu_count()),
        "memory": mem,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
    }
