"""The router's device-tier lookups against real HTTP servers on loopback: the one
breaker (`core.breaker`) opens on a failed lookup, skips the tier for its cool-off,
lets the next requests ask again once it is over (half-open) and closes on an answer;
a coordinator without a device tier (404) is not asked again for ``absent_recheck_s``;
and the coordinator's replicas fail over by their one rule (``ReplicaWalk``), sticking
to the replica that answered, on the router's coordinator client's replica state. The
clock is a test's own."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from kvatlas.core.breaker import BreakerState
from kvatlas.router.config import RouterConfig
from kvatlas.router.device_lookup import DeviceLookups
from kvatlas.router.service import RouterService
from kvatlas.router.tiers import Ask, Match
from kvatlas.runtime.coordinator_client import CoordinatorClient
from kvatlas.runtime.coordinator_replicas import Replicas

BLOB = np.arange(8, dtype="<u4").tobytes()
HIT = {"engines": [{"engine": "gpu-a", "tokens": 32, "media": ["GPU"]}]}


class Coordinator:
    """A coordinator replica's ``/directory/device-lookup``: answers ``status`` with
    ``HIT`` (200) or an error body, and keeps what it was sent."""

    def __init__(self, status: int = 200) -> None:
        self.status = status
        self.asked: list[dict[str, Any]] = []
        self.auth: list[str | None] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                owner.asked.append(json.loads(body))
                owner.auth.append(self.headers.get("authorization"))
                out = json.dumps(HIT if owner.status == 200 else {"error": "no"}).encode()
                self.send_response(owner.status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture
def coordinators() -> Iterator[list[Coordinator]]:
    made = [Coordinator(), Coordinator()]
    yield made
    for c in made:
        c.close()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _lookups(urls: list[str], clock: Clock, **kw: Any) -> tuple[DeviceLookups, CollectorRegistry]:
    registry = CollectorRegistry()
    replicas = Replicas(urls, timeout_s=2.0, clock=clock)
    lookups = DeviceLookups(
        replicas, auth_token="fleet-token", timeout_s=2.0, registry=registry, clock=clock, **kw
    )
    return lookups, registry


def _count(registry: CollectorRegistry, outcome: str) -> float:
    got = registry.get_sample_value("kvatlas_router_device_lookups_total", {"outcome": outcome})
    return got or 0.0


def _ask(lookups: DeviceLookups) -> tuple[bool, list[Match]]:
    """One request's ask, as the router's gather makes it: whether it was asked, and
    the matches it answered."""

    async def run() -> tuple[bool, list[Match]]:
        ask = Ask(BLOB, "m", "")
        if not lookups.asks(ask):
            return False, []
        try:
            return True, list((await lookups.answer(ask)).matches)
        finally:
            await lookups.aclose()

    return asyncio.run(run())


def test_a_failed_lookup_opens_the_breaker_and_the_tier_is_asked_again_after_it(
    coordinators: list[Coordinator],
) -> None:
    down = coordinators[0]
    down.status = 500
    clock = Clock()
    lookups, registry = _lookups([down.url], clock, backoff_s=5.0)
    assert _ask(lookups) == (True, [])
    assert _count(registry, "failed") == 1
    assert lookups.breaker.state(clock.now) is BreakerState.OPEN
    # open: skipped, and nothing is sent
    clock.now += 4.9
    assert _ask(lookups) == (False, [])
    assert _count(registry, "skipped") == 1 and len(down.asked) == 1
    # half-open: the next request asks; a failure opens it again for its cool-off
    clock.now += 0.2
    assert lookups.breaker.state(clock.now) is BreakerState.HALF_OPEN
    assert _ask(lookups) == (True, [])
    assert _count(registry, "failed") == 2 and len(down.asked) == 2
    assert lookups.breaker.state(clock.now + 4.9) is BreakerState.OPEN
    # half-open again, and an answer closes it
    down.status = 200
    clock.now += 5.1
    asked, matches = _ask(lookups)
    assert asked and matches == [Match("device", 32, engine="gpu-a")]
    assert _count(registry, "ok") == 1
    assert lookups.breaker.state(clock.now) is BreakerState.CLOSED
    # the fleet's token went with every lookup, the prompt's ids as JSON
    assert down.auth == ["Bearer fleet-token"] * 3
    assert down.asked[-1] == {"token_ids": list(range(8))}


def test_a_coordinator_without_a_device_tier_is_not_asked_until_the_recheck(
    coordinators: list[Coordinator],
) -> None:
    absent = coordinators[0]
    absent.status = 404
    clock = Clock()
    lookups, registry = _lookups([absent.url], clock, backoff_s=1.0, absent_recheck_s=60.0)
    assert _ask(lookups) == (True, [])
    assert _count(registry, "absent") == 1 and _count(registry, "failed") == 0
    clock.now += 59.0
    assert _ask(lookups) == (False, [])
    assert _ask(lookups) == (False, [])
    assert _count(registry, "skipped") == 2 and len(absent.asked) == 1
    clock.now += 2.0
    assert _ask(lookups)[0] and len(absent.asked) == 2


def test_the_replicas_fail_over_and_stick_to_the_one_that_answered(
    coordinators: list[Coordinator],
) -> None:
    first, second = coordinators
    first.status = 503
    clock = Clock()
    lookups, registry = _lookups([first.url, second.url], clock)
    asked, matches = _ask(lookups)
    assert asked and matches == [Match("device", 32, engine="gpu-a")]
    assert (len(first.asked), len(second.asked)) == (1, 1)
    assert _count(registry, "ok") == 1 and _count(registry, "failed") == 0
    # sticky: the next lookup goes to the replica that answered, the failed one skipped
    first.status = 200
    assert _ask(lookups)[1] and (len(first.asked), len(second.asked)) == (1, 2)
    # a replica that does not answer at all fails over too (once the first one's skip,
    # ``Replicas``' own breaker, is over)
    second.close()
    clock.now += 2.5
    assert _ask(lookups)[1] and len(first.asked) == 2
    assert lookups.breaker.state(clock.now) is BreakerState.CLOSED


def test_the_router_s_device_lookups_fail_over_on_its_coordinator_client_s_replicas(
    coordinators: list[Coordinator],
) -> None:
    first, second = coordinators
    first.status = 503
    client = CoordinatorClient([first.url, second.url], timeout_s=2.0, name="router")
    try:
        service = RouterService(RouterConfig(), client)
        asked, matches = _ask(service.device)
        assert asked and matches == [Match("device", 32, engine="gpu-a")]
        # the failover is the client's: its chunk lookups and listings now go to the
        # replica the device lookup found answering, and skip the one that failed
        stats = client.stats()
        assert stats.url == second.url and stats.failovers == 1
        assert [r.failures for r in stats.replicas] == [1, 0]
        assert stats.replicas[0].skipped_for_s > 0
        first.status = 200
        assert _ask(service.device)[1] and (len(first.asked), len(second.asked)) == (1, 2)
    finally:
        client.close()


def test_when_no_replica_answers_the_lookup_fails_once(coordinators: list[Coordinator]) -> None:
    for c in coordinators:
        c.status = 502
    clock = Clock()
    lookups, registry = _lookups([c.url for c in coordinators], clock)
    assert _ask(lookups) == (True, [])
    assert [len(c.asked) for c in coordinators] == [1, 1]
    assert _count(registry, "failed") == 1
    assert lookups.breaker.state(clock.now) is BreakerState.OPEN


def test_without_a_coordinator_nothing_is_asked() -> None:
    registry = CollectorRegistry()
    lookups = DeviceLookups(None, auth_token=None, timeout_s=1.0, registry=registry)
    assert _ask(lookups) == (False, [])
    assert _count(registry, "skipped") == 0
