"""Fixtures of the router's tests: a real fleet on loopback (a coordinator and two cache
servers as processes, two reference engines on the tiny random model in this process,
each registered with its node's server, which advertises it), the same with P2P between
the servers, and routers in front; and ``route``, the one reading of the route header.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported

import re
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx
import pytest

from kvatlas.engine.config import CacheLinkConfig, EngineConfig
from kvatlas.engine.engine_app import EngineApp
from kvatlas.engine.model import LoadedModel, load_model
from kvatlas.launch.procs import HOST, free_port
from kvatlas.router.app import RouterApp
from kvatlas.router.config import RouterConfig
from kvatlas.router.service import ROUTE_HEADER, LocalTokenizer
from support.launch import Proc, launch, python_module
from support.services import ServerProc, start_coordinator_process, start_server_process

MAX_MODEL_LEN = 2048


def route(answer: httpx.Response | httpx.Headers) -> dict[str, str]:
    """An answer's ``X-Kvatlas-Route`` header as a dict: engine, cached, reason,
    overhead_ms. Its parts are ``name=value`` joined by ``"; "``; a part with no ``=``
    belongs to the value before it (a retried request's reason ends ``"; retry"``:
    ``reason=kv: prefix; retry``)."""
    headers = answer.headers if isinstance(answer, httpx.Response) else answer
    out: dict[str, str] = {}
    last = ""
    for part in headers[ROUTE_HEADER].split("; "):
        name, sep, value = part.partition("=")
        if sep:
            out[name] = value
            last = name
        else:
            assert last, f"a route header that does not begin with name=value: {part!r}"
            out[last] += f"; {part}"
    return out


def retried(answer: httpx.Response | httpx.Headers) -> bool:
    """Whether the router sent the request elsewhere after an engine failed it."""
    return route(answer)["reason"].endswith("; retry")


@pytest.fixture(scope="session")
def tiny() -> LoadedModel:
    return load_model("tiny-random")


@pytest.fixture(scope="session")
def smol(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """SmolLM2, converted from its GGUF once into pytest's cache folder (the folder the
    engine suite's fixture uses: either suite's first run pays the slow GGUF parse)."""
    cache = getattr(request.config, "cache", None)
    folder = (
        Path(cache.mkdir("kvatlas-models"))
        if cache is not None
        else tmp_path_factory.mktemp("kvatlas-models")
    )
    return load_model("smollm2-135m", conversion_cache=folder)


def engine_config(**kw: object) -> EngineConfig:
    base = EngineConfig(
        model="tiny-random", port=0, cache=None, max_model_len=MAX_MODEL_LEN, default_max_tokens=4
    )
    return replace(base, **kw)  # type: ignore[arg-type]


def metric_value(url: str, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples at ``url``/metrics whose labels include ``labels``."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    total = 0.0
    for m in re.finditer(rf"^{name}(?:\{{([^}}]*)\}})? (\S+)$", text, re.M):
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(m.group(2))
    return total


@contextmanager
def engine_process(log: Path, *extra: str) -> Iterator[Proc]:
    """A tiny-random reference engine in a process of its own, to freeze with SIGSTOP;
    always resumed before it is stopped."""
    port = free_port()
    argv = python_module(
        "kvatlas.cli.engine", "--model", "tiny-random", "--port", str(port), "--no-cache",
        "--num-threads", "1", *extra,
    )  # fmt: skip
    # a generous start: torch's import alone takes a minute on a loaded 2-core machine
    with launch(argv, name=log.stem, log=log, http_port=port, timeout=300) as p:
        try:
            yield p
        finally:
            os.kill(p.pid, signal.SIGCONT)


@contextmanager
def engine_in_process(model: LoadedModel, **config: object) -> Iterator[EngineApp]:
    """A reference engine on ``model`` in this process (`engine_config` with ``config``)."""
    app = EngineApp(engine_config(**config), model=model)
    app.start()
    try:
        yield app
    finally:
        app.stop()


@dataclass
class Fleet:
    coordinator: Proc
    servers: list[ServerProc]
    engines: list[EngineApp]
    routers: list[RouterApp] = field(default_factory=list)

    def router(self, *, tokenizer: LocalTokenizer | None = None, **kw: object) -> RouterApp:
        """A started router in front of this fleet (stopped with the fleet)."""
        fields: dict[str, object] = {
            "port": 0,
            "coordinator_urls": (self.coordinator.url,),
            "refresh_interval_s": 0.2,
            "health_interval_s": 0.2,
            "lookup_timeout_s": 2.0,
            "seed": 1,
            "expose_route_header": True,
        }
        fields.update(kw)
        app = RouterApp(RouterConfig(**fields), tokenizer=tokenizer)  # type: ignore[arg-type]
        app.start()
        self.routers.append(app)
        return app


@contextmanager
def _fleet(tmp: Path, tiny: LoadedModel, *, p2p: bool) -> Iterator[Fleet]:
    coordinator = start_coordinator_process(log=tmp / "coordinator.log")
    fleet = Fleet(coordinator, [], [])
    servers, engines = fleet.servers, fleet.engines
    try:
        for name in ("node-a", "node-b"):
            flags = [
                "--coordinator-url", coordinator.url, "--coordinator-heartbeat-interval",
                "0.5", "--event-flush-interval", "0.05", "--l1-size-gb", "0.05",
                "--engine-workers", "2",
            ]  # fmt: skip
            if p2p:
                flags += [
                    "--p2p-advertise-url", f"{HOST}:{free_port()}",
                    "--p2p-transfer-engine", "tcp",
                ]  # fmt: skip
            servers.append(start_server_process(tmp, name, *flags))
        for server in servers:
            app = EngineApp(engine_config(cache=CacheLinkConfig(port=server.port)), model=tiny)
            app.start()
            engines.append(app)
        yield fleet
    finally:
        for r in fleet.routers:
            r.stop()
        for e in engines:
            e.stop()
        for s in servers:
            s.stop()
        coordinator.stop()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, tiny: LoadedModel) -> Iterator[Fleet]:
    with _fleet(tmp_path_factory.mktemp("router-fleet"), tiny, p2p=False) as f:
        yield f


@pytest.fixture(scope="module")
def p2p_fleet(tmp_path_factory: pytest.TempPathFactory, tiny: LoadedModel) -> Iterator[Fleet]:
    """The same fleet with P2P between the two servers (tcp transport)."""
    with _fleet(tmp_path_factory.mktemp("router-p2p-fleet"), tiny, p2p=True) as f:
        yield f


StartRouter = Callable[..., RouterApp]


@pytest.fixture
def start_router() -> Iterator[StartRouter]:
    """Routers over given engines only (no coordinator); stopped at the end."""
    started: list[RouterApp] = []

    def start(**kw: object) -> RouterApp:
        fields: dict[str, object] = {
            "port": 0,
            "health_interval_s": 0.2,
            "seed": 1,
            "expose_route_header": True,
        }
        fields.update(kw)
        app = RouterApp(RouterConfig(**fields))  # type: ignore[arg-type]
        app.start()
        started.append(app)
        return app

    yield start
    for app in started:
        app.stop()
