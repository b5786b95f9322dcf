"""The fleet page in a real headless Chromium against a real coordinator and real cache
servers: the token prompt, both members, rates that move when chunks are stored and read
over P2P, a SIGKILLed server that turns stale and then disappears; and a fleet of 100
members that the table still sorts and filters. Saves a screenshot (set
``KVATLAS_UI_SCREENSHOT=docs/images/fleet-ui.png`` to refresh the one the docs show)."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

from kvatlas.wire.fleet_view import STATUS_URL_KEY
from support.wait import wait_until

from .browser import chromium_page
from .fleet import fleet, store_and_share

if TYPE_CHECKING:
    from playwright.sync_api import Page

pytestmark = [pytest.mark.browser, pytest.mark.slow]

TOKEN = "fleet-page-token"
WAIT_MS = 20_000


def rate(page: Page, chart: str) -> float:
    value = page.get_attribute(f"#rate-{chart}", "data-value")
    return float(value) if value else 0.0


def wait_js(page: Page, expression: str, what: str) -> None:
    """Until ``expression`` is true in the page. Polled from here: Playwright's own
    wait_for_function evaluates strings with eval, which the page's CSP forbids."""
    wait_until(lambda: page.evaluate(expression), what=what, timeout=WAIT_MS / 1000)


def rows(page: Page) -> int:
    return int(page.evaluate("document.querySelectorAll('#members tbody tr').length"))


def test_fleet_page_in_chromium(tmp_path: Path) -> None:
    with fleet(tmp_path / "fleet", "node-a", "node-b", token=TOKEN) as fl:
        a, b = fl.nodes
        owner, reader = a.client(), b.client()
        with chromium_page(tmp_path / "profile") as page:
            foreign: list[str] = []
            page.on(
                "request",
                lambda req: None if req.url.startswith(fl.url) else foreign.append(req.url),
            )
            page.goto(fl.url + "/ui?interval=1")

            # The token prompt: a wrong token is refused, the right one kept for the tab.
            page.wait_for_selector("#auth[open]", timeout=WAIT_MS)
            page.fill("#token", "not-the-token")
            page.click("#auth-submit")
            page.wait_for_selector("#auth-error:not([hidden])", timeout=WAIT_MS)
            page.fill("#token", TOKEN)
            page.click("#auth-submit")

            for name in ("node-a", "node-b"):
                page.wait_for_selector(
                    f'#members tr[data-instance="{name}"][data-state="live"]', timeout=WAIT_MS
                )
            assert page.evaluate("sessionStorage.getItem('kvatlas.token')") == TOKEN

            # Traffic: chunks stored on one server and read by the other over P2P, both
            # ways, until the rates show it; then a few polls more for the charts.
            seed = 1
            while not (
                rate(page, "events") > 0
                and rate(page, "peer-bytes") > 0
                and rate(page, "engine-lookups") > 0
            ):
                assert seed < 40, "the rates never moved"
                store_and_share(*((owner, reader) if seed % 2 else (reader, owner)), seed)
                seed += 1
                page.wait_for_timeout(300)
            for extra in range(10):
                store_and_share(owner, reader, seed, n_chunks=4 + 2 * (extra % 3))
                store_and_share(reader, owner, seed + 1, n_chunks=2 + extra % 4)
                seed += 2
                page.wait_for_timeout(600)
            wait_js(
                page, "document.getElementById('rate-hit-rate').dataset.value !== ''", "hit rate"
            )
            points = page.get_attribute("#chart-events polyline", "points") or ""
            assert len(points.split()) >= 3, points
            assert page.inner_text("#card-keys") != "0"
            assert "node-a" in (page.text_content("#owners") or "")

            # The table filters and sorts.
            page.fill("#filter", "node-b")
            wait_until(
                lambda: rows(page), lambda n: n == 1, what="the filter leaves node-b", timeout=5
            )
            page.fill("#filter", "")
            page.click('#members th[data-sort="instance"]')  # ascending was the default
            page.wait_for_selector('#members th.sorted-desc[data-sort="instance"]')
            first = page.get_attribute("#members tbody tr:first-child", "data-instance")
            assert first == "node-b"
            page.click('#members th[data-sort="instance"]')

            page.evaluate("window.scrollTo(0, 0)")  # the header is sticky
            shot = Path(os.environ.get("KVATLAS_UI_SCREENSHOT") or tmp_path / "fleet-ui.png")
            shot.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(shot), full_page=True)
            assert shot.stat().st_size > 20_000

            # A server killed without a word: stale, then gone from the page.
            reader.close()
            b.clients.clear()
            b.kill()
            page.wait_for_selector(
                '#members tr[data-instance="node-b"][data-state="stale"]', timeout=WAIT_MS
            )
            page.wait_for_selector(
                '#members tr[data-instance="node-b"]', state="detached", timeout=WAIT_MS
            )
            assert page.is_visible('#members tr[data-instance="node-a"][data-state="live"]')
            assert not foreign, f"the page fetched from elsewhere: {foreign}"


# ---- 100 members -------------------------------------------------------------------------


def status_doc(i: int) -> dict[str, object]:
    """A server's /status as the page reads it; member 7 has P2P trouble."""
    return {
        "uptime_s": 100.0 + i,
        "registration_state": "registered",
        "l1": {"capacity_bytes": 1 << 30, "used_bytes": (i * 10_000_019) % (1 << 30), "chunks": i},
        "l2": {"enabled": False},
        "events": {"pending": i % 5, "buffered_batches": 0},
        "lookups": {"requests": 10 * i, "chunks": 40 * i, "hit_chunks": 20 * i},
        "p2p_enabled": True,
        "p2p_state": "registered",
        "p2p_peer_count": 99,
        "p2p_peers": [],
        "p2p": {"bytes_read": i << 20, "fallbacks": {"stale_hint": 3} if i == 7 else {}},
    }


@contextmanager
def canned_status_server() -> Iterator[int]:
    """A local HTTP server answering /status/<i> for the fake members."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            i = int(self.path.rsplit("/", 1)[-1])
            body = json.dumps(status_doc(i)).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    class Server(ThreadingHTTPServer):
        request_queue_size = 128  # the coordinator connects to all members at once

    server = Server(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_hundred_members_sort_and_filter(tmp_path: Path) -> None:
    # A long instance timeout: these members never heartbeat.
    with fleet(tmp_path / "fleet", instance_timeout=300) as fl, canned_status_server() as port:
        for i in range(100):
            body = {
                "instance_id": f"node-{i:03d}",
                "ip": "127.0.0.1",
                "http_port": port,
                "metadata": {STATUS_URL_KEY: f"http://127.0.0.1:{port}/status/{i}"},
            }
            r = httpx.post(fl.url + "/instances", json=body, timeout=5)
            assert r.status_code == 200, r.text
        wait_until(
            lambda: len(fl.fleet_json()["members"]),
            lambda n: n == 100,
            what="100 members listed",
            timeout=10,
        )
        with chromium_page(tmp_path / "profile") as page:
            page.goto(fl.url + "/ui")
            wait_until(
                lambda: rows(page), lambda n: n == 100, what="100 rows", timeout=WAIT_MS / 1000
            )
            assert "showing 100 of 100" in page.inner_text("#members-count")
            page.fill("#filter", "node-00")
            wait_until(
                lambda: rows(page),
                lambda n: n == 10,
                what="the filter leaves node-000..node-009",
                timeout=5,
            )
            page.fill("#filter", "")
            page.check("#problems")
            wait_until(
                lambda: rows(page), lambda n: n == 1, what="one member with problems", timeout=5
            )
            assert page.get_attribute("#members tbody tr", "data-instance") == "node-007"
            page.uncheck("#problems")
            page.click('#members th[data-sort="l1"]')
            page.click('#members th[data-sort="l1"]')  # descending: the fullest L1 first
            used = {i: status_doc(i)["l1"]["used_bytes"] for i in range(100)}  # type: ignore[index]
            fullest = max(used, key=lambda i: used[i])
            page.wait_for_selector(
                f'#members tbody tr:first-child[data-instance="node-{fullest:03d}"]',
                timeout=WAIT_MS,
            )
            assert "stale_hint" in page.inner_text("#fallbacks")
