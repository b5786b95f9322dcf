"""The fleet page's routes: `GET /ui` and its static files, and `GET /ui/fleet.json`.

Owns serving the page (HTML, CSS and JavaScript shipped in `coordinator/ui/`, read once at
startup, with a content security policy that lets the page load and fetch nothing but
from this coordinator) and the data route over `FleetView`. The page and its files hold
no fleet data and are served without the token (`ASSET_PATHS`, open in `auth`): the page
asks the operator for the token and sends it with every data request, which the gate
guards like any other route; the operator's token gets the per-salt rows (L2 against its
quota, L1 on the servers, the tenant's name), any other the sums (`FleetView.document`).
Must not: build the page at run time or fetch anything.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.resources import files

from kvatlas.coordinator.http.edge.messages import HttpRequest, HttpResponse
from kvatlas.coordinator.http.edge.routing import Router, SyncHandler
from kvatlas.coordinator.ui.fleet_view import FleetView

_ASSETS = {
    "/ui": ("index.html", "text/html; charset=utf-8"),
    "/ui/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/ui/style.css": ("style.css", "text/css; charset=utf-8"),
}
ASSET_PATHS = frozenset(_ASSETS)
"""The page and its files: no data, served without the token."""
DATA_PATH = "/ui/fleet.json"

_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self';"
    " img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
_PAGE_HEADERS = (
    ("content-security-policy", _POLICY),
    ("x-content-type-options", "nosniff"),
    ("referrer-policy", "no-referrer"),
    ("cache-control", "no-cache"),
)
_DATA_HEADERS = (("cache-control", "no-store"), ("x-content-type-options", "nosniff"))


class FleetPage:
    """The page's files (read once) and its data route."""

    def __init__(self, view: FleetView, sees_tenants: Callable[[HttpRequest], bool]) -> None:
        """``sees_tenants``: may a request see per-salt figures
        (`auth.OperatorCheck.sees_tenants`, which imports this module's paths)."""
        self._view = view
        self._sees_tenants = sees_tenants
        ui = files("kvatlas.coordinator.ui")
        self._files = {
            path: HttpResponse(200, ui.joinpath(name).read_bytes(), ctype, _PAGE_HEADERS)
            for path, (name, ctype) in _ASSETS.items()
        }

    def add_routes(self, router: Router) -> None:
        for path, response in self._files.items():
            router.add("GET", path, _static(response))
        router.add("GET", DATA_PATH, self.data)

    async def data(self, request: HttpRequest) -> HttpResponse:
        doc = await self._view.document(self._sees_tenants(request))
        return HttpResponse(200, doc, headers=_DATA_HEADERS)


def _static(response: HttpResponse) -> SyncHandler:
    def serve(request: HttpRequest) -> HttpResponse:
        return response

    return serve
