"""LMCache's coordinator routes the differential suite compares: 0.5.6's 25, and
0.5.7rc2's 26 (`ROUTES_BY_VERSION`).

Read from its code (``lmcache/v1/mp_coordinator``): ``http_apis/*_api.py`` (membership,
usage, events, directory, cache control, health, metrics; 0.5.7's ``config_api.py``,
``PUT /config/chunk-size``) and the eviction controller's own routers
(``controllers/eviction_http_api.py``: quotas and pins, and in 0.5.7 ``/cache/delete``,
moved there from ``cache_api.py`` at the same path). ``route_of`` maps a concrete
request to its template the way FastAPI would (first match in this order, the literal
``/quota/config`` before ``/quota/{cache_salt}``).
"""

from __future__ import annotations

import re

ROUTES: tuple[str, ...] = (
    # http_apis/instances_api.py
    "POST /instances",
    "PUT /instances/{instance_id}/heartbeat",
    "DELETE /instances/{instance_id}",
    "GET /instances",
    # http_apis/instances_usage_api.py
    "GET /instances/usage",
    "GET /instances/{instance_id}/usage",
    # http_apis/events_api.py
    "POST /events",
    # http_apis/directory_api.py
    "POST /directory/lookup",
    "POST /directory/blend-lookup",
    "GET /directory/keys",
    "GET /directory/stats",
    # http_apis/cache_api.py
    "POST /cache/prefetches",
    "GET /cache/prefetches/{instance_id}/{request_id}",
    "POST /cache/delete",
    # http_apis/health_api.py, metrics_api.py
    "GET /healthz",
    "GET /metrics",
    # controllers/eviction_http_api.py
    "PUT /quota/config",
    "GET /quota/config",
    "PUT /quota/{cache_salt}",
    "DELETE /quota/{cache_salt}",
    "GET /quota/{cache_salt}",
    "GET /quota",
    "POST /cache/pins",
    "DELETE /cache/pins",
    "GET /cache/pins",
    # 0.5.7: http_apis/config_api.py
    "PUT /config/chunk-size",
)
ROUTES_056: tuple[str, ...] = tuple(r for r in ROUTES if r != "PUT /config/chunk-size")
ROUTES_BY_VERSION: dict[str, tuple[str, ...]] = {"0.5.6": ROUTES_056, "0.5.7rc2": ROUTES}


def _pattern(route: str) -> tuple[str, re.Pattern[str]]:
    method, template = route.split(" ", 1)
    return method, re.compile("^" + re.sub(r"\{[a-z_]+\}", "[^/]+", template) + "$")


_PATTERNS = [(route, *_pattern(route)) for route in ROUTES]


def route_of(method: str, path: str) -> str:
    """The template of ``method path`` (query string ignored); ``"? METHOD /path"`` for a
    request no LMCache route answers (the suite sends none on purpose)."""
    bare = path.split("?", 1)[0]
    for route, m, rx in _PATTERNS:
        if m == method and rx.match(bare):
            return route
    return f"? {method} {bare}"
