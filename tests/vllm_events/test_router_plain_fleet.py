"""Issue #38 item 5e: a plain vLLM fleet (no cache servers, no model name) routed by the
device tier alone is not degraded: ``kvatlas_router_degraded_total{step="lookup"}``
counts only lookups that were needed and failed."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import httpx
import pytest

from kvatlas.coordinator.vllm.sources import parse_sources
from kvatlas.router.app import RouterApp
from kvatlas.router.config import RouterConfig, StaticEngine
from support.coordinator import RunningCoordinator
from support.wait import wait_until

from .test_router_device_tier import FakeEngine, _route
from .test_vllm_ingest import BLOCK, _batch, _port, _prompt, _publisher, _stored


@pytest.fixture
def engines() -> Iterator[dict[str, FakeEngine]]:
    out = {n: FakeEngine(n) for n in ("a", "b")}
    yield out
    for f in out.values():
        f.close()


def test_a_fleet_the_device_tier_routes_is_not_degraded(
    engines: dict[str, FakeEngine], start_coordinator: Callable[..., RunningCoordinator]
) -> None:
    ports = _port(), _port()
    spec = (
        f"gpu-a=tcp://127.0.0.1:{ports[0]},replay=tcp://127.0.0.1:{ports[1]},"
        f"topic=kv-events,block_size={BLOCK},hash=sha256_cbor,url={engines['a'].url}"
    )
    pub = _publisher(*ports)
    router: RouterApp | None = None
    try:
        rc = start_coordinator(vllm_kv_events=parse_sources([spec]), max_lookup_tokens=4096)
        # the documented plain-fleet router: --engine URL=ID per engine, no --model-name
        router = RouterApp(
            RouterConfig(
                port=0, coordinator_urls=(rc.url,), policy="kv",
                engines=(StaticEngine(engines["a"].url, "a"), StaticEngine(engines["b"].url, "b")),
                health_interval_s=0.2, refresh_interval_s=0.2, lookup_timeout_s=2.0, seed=1,
                expose_route_header=True,
            )
        )  # fmt: skip
        router.start()
        app = router
        wait_until(lambda: sum(e.available for e in app.status().engines) == 2, what="both engines")
        pub.publish(_batch(_stored(_prompt(5))))
        wait_until(
            lambda: rc.client.post("/directory/device-lookup", json={"token_ids": _prompt(5)}),
            lambda r: r.json()["best"] == "gpu-a",
            what="gpu-a's blocks",
        )
        for _ in range(3):
            r = httpx.post(f"{app.url}/v1/completions", json={"prompt": _prompt(5)}, timeout=30)
            got = _route(r)
            assert got["engine"] == engines["a"].url and got["tier"] == "device", got
            assert got["reason"] == "kv: prefix", got
        metrics = httpx.get(f"{app.url}/metrics", timeout=10).text
        assert not re.search(r'kvatlas_router_degraded_total\{step="lookup"\} [1-9]', metrics)
    finally:
        if router is not None:
            router.stop()
        pub.shutdown()
