"""kvatlas processes for the tests: a coordinator and a cache server started through their
real CLIs (``python -m kvatlas.cli.<command>``) by the one launcher, on 127.0.0.1.

Owns the flags every test needs to reach them (host, ports, instance id, state folder) and
what a test reads of a running server (``/status``, ``/metrics``). Each suite adds the
flags of its own setup (chunk size, L1 size, P2P, ...). Must not: decide those for the
suites, or start anything but through ``launch``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, overload

import httpx
import msgspec

from kvatlas.launch.procs import HOST, free_port, free_ports
from kvatlas.wire.directory_api import LookupRequest, LookupResponse
from support.launch import P, Proc, launch, python_module


@overload
def start_coordinator_process(
    *flags: str,
    log: Path | None = None,
    port: int = 0,
    env: dict[str, str] | None = None,
    wait: bool = True,
) -> Proc: ...


@overload
def start_coordinator_process(
    *flags: str,
    log: Path | None = None,
    port: int = 0,
    env: dict[str, str] | None = None,
    wait: bool = True,
    cls: type[P],
) -> P: ...


def start_coordinator_process(
    *flags: str,
    log: Path | None = None,
    port: int = 0,
    env: dict[str, str] | None = None,
    wait: bool = True,
    cls: type[Proc] = Proc,
) -> Proc:
    """``kvatlas coordinator`` on ``port`` (a free one when 0), answering ``/healthz``
    (unless ``wait`` is False); a ``cls`` (a Proc) of it. ``env``: its whole environment."""
    port = port or free_port()
    argv = python_module("kvatlas.cli.coordinator", "--host", HOST, "--port", str(port), *flags)
    return launch(
        argv, name=f"coordinator-{port}", log=log, env=env, http_port=port, wait=wait, cls=cls
    )


@dataclass(eq=False, kw_only=True)
class ServerProc(Proc):
    """A ``kvatlas server`` process: engine API on ``port``, HTTP on ``http_port`` (the
    names of its flags)."""

    instance_id: str
    port: int

    @property
    def engine_url(self) -> str:
        return f"tcp://{HOST}:{self.port}"

    def status(self) -> dict[str, Any]:
        r = httpx.get(f"{self.url}/status", timeout=5)
        assert r.status_code == 200, r.text
        return dict(r.json())

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=5).text


def start_server_process(
    workdir: Path,
    instance_id: str,
    *flags: str,
    port: int = 0,
    http_port: int = 0,
    wait: bool = True,
    timeout: float = 30.0,
    cls: type[ServerProc] = ServerProc,
    **fields: Any,
) -> ServerProc:
    """``kvatlas server`` with its log and state folder in ``workdir``; free ports unless
    given; returns once ``/healthz`` answers (unless ``wait`` is False)."""
    if not port and not http_port:
        port, http_port = free_ports(2)
    elif not http_port:
        http_port = _other_free_port(port)
    elif not port:
        port = _other_free_port(http_port)
    argv = python_module(
        "kvatlas.cli.server",
        "--host", HOST, "--port", str(port), "--http-port", str(http_port),
        "--instance-id", instance_id, "--state-dir", str(workdir / "state"),
        *flags,
    )  # fmt: skip
    return launch(
        argv,
        name=instance_id,
        log=workdir / f"{instance_id}-{port}.log",
        http_port=http_port,
        wait=wait,
        timeout=timeout,
        cls=cls,
        instance_id=instance_id,
        port=port,
        **fields,
    )


def held_prefix(coordinator: Proc, tokens: list[int], iid: str, model: str) -> int:
    """How many leading chunks of ``tokens`` the coordinator says ``iid`` holds."""
    req = LookupRequest(token_ids=tokens, model_name=model)
    r = httpx.post(
        coordinator.url + "/directory/lookup", content=msgspec.json.encode(req), timeout=5
    )
    assert r.status_code == 200, r.text
    resp = msgspec.json.decode(r.content, type=LookupResponse)
    return max((h.chunks for h in resp.prefix_holders if h.instance_id == iid), default=0)


def _other_free_port(taken: int) -> int:
    """A free port that is not ``taken`` (a port the caller chose but has not bound yet,
    which the OS could hand out again): of two distinct free ports, one differs."""
    return next(p for p in free_ports(2) if p != taken)
