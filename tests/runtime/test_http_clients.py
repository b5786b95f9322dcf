"""Every fleet HTTP client comes from `runtime.http_clients`, and such a client goes to
the address it is given even when the environment names a proxy: the fleet token never
reaches a proxy set for an operator's shell (real loopback servers, a real recording
proxy)."""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from kvatlas.launch.procs import HOST
from kvatlas.runtime.http_clients import async_fleet_client, fleet_client

SRC = Path(__file__).resolve().parents[2] / "src" / "kvatlas"
FACTORY = SRC / "runtime" / "http_clients.py"
CONSTRUCTION = re.compile(
    r"httpx\s*\.\s*(?:Client|AsyncClient|get|post|put|patch|delete|head|options|request|stream)\s*\("
)
"""A client built, or a module-level call (which builds one with ``trust_env=True``)."""
ALLOWED = {
    # The evaluation's own clients of the fleet it starts on loopback (an operator's tool,
    # not a fleet member): they carry no fleet token of a production fleet.
    SRC / "evaluation": "evaluation clients of the fleet under test",
    # The launcher's readiness probe of a process it started on loopback: no token, no
    # proxy (trust_env=False), and the launcher may import no runtime module (a contract).
    SRC / "launch" / "procs.py": "the launcher's readiness probe",
}


def _allowed(path: Path) -> bool:
    return path == FACTORY or any(path == p or p in path.parents for p in ALLOWED)


def test_every_fleet_client_is_built_by_the_factory() -> None:
    found = [
        f"{path.relative_to(SRC)}:{text[: m.start()].count(chr(10)) + 1}: {m.group(0)}"
        for path in sorted(SRC.rglob("*.py"))
        if not _allowed(path)
        for text in [path.read_text()]
        for m in CONSTRUCTION.finditer(text)
    ]
    assert not found, "build these with kvatlas.runtime.http_clients:\n" + "\n".join(found)


def test_the_allow_list_names_only_what_still_builds_its_own() -> None:
    """An entry whose file no longer builds a client is dropped from the list."""
    for path in ALLOWED:
        files = [path] if path.is_file() else sorted(path.rglob("*.py"))
        assert any(CONSTRUCTION.search(f.read_text()) for f in files), path


class _Recorder(BaseHTTPRequestHandler):
    """Answers every GET 200 (or, as a proxy, 502) and records the request line and
    its Authorization header."""

    answer = 200
    seen: list[tuple[str, str]]

    def do_GET(self) -> None:
        self.seen.append((self.requestline, self.headers.get("authorization", "")))
        body = b"direct" if self.answer == 200 else b"proxied"
        self.send_response(self.answer)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


def _serve(answer: int) -> Iterator[tuple[str, list[tuple[str, str]]]]:
    seen: list[tuple[str, str]] = []
    handler = type("Handler", (_Recorder,), {"answer": answer, "seen": seen})
    server = ThreadingHTTPServer((HOST, 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://{HOST}:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


@pytest.fixture
def target() -> Iterator[tuple[str, list[tuple[str, str]]]]:
    yield from _serve(200)


@pytest.fixture
def proxy(
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[tuple[str, list[tuple[str, str]]]]:
    """A recording proxy that the environment names for every scheme."""
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    for gen in _serve(502):
        for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
            monkeypatch.setenv(name, gen[0])
        yield gen


def test_the_environment_proxy_would_get_the_token(
    target: tuple[str, list[tuple[str, str]]], proxy: tuple[str, list[tuple[str, str]]]
) -> None:
    """The hazard the factory removes: httpx's default reads the proxy and hands it the
    request with its token (this test's proxy is real)."""
    url, _ = target
    with httpx.Client(headers={"Authorization": "Bearer fleet-secret"}) as plain:
        assert plain.get(url + "/x").status_code == 502
    assert proxy[1] and proxy[1][0][1] == "Bearer fleet-secret"


def test_a_factory_client_ignores_the_environment_proxy(
    target: tuple[str, list[tuple[str, str]]], proxy: tuple[str, list[tuple[str, str]]]
) -> None:
    url, seen = target
    with fleet_client(timeout=5, token="fleet-secret") as client:
        r = client.get(url + "/status")
    assert (r.status_code, r.text) == (200, "direct")
    assert seen == [("GET /status HTTP/1.1", "Bearer fleet-secret")]
    assert proxy[1] == []


def test_an_async_factory_client_ignores_the_environment_proxy(
    target: tuple[str, list[tuple[str, str]]], proxy: tuple[str, list[tuple[str, str]]]
) -> None:
    url, seen = target

    async def get() -> httpx.Response:
        async with async_fleet_client(timeout=5, token="fleet-secret") as client:
            return await client.get(url + "/status")

    r = asyncio.run(get())
    assert (r.status_code, r.text) == (200, "direct")
    assert seen == [("GET /status HTTP/1.1", "Bearer fleet-secret")]
    assert proxy[1] == []


def test_the_factory_follows_no_redirect_and_sends_no_token_unasked() -> None:
    def answer(request: httpx.Request) -> httpx.Response:
        assert "authorization" not in request.headers
        return httpx.Response(307, headers={"location": "http://elsewhere.invalid/"})

    with fleet_client(timeout=5, transport=httpx.MockTransport(answer)) as client:
        assert client.get("http://127.0.0.1:1/").status_code == 307
