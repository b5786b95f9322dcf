"""The one place a kvatlas process builds an httpx client for a call inside the fleet.

Owns the settings every such client shares: ``trust_env=False`` always (httpx would
otherwise route through ``HTTP_PROXY``/``HTTPS_PROXY``/``ALL_PROXY`` from the
environment and read ``.netrc`` and ``SSL_CERT_FILE``: a proxy set for an operator's
shell would see, and could keep, the fleet token of every request), the fleet's shared
token as ``Authorization: Bearer`` when one is given, and no redirects followed (a
redirect would carry the token to wherever it points). Timeouts and pool limits are the
caller's, as parameters.

Every ``httpx.Client(`` / ``httpx.AsyncClient(`` under ``src/`` is built here
(tests/runtime/test_http_clients.py checks it), but for the evaluation's own clients
of the fleet it starts and the router's, listed there until they move here.

Must not: keep a client, retry, or know which service is called.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import httpx

__all__ = ["DEFAULT_LIMITS", "async_fleet_client", "fleet_client", "fleet_headers"]

DEFAULT_LIMITS = httpx.Limits(max_connections=100, max_keepalive_connections=20)
"""A pool's limits when the caller gives none: httpx's own defaults (``httpx.Limits()``
would be unbounded)."""


def fleet_headers(
    token: str | None = None, headers: Mapping[str, str] | None = None
) -> dict[str, str]:
    """``headers`` with the bearer ``token`` when one is given (it wins over a caller's
    own ``authorization``)."""
    out = dict(headers or {})
    if token:
        out = {k: v for k, v in out.items() if k.lower() != "authorization"}
        out["Authorization"] = f"Bearer {token}"
    return out


def _settings(
    timeout: float | httpx.Timeout,
    token: str | None,
    headers: Mapping[str, str] | None,
    limits: httpx.Limits | None,
    base_url: str,
) -> dict[str, Any]:
    """What both clients are built with: never the environment's proxies, never a
    redirect (the token would follow it)."""
    return {
        "base_url": base_url,
        "headers": fleet_headers(token, headers),
        "timeout": timeout,
        "limits": limits if limits is not None else DEFAULT_LIMITS,
        "trust_env": False,
        "follow_redirects": False,
    }


def fleet_client(
    *,
    timeout: float | httpx.Timeout,
    token: str | None = None,
    headers: Mapping[str, str] | None = None,
    limits: httpx.Limits | None = None,
    base_url: str = "",
    transport: httpx.BaseTransport | None = None,
) -> httpx.Client:
    """A blocking client: ``timeout`` (seconds or an ``httpx.Timeout``) for each request,
    ``token`` as a bearer header, ``limits`` of its pool (`DEFAULT_LIMITS` when None).
    ``transport``: a test's own (``httpx.MockTransport``), else httpx's."""
    return httpx.Client(transport=transport, **_settings(timeout, token, headers, limits, base_url))


def async_fleet_client(
    *,
    timeout: float | httpx.Timeout,
    token: str | None = None,
    headers: Mapping[str, str] | None = None,
    limits: httpx.Limits | None = None,
    base_url: str = "",
    transport: httpx.AsyncBaseTransport | None = None,
) -> httpx.AsyncClient:
    """The same as `fleet_client`, for an event loop; it belongs to the loop it is first
    used on (``aclose()`` it there)."""
    return httpx.AsyncClient(
        transport=transport, **_settings(timeout, token, headers, limits, base_url)
    )
