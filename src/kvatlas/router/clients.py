"""The router's connections to its engines: one keep-alive ``httpx.AsyncClient`` per
engine URL, shared by the relay, the probes and the engines' ``/tokenize``.

Owns the pools' timeouts (the first-byte timeout for reads, the connect timeout) and
their idle expiry. Must not: decide which engine to use, or retry.
"""

from __future__ import annotations

import httpx

from kvatlas.router.config import RouterConfig
from kvatlas.runtime.http_clients import async_fleet_client

KEEPALIVE_EXPIRY_S = 2.0
"""How long an idle connection to an engine stays pooled: below the engines' own
keep-alive timeout, so the engine never closes one the router is about to reuse."""


class EngineClients:
    """One keep-alive pool per engine, made on first use; used on one event loop."""

    def __init__(self, config: RouterConfig) -> None:
        self._config = config
        self._clients: dict[str, httpx.AsyncClient] = {}

    def get(self, url: str) -> httpx.AsyncClient:
        """The pool for ``url``. Its idle connections expire before an engine's own
        keep-alive timeout (uvicorn's and vLLM's: 5 s) would close them, so a request
        is not sent on a connection the engine is closing."""
        client = self._clients.get(url)
        if client is None:
            c = self._config
            timeout = httpx.Timeout(c.first_byte_timeout_s, connect=c.connect_timeout_s)
            limits = httpx.Limits(keepalive_expiry=KEEPALIVE_EXPIRY_S)
            client = async_fleet_client(base_url=url, timeout=timeout, limits=limits)
            self._clients[url] = client
        return client

    async def drop(self, url: str) -> None:
        """Close the pool of an engine that left."""
        client = self._clients.pop(url, None)
        if client is not None:
            await client.aclose()

    async def aclose(self) -> None:
        for c in self._clients.values():
            await c.aclose()
        self._clients.clear()
