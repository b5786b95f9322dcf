"""Composition root of ``kvatlas router``: builds and names every part, serves, stops.

Owns the HTTP edge's routes (the OpenAI paths go to ``RouterService.forward``;
``/healthz``, ``/readyz`` (at least one engine available), ``/metrics`` and ``/status``
(the engine table and the counters) answer here), the gate in front of them
(``auth.RouterGate``: with a token or ``--tenants`` set, all but ``/healthz`` and
``/readyz`` need a credential: the fleet's or operator's token, or a tenant's key),
the coordinator client, and uvicorn on a socket bound before anything starts (a port in
use fails at once, naming the flag).

Must not: parse flags (``kvatlas.cli.router``), or decide routes (``service``).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
import time
from collections.abc import AsyncIterator

import msgspec
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kvatlas.router.auth import RouterGate
from kvatlas.router.config import RouterConfig
from kvatlas.router.service import LocalTokenizer, RouterService
from kvatlas.runtime.asgi_thread import AsgiThread, serve_until_signal
from kvatlas.runtime.coordinator_client import CoordinatorClient

log = logging.getLogger(__name__)

_JSON = "application/json"


class EngineView(msgspec.Struct, frozen=True):
    """One engine in the router's ``/status``."""

    url: str
    instance_id: str
    model_name: str
    available: bool
    healthy: bool
    breaker_open: bool
    in_flight: int
    queued_prefill_tokens: int
    reported_running: int
    requests: int
    errors: int
    breaker_opens: int
    busy_s: float
    last_error: str
    prefill_tokens_per_s: float | None
    """Its measured prefill rate; None until measured."""
    p2p_weight: float
    """Prefill tokens ``kv-p2p`` charges it per token read from a peer: the measured
    P2P cost over its prefill cost, or ``--weight-p2p`` until both are measured."""


class RouterStatus(msgspec.Struct, frozen=True):
    """The router's ``/status``."""

    policy: str
    coordinator_url: str | None
    """The coordinator replica in use; None without a coordinator."""
    routed: int
    failed: int
    engines: list[EngineView]
    p2p_tokens_per_s: float | None
    """The fleet's measured P2P read rate (tokens per second of reading); None until
    measured."""
    tokenizer: str
    """Where prompts are tokenized: ``local: <model>, encoder <what encodes and why>``
    (``--tokenizer``) or ``engine`` (an engine's ``/tokenize``)."""


class RouterApp:
    """Builds the router from a ``RouterConfig``; ``start``/``stop`` or ``run``.
    ``tokenizer`` (``--tokenizer``) comes built: this package may not load a model."""

    def __init__(self, config: RouterConfig, *, tokenizer: LocalTokenizer | None = None) -> None:
        config.validate()
        self.config = config
        self.http = AsgiThread(
            config.host,
            config.port,
            what="the router's HTTP server",
            flag="--host/--port",
            lifespan="on",
            loop="uvloop",
        )
        self.port: int = self.http.port
        self.coordinator = (
            CoordinatorClient(
                config.coordinator_urls,
                auth_token=config.auth_token,
                timeout_s=max(1.0, config.lookup_timeout_s),
                name="router",
            )
            if config.coordinator_urls
            else None
        )
        self.service = RouterService(config, self.coordinator, tokenizer=tokenizer)
        self.app = self._build_app()
        self._stop = threading.Event()

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    def _build_app(self) -> Starlette:
        svc = self.service

        @contextlib.asynccontextmanager
        async def lifespan(_: Starlette) -> AsyncIterator[None]:
            await svc.start()
            try:
                yield
            finally:
                await svc.close()

        return Starlette(
            routes=[
                Route("/v1/chat/completions", svc.forward, methods=["POST"]),
                Route("/v1/completions", svc.forward, methods=["POST"]),
                Route("/v1/models", svc.forward, methods=["GET"]),
                Route("/healthz", self._healthz, methods=["GET"]),
                Route("/readyz", self._readyz, methods=["GET"]),
                Route("/metrics", self._metrics, methods=["GET"]),
                Route("/status", self._status, methods=["GET"]),
            ],
            middleware=[
                Middleware(
                    RouterGate,
                    token=self.config.auth_token,
                    refusals=svc.metrics.auth_refusals,
                    operator_token=self.config.operator_token,
                    tenants=svc.tenants,
                )
            ],
            lifespan=lifespan,
        )

    async def _healthz(self, _: Request) -> Response:
        return Response(b'{"status":"ok"}', media_type=_JSON)

    async def _readyz(self, _: Request) -> Response:
        n = len(self.service.table.available(time.monotonic()))
        body = msgspec.json.encode({"ready": n > 0, "engines_available": n})
        return Response(body, status_code=200 if n else 503, media_type=_JSON)

    async def _metrics(self, _: Request) -> Response:
        return Response(self.service.metrics.render(), media_type="text/plain; version=0.0.4")

    async def _status(self, _: Request) -> Response:
        return Response(msgspec.json.encode(self.status()), media_type=_JSON)

    def status(self) -> RouterStatus:
        now = time.monotonic()
        svc = self.service
        engines = [
            EngineView(
                url=e.url,
                instance_id=e.instance_id,
                model_name=e.model_name,
                available=e.available(now),
                healthy=e.healthy,
                breaker_open=not e.breaker.allows(now),
                in_flight=e.in_flight,
                queued_prefill_tokens=e.queued_tokens,
                reported_running=e.reported_running,
                requests=e.requests,
                errors=e.errors,
                breaker_opens=e.breaker.opened,
                busy_s=round(e.busy_s, 3),
                last_error=e.last_error,
                prefill_tokens_per_s=_per_s(e.prefill.s_per_token),
                p2p_weight=round(
                    w if (w := svc.table.p2p_weight(e)) is not None else self.config.weights.p2p,
                    6,
                ),
            )
            for e in sorted(svc.table.engines.values(), key=lambda e: e.url)
        ]
        return RouterStatus(
            self.config.policy,
            self.coordinator.url if self.coordinator else None,
            svc.routed,
            svc.failed,
            engines,
            _per_s(svc.table.p2p_s_per_token()),
            self._tokens_from(),
        )

    def _tokens_from(self) -> str:
        tok = self.service.tokenizer
        return "engine" if tok is None else f"local: {tok.source}, encoder {tok.encoder}"

    def start(self, timeout_s: float = 30.0) -> None:
        """Serve in a thread; returns once the first listing and probes are done."""
        self.http.start(self.app, name="kvatlas-router-http", timeout_s=timeout_s)
        log.info(
            "router serving at %s (policy %s, coordinator %s, %d engines known, tokens: %s)",
            self.url,
            self.config.policy,
            ", ".join(self.config.coordinator_urls) or "none",
            len(self.service.table.engines),
            self._tokens_from(),
        )

    def stop(self) -> None:
        self._stop.set()
        self.http.stop()
        if self.coordinator is not None:
            self.coordinator.close()

    def run(self) -> None:
        """Start, serve until SIGTERM or SIGINT, stop."""
        # The process is ours: move what startup built (the modules, and with
        # --tokenizer transformers and torch, some million objects) out of the
        # collector's sight, or each full collection walks them all inside some
        # request's routing time (kvatlas_router_gc_pause_seconds says how long).
        gc.collect()
        gc.freeze()
        serve_until_signal(self.http, self._stop, self.start, self.stop)


def _per_s(s_per_token: float | None) -> float | None:
    return round(1.0 / s_per_token, 1) if s_per_token else None
