"""End to end: vLLM's own publisher announces engine A's prefix cache to a real
coordinator (``--vllm-kv-events``); a real ``kvatlas router`` in front of two engines
sends the repeated prompt to A and names the device tier in ``X-Kvatlas-Route``.

The engines are small HTTP servers speaking the part of vLLM's OpenAI API the router
uses (``/metrics``, ``/v1/completions``): a GPU vLLM cannot run here, and the router
only needs their answers, not their tokens."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvatlas.coordinator.vllm.sources import parse_sources
from kvatlas.launch.procs import HOST
from kvatlas.router.app import RouterApp
from kvatlas.router.config import RouterConfig, StaticEngine
from kvatlas.router.service import ROUTE_HEADER
from support.coordinator import RunningCoordinator
from support.services import start_server_process
from support.wait import wait_until

from .test_vllm_ingest import BLOCK, HASHER, _batch, _port, _prompt, _publisher, _stored

pytest.importorskip(
    "vllm.distributed.kv_events", reason="vLLM not installed (scripts/bootstrap.sh)"
)


class FakeEngine:
    """An OpenAI-compatible engine that answers with its own name."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.prompts: list[list[int]] = []
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, body: bytes, kind: str) -> None:
                self.send_response(200)
                self.send_header("content-type", kind)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                self._send(b"vllm:num_requests_running 0\n", "text/plain")

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                engine.prompts.append(body["prompt"])
                answer = {"choices": [{"text": engine.name}], "usage": {"prompt_tokens": 1}}
                self._send(json.dumps(answer).encode(), "application/json")

        self.server = ThreadingHTTPServer((HOST, 0), Handler)
        self.url = f"http://{HOST}:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fakes() -> Iterator[dict[str, FakeEngine]]:
    out = {n: FakeEngine(n) for n in ("a", "b")}
    yield out
    for f in out.values():
        f.close()


def _route(r: httpx.Response) -> dict[str, str]:
    return dict(p.split("=", 1) for p in r.headers[ROUTE_HEADER].split("; ") if "=" in p)


def test_repeated_prompt_goes_to_the_engine_whose_device_cache_holds_it(
    fakes: dict[str, FakeEngine],
    start_coordinator: Callable[..., RunningCoordinator],
) -> None:
    ports = {n: (_port(), _port()) for n in ("a", "b")}
    # a is matched by its cache instance id (--engine URL=a); b's source names its URL
    specs = [
        f"a=tcp://127.0.0.1:{ports['a'][0]},replay=tcp://127.0.0.1:{ports['a'][1]},"
        f"topic=kv-events,block_size={BLOCK},hash=sha256_cbor",
        f"gpu-b=tcp://127.0.0.1:{ports['b'][0]},replay=tcp://127.0.0.1:{ports['b'][1]},"
        f"topic=kv-events,block_size={BLOCK},hash=sha256_cbor,url={fakes['b'].url}/",
    ]
    pubs = {n: _publisher(*ports[n]) for n in ("a", "b")}
    router: RouterApp | None = None
    try:
        rc = start_coordinator(vllm_kv_events=parse_sources(specs), max_lookup_tokens=4096)
        config = RouterConfig(
            port=0,
            coordinator_urls=(rc.url,),
            engines=(StaticEngine(fakes["a"].url, "a"), StaticEngine(fakes["b"].url, "node-b")),
            policy="kv",
            model_name="m",
            health_interval_s=0.2,
            refresh_interval_s=0.2,
            lookup_timeout_s=2.0,
            seed=1,
            expose_route_header=True,
        )
        router = RouterApp(config)
        router.start()
        assert router is not None
        url = router.url
        wait_until(
            lambda: sum(e.available for e in router.status().engines) == 2,
            what="both engines",
        )

        def post(prompt: list[int]) -> dict[str, str]:
            r = httpx.post(f"{url}/v1/completions", json={"prompt": prompt}, timeout=30)
            assert r.status_code == 200, r.text
            return _route(r)

        # before any event: nothing cached anywhere
        assert post(_prompt(1))["tier"] == "none"

        pubs["a"].publish(_batch(_stored(_prompt(1))))
        pubs["b"].publish(_batch(_stored(_prompt(2)[: 2 * BLOCK])))

        def best(tokens: list[int]) -> Any:
            r = rc.client.post("/directory/device-lookup", json={"token_ids": tokens})
            return r.json()["best"]

        wait_until(
            lambda: best(_prompt(1)) == "a" and best(_prompt(2)) == "gpu-b", what="both engines"
        )
        for _ in range(3):
            got = post(_prompt(1))
            assert got["engine"] == fakes["a"].url, got
            assert got["tier"] == "device" and got["cached"] == str(4 * BLOCK), got
            assert got["reason"] == "kv: prefix"
        got = post([*_prompt(2), 5, 6, 7])
        assert got["engine"] == fakes["b"].url and got["tier"] == "device", got
        assert got["cached"] == str(2 * BLOCK)
        # blocks held only in vLLM's CPU offload tier count as L1
        pubs["b"].publish(_batch(_stored(_prompt(3), medium="CPU")))
        wait_until(lambda: best(_prompt(3)) == "gpu-b", what="b's offloaded blocks")
        got = post(_prompt(3))
        assert got["engine"] == fakes["b"].url and got["tier"] == "l1", got

        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        assert 'kvatlas_router_decision_tiers_total{tier="device"} 4.0' in metrics
        assert 'kvatlas_router_device_lookups_total{outcome="ok"}' in metrics
    finally:
        if router is not None:
            router.stop()
        for p in pubs.values():
            p.shutdown()


def test_without_a_device_tier_the_router_stops_asking(
    fakes: dict[str, FakeEngine],
    start_coordinator: Callable[..., RunningCoordinator],
) -> None:
    rc = start_coordinator()
    router = RouterApp(
        RouterConfig(
            port=0,
            coordinator_urls=(rc.url,),
            engines=(StaticEngine(fakes["a"].url, "a"),),
            policy="kv",
            model_name="m",
            health_interval_s=0.2,
            lookup_timeout_s=2.0,
            expose_route_header=True,
        )
    )
    router.start()
    try:
        wait_until(lambda: any(e.available for e in router.status().engines), what="the engine")
        for _ in range(3):
            r = httpx.post(f"{router.url}/v1/completions", json={"prompt": [1, 2, 3]}, timeout=30)
            assert r.status_code == 200 and _route(r)["tier"] == "none"
        metrics = httpx.get(f"{router.url}/metrics", timeout=10).text
        assert 'kvatlas_router_device_lookups_total{outcome="absent"} 1.0' in metrics
        assert 'kvatlas_router_device_lookups_total{outcome="skipped"} 2.0' in metrics
    finally:
        router.stop()


def test_a_member_advertises_its_engines_events_and_the_router_follows(
    tmp_path: Path,
    fakes: dict[str, FakeEngine],
    start_coordinator: Callable[..., RunningCoordinator],
) -> None:
    """A cache server advertises its node's engine (``--engine-url``) and that engine's
    KV events (``--engine-kv-events``, the engine id left to its instance id); the
    coordinator (``--vllm-kv-events-from-members``) subscribes, the router maps the
    engine by its instance, and the source is dropped when the server leaves. No model
    name anywhere (a plain vLLM fleet's router has none to look chunks up by): the
    device tier alone routes."""
    pub_port, replay_port = _port(), _port()
    pub = _publisher(pub_port, replay_port)
    router: RouterApp | None = None
    rc = start_coordinator(vllm_kv_events_from_members=True)
    node = start_server_process(
        tmp_path, "node-x",
        "--coordinator-url", rc.url, "--coordinator-heartbeat-interval", "0.5",
        "--engine-url", fakes["a"].url,
        "--engine-kv-events", f"tcp://127.0.0.1:{pub_port},replay=tcp://127.0.0.1:{replay_port},"
        f"topic=kv-events,block_size={BLOCK},hash=sha256_cbor",
        "--engine-kv-events", "bad=tcp://127.0.0.1:1,colour=red",
    )  # fmt: skip
    try:
        ingest = rc.coordinator.vllm
        assert ingest is not None
        wait_until(lambda: "node-x" in ingest.from_members, what="the member's source")
        router = RouterApp(
            RouterConfig(
                port=0, coordinator_urls=(rc.url,), policy="kv",
                health_interval_s=0.2, refresh_interval_s=0.2, lookup_timeout_s=2.0,
                engines=(StaticEngine(fakes["b"].url, "node-b"),), expose_route_header=True,
            )
        )  # fmt: skip
        router.start()
        app = router
        wait_until(lambda: sum(e.available for e in app.status().engines) == 2, what="both engines")
        pub.publish(_batch(_stored(_prompt(7))))
        wait_until(lambda: bool(ingest.lookup(_prompt(7))[0].tokens), what="node-x's blocks")
        r = httpx.post(f"{app.url}/v1/completions", json={"prompt": _prompt(7)}, timeout=30)
        got = _route(r)
        assert got["engine"] == fakes["a"].url and got["tier"] == "device", got
        assert got["reason"] == "kv: prefix", got
        metrics = rc.client.get("/metrics").text
        assert "kvatlas_vllm_member_sources 1.0" in metrics
        assert "kvatlas_vllm_member_sources_refused_total 1.0" in metrics
        assert node.stop() == 0, node.tail()
        wait_until(lambda: not ingest.from_members, what="the source dropped with its member")
        assert ingest.lookup(_prompt(7)) == []
    finally:
        if router is not None:
            router.stop()
        node.stop()
        pub.shutdown()


def test_the_device_tier_matches_a_salted_prompt_under_its_salt_only(
    fakes: dict[str, FakeEngine],
    start_coordinator: Callable[..., RunningCoordinator],
) -> None:
    """vLLM mixes a request's ``cache_salt`` into its first block's hash: engine a's
    blocks of a salted prompt count for a request of the same salt, through the router,
    and for nothing else (no salt, another salt)."""
    ports = _port(), _port()
    spec = (
        f"a=tcp://127.0.0.1:{ports[0]},replay=tcp://127.0.0.1:{ports[1]},"
        f"topic=kv-events,block_size={BLOCK},hash=sha256_cbor"
    )
    pub = _publisher(*ports)
    router: RouterApp | None = None
    try:
        rc = start_coordinator(vllm_kv_events=parse_sources([spec]), max_lookup_tokens=4096)
        router = RouterApp(
            RouterConfig(
                port=0, coordinator_urls=(rc.url,), policy="kv", model_name="m",
                engines=(StaticEngine(fakes["a"].url, "a"), StaticEngine(fakes["b"].url, "b")),
                health_interval_s=0.2, refresh_interval_s=0.2, lookup_timeout_s=2.0, seed=1,
                expose_route_header=True,
            )
        )  # fmt: skip
        router.start()
        app = router
        wait_until(lambda: sum(e.available for e in app.status().engines) == 2, what="both engines")
        tokens = _prompt(7)
        digests = HASHER.digests(tokens, cache_salt="tenant-x")
        stored = _stored(tokens)
        stored.block_hashes = digests
        # vLLM publishes the salt in the first block's extra keys (as vLLM 0.34 does).
        stored.extra_keys = [("tenant-x",)] + [None] * (len(digests) - 1)
        pub.publish(_batch(stored))

        def device(salt: str | None) -> dict[str, Any]:
            body = {"token_ids": tokens, **({"cache_salt": salt} if salt else {})}
            hits: dict[str, Any] = rc.client.post("/directory/device-lookup", json=body).json()
            return hits

        wait_until(lambda: device("tenant-x")["best"], lambda b: b == "a", what="a's blocks")
        assert device(None)["best"] is None and device("tenant-y")["best"] is None

        def post(salt: str | None) -> dict[str, str]:
            body = {"prompt": tokens, **({"cache_salt": salt} if salt else {})}
            r = httpx.post(f"{app.url}/v1/completions", json=body, timeout=30)
            assert r.status_code == 200, r.text
            return _route(r)

        got = post("tenant-x")
        assert got["tier"] == "device" and got["cached"] == str(4 * BLOCK), got
        for other in (None, "tenant-y"):
            got = post(other)
            assert got["tier"] == "none" and got["cached"] == "0", (other, got)
    finally:
        if router is not None:
            router.stop()
        pub.shutdown()
