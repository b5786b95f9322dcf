"""Method and path to a handler: the HTTP edge's routing table.

Owns `Router` (exact paths by one dict lookup, ``{name}`` patterns by segments, ``HEAD``
served by ``GET``), `Route` (a handler, whether it is a coroutine, and the ``offload``
predicate that sends a plain function's request to the thread pool), the 404 and 405
answers, and the types a service hands the server: handlers, the gate run before
routing, the error translator. Must not run handlers or know any service's routes.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from kvatlas.coordinator.http.edge.messages import HttpRequest, HttpResponse, error_body

SyncHandler = Callable[[HttpRequest], HttpResponse]
AsyncHandler = Callable[[HttpRequest], Awaitable[HttpResponse]]
Offload = Callable[[HttpRequest], bool]
ErrorTranslator = Callable[[Exception], HttpResponse | None]
"""Maps an exception a handler raised to its answer; None means a bug (500)."""
Gate = Callable[[HttpRequest], HttpResponse | None]
"""Runs before routing (authentication); an answer stops the request there."""


def always(request: HttpRequest) -> bool:
    """An `offload` predicate: every request of the route goes to the thread pool."""
    return True


@dataclass(slots=True, frozen=True)
class Route:
    method: str
    path: str
    """Literal segments and ``{name}`` placeholders, each matching one segment."""
    handler: SyncHandler | AsyncHandler
    offload: Offload | None = None
    """For a plain function: when true for a request, run it in the thread pool."""
    is_async: bool = False


class Router:
    """Method and path to a route; exact paths by one dict lookup, patterns by segments."""

    def __init__(self) -> None:
        self._exact: dict[str, dict[str, Route]] = {}
        self._patterns: list[tuple[list[str], dict[str, Route]]] = []

    def add(
        self,
        method: str,
        path: str,
        handler: SyncHandler | AsyncHandler,
        *,
        offload: Offload | None = None,
    ) -> None:
        is_async = inspect.iscoroutinefunction(handler)
        if is_async and offload is not None:
            raise ValueError(f"{method} {path}: a coroutine handler cannot be offloaded")
        route = Route(method, path, handler, offload, is_async)
        if "{" not in path:
            self._exact.setdefault(path, {})[method] = route
            return
        parts = path.strip("/").split("/")
        for known, methods in self._patterns:
            if known == parts:
                methods[method] = route
                return
        self._patterns.append((parts, {method: route}))

    def routes(self) -> list[Route]:
        every = [r for methods in self._exact.values() for r in methods.values()]
        return every + [r for _, methods in self._patterns for r in methods.values()]

    def match(self, method: str, path: str) -> tuple[Route | None, dict[str, str], list[str]]:
        """The route, its path parameters, and (when no route) the methods the path has."""
        methods = self._exact.get(path)
        params: dict[str, str] = {}
        if methods is None:
            segments = path.strip("/").split("/")
            for parts, candidate in self._patterns:
                if len(parts) == len(segments):
                    got = _bind(parts, segments)
                    if got is not None:
                        methods, params = candidate, got
                        break
        if methods is None:
            return None, {}, []
        route = methods.get("GET" if method == "HEAD" else method)
        if route is None:
            return None, {}, sorted(methods)
        return route, params, []


def _bind(parts: list[str], segments: list[str]) -> dict[str, str] | None:
    params: dict[str, str] = {}
    for part, seg in zip(parts, segments, strict=True):
        if part.startswith("{"):
            if not seg:
                return None
            params[part[1:-1]] = seg
        elif part != seg:
            return None
    return params


def not_routed(request: HttpRequest, allowed: list[str]) -> HttpResponse:
    """405 naming the methods the path has, or 404 when it has none."""
    if allowed:
        return HttpResponse(
            405,
            error_body(f"{request.method} is not allowed on {request.path}"),
            headers=(("allow", ", ".join(allowed)),),
        )
    return HttpResponse(404, error_body(f"no such endpoint: {request.path}"))
