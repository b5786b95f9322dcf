"""``kvatlas router`` in front of real reference engines on 127.0.0.1.

The fleet (conftest): a coordinator and two cache servers as processes, two engines on
the tiny random model in this process. Engines are found through the servers'
registrations; requests go where their prefix is; streams and headers pass through;
an engine that dies and a coordinator that goes away cost no request.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import signal
from functools import partial
from typing import Any

import httpx
import pytest

from kvatlas.cli.router import build_parser, config_from_args, main
from kvatlas.launch.procs import free_port
from kvatlas.router.app import RouterApp
from kvatlas.router.config import StaticEngine
from support.launch import launch, python_module
from support.services import start_server_process
from support.tap import HttpTap
from support.wait import wait_until

from .conftest import Fleet, StartRouter, retried, route

DOC = "".join(f"Paragraph {i}: the fleet keeps this chunk of the document. " for i in range(14))


def chat(content: str, **extra: Any) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": content}],
        "temperature": 0,
        "max_tokens": 4,
        "ignore_eos": True,
        "kv_transfer_params": {"cached_token_stats": True},
        **extra,
    }


def post(router: RouterApp, body: dict[str, Any], **kw: Any) -> httpx.Response:
    r = httpx.post(f"{router.url}/v1/chat/completions", json=body, timeout=60, **kw)
    assert r.status_code == 200, r.text
    return r


def available(router: RouterApp) -> list[str]:
    return [e.url for e in router.status().engines if e.available]


def test_engines_are_found_and_kv_sends_a_prefix_where_it_is_cached(fleet: Fleet) -> None:
    urls = sorted(e.advertised_url for e in fleet.engines)
    router = fleet.router(policy="kv")
    wait_until(lambda: sorted(available(router)), lambda v: v == urls, what="both engines")
    listing = httpx.get(f"{fleet.coordinator.url}/instances", timeout=5).json()["instances"]
    advertised = sorted(i["metadata"]["engine_urls"] for i in listing)
    assert advertised == urls

    first = post(router, chat(DOC))
    home = route(first)["engine"]
    assert route(first)["cached"] == "0"
    assert first.json()["cached_token_stats"]["num_cached_tokens"] == 0
    n_prompt = first.json()["usage"]["prompt_tokens"]
    full = n_prompt // 256 * 256
    assert full >= 512

    def holders() -> Any:
        return httpx.get(f"{router.url}/metrics", timeout=5).text

    wait_until(
        lambda: httpx.get(f"{fleet.coordinator.url}/directory/stats", timeout=5).json(),
        lambda s: s["keys"] >= full // 256,
        what="the coordinator knows the prompt's chunks",
    )
    for _ in range(3):
        again = post(router, chat(DOC))
        r = route(again)
        assert r["engine"] == home and r["cached"] == str(full), r
        assert r["reason"] == "kv: prefix"
        assert again.json()["cached_token_stats"]["num_cached_tokens"] == full
    # a prompt nobody holds goes by load: not all to one engine
    others = {route(post(router, chat(f"unrelated question {i}")))["engine"] for i in range(4)}
    assert others == set(urls)
    metrics = holders()
    assert re.search(r'kvatlas_router_decisions_total\{.*reason="kv: prefix".*\} 3\.0', metrics)
    assert "kvatlas_router_overhead_seconds_count" in metrics


def test_streams_headers_and_request_ids_pass_through(
    fleet: Fleet, start_router: StartRouter
) -> None:
    engine = fleet.engines[0]
    with HttpTap(engine.port) as tap:
        router = start_router(engines=(StaticEngine(tap.url, "node-a"),), policy="round-robin")
        wait_until(lambda: available(router), what="the tapped engine")
        body = {"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0,
                "ignore_eos": True, "stream": True}  # fmt: skip
        headers = {"Authorization": "Bearer client-token", "X-Request-Id": "req-42"}
        with httpx.stream(
            "POST", f"{router.url}/v1/completions", json=body, headers=headers, timeout=60
        ) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            assert r.headers["x-request-id"] == "req-42"
            assert route(r)["engine"] == tap.url
            via_router = b"".join(r.iter_raw())
        sent = [q for q in tap.requests if q.target == "/v1/completions"]
        assert len(sent) == 1
        assert sent[0].headers["authorization"] == "Bearer client-token"
        assert sent[0].headers["x-request-id"] == "req-42"
        assert json.loads(sent[0].body) == body
        models = httpx.get(f"{router.url}/v1/models", timeout=10)
        assert models.status_code == 200 and models.json()["data"][0]["id"] == "tiny-random"
    direct = httpx.post(f"{engine.url}/v1/completions", json=body, timeout=60).content

    def same(raw: bytes) -> bytes:  # ids and timestamps differ per answer, nothing else
        return re.sub(rb'"(id|created)":("[^"]*"|\d+)', b"", raw)

    assert same(via_router) == same(direct)
    assert via_router.endswith(b"data: [DONE]\n\n") and via_router.count(b"data: ") >= 3


def test_an_engine_that_dies_costs_no_request(
    fleet: Fleet, start_router: StartRouter, tmp_path: Any
) -> None:
    port = free_port()
    argv = python_module(
        "kvatlas.cli.engine", "--model", "tiny-random", "--port", str(port), "--no-cache",
        "--max-model-len", "2048",
    )  # fmt: skip
    survivor = fleet.engines[1]
    # a generous start: torch's import alone takes a minute on a loaded 2-core machine
    with launch(argv, name="doomed", log=tmp_path / "doomed.log", http_port=port, timeout=300) as p:
        doomed = f"http://127.0.0.1:{port}"
        router = start_router(
            engines=(StaticEngine(doomed, "x"), StaticEngine(survivor.url, "node-b")),
            policy="round-robin",
        )
        wait_until(
            lambda: len(available(router)), lambda n: n == 2, what="both engines", timeout=60
        )
        # round-robin: after an answer from the survivor, the next request goes to the doomed
        while route(post(router, chat("warm up")))["engine"] != survivor.url:
            pass
        # a stream that is running on the doomed engine when it dies
        long = chat("tell a long story", max_tokens=1500, stream=True)
        with httpx.stream("POST", f"{router.url}/v1/chat/completions", json=long, timeout=60) as s:
            assert route(s)["engine"] == doomed
            lines = s.iter_lines()
            assert next(lines).startswith("data: ")
            with concurrent.futures.ThreadPoolExecutor(6) as pool:
                futures = [
                    pool.submit(
                        httpx.post,
                        f"{router.url}/v1/chat/completions",
                        json=chat(f"question {i}", max_tokens=40),
                        timeout=60,
                    )
                    for i in range(6)
                ]
                p.popen.send_signal(signal.SIGKILL)
                codes = [f.result().status_code for f in futures]
            rest = list(lines)
        assert codes == [200] * 6
        assert any("broke off this answer" in line for line in rest), rest[-3:]
        wait_until(
            lambda: available(router),
            lambda v: v == [survivor.url],
            what="the doomed engine out",
            timeout=60,
        )
        for i in range(3):
            assert route(post(router, chat(f"after {i}")))["engine"] == survivor.url
        status = {e.url: e for e in router.status().engines}
        assert not status[doomed].healthy and status[doomed].errors >= 1


def test_a_token_id_prompt_is_routed_without_a_tokenize(fleet: Fleet) -> None:
    router = fleet.router(policy="kv")
    wait_until(lambda: len(available(router)), lambda n: n == 2, what="both engines")
    body = {"prompt": [7 + i % 240 for i in range(600)], "max_tokens": 2, "temperature": 0}

    def routed() -> dict[str, str]:
        r = httpx.post(f"{router.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return route(r)

    first = routed()
    again = wait_until(routed, lambda r: r["cached"] == "512", what="the prefix is known")
    assert again["engine"] == first["engine"] and again["reason"] == "kv: prefix"
    metrics = httpx.get(f"{router.url}/metrics", timeout=5).text
    assert "kvatlas_router_tokenize_seconds_count 0.0" in metrics
    assert re.search(r"kvatlas_router_lookup_seconds_count [1-9]", metrics)


def test_a_prefix_just_sent_follows_its_engine_before_the_coordinator_knows(
    fleet: Fleet,
) -> None:
    # a model name nobody hashes under: the coordinator answers, but never a holder
    blind = fleet.router(policy="kv", model_name="nobody")
    forgetful = fleet.router(policy="kv", model_name="nobody", pending_ttl_s=0.001)
    body = {"prompt": [3 + i % 200 for i in range(700)], "max_tokens": 2, "temperature": 0}
    for router in (blind, forgetful):
        wait_until(partial(available, router), lambda urls: len(urls) == 2, what="engines")

    def send(router: RouterApp) -> dict[str, str]:
        r = httpx.post(f"{router.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return route(r)

    first = send(blind)
    for _ in range(3):
        again = send(blind)
        assert again["engine"] == first["engine"] and again["cached"] == "512", again
        assert again["reason"] == "kv: prefix"
    send(forgetful)
    assert send(forgetful)["reason"] == "kv: load"


def test_a_prefix_still_prefilling_draws_the_next_request_for_it(fleet: Fleet) -> None:
    """The first request is noted when it is sent, not when its engine answers: a second
    request for the same prefix that arrives while the first is in flight joins it on its
    engine instead of computing the prefix again on the idle one."""
    # a model name nobody hashes under: only the router's own notes can place it
    router = fleet.router(policy="kv", model_name="nobody")
    wait_until(lambda: len(available(router)), lambda n: n == 2, what="both engines")
    doc = [5 + i % 230 for i in range(768)]
    long = {"prompt": doc, "max_tokens": 1200, "temperature": 0, "ignore_eos": True}

    def in_flight() -> dict[str, int]:
        return {e.url: e.in_flight for e in router.status().engines if e.in_flight}

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        first = pool.submit(httpx.post, f"{router.url}/v1/completions", json=long, timeout=120)
        busy = wait_until(in_flight, lambda v: len(v) == 1, what="the first in flight")
        second = httpx.post(
            f"{router.url}/v1/completions",
            json={"prompt": [*doc, 9, 9, 9], "max_tokens": 2, "temperature": 0},
            timeout=120,
        )
        done = first.result()
    assert done.status_code == 200 and second.status_code == 200, second.text
    assert route(done)["engine"] in busy
    assert route(second)["engine"] == route(done)["engine"], route(second)
    assert route(second)["cached"] == "768" and route(second)["reason"] == "kv: prefix"


def test_a_server_advertises_its_engine_url_flag(fleet: Fleet, tmp_path: Any) -> None:
    silent = f"http://127.0.0.1:{free_port()}"
    node = start_server_process(
        tmp_path, "node-c", "--coordinator-url", fleet.coordinator.url,
        "--engine-url", silent + "/", "--l1-size-gb", "0.02",
    )  # fmt: skip
    try:
        router = fleet.router(policy="kv")
        seen = wait_until(
            lambda: {e.url: e for e in router.status().engines},
            lambda v: silent in v,
            what="the router lists node-c's engine",
        )
        assert seen[silent].instance_id == "node-c" and not seen[silent].available
        assert "/metrics failed" in seen[silent].last_error
    finally:
        node.stop()


def test_a_dead_first_coordinator_replica_is_failed_over(fleet: Fleet) -> None:
    """Listings and lookups go to the replica that answers; routing by the directory
    goes on as with one URL."""
    urls = sorted(e.advertised_url for e in fleet.engines)
    dead = f"http://127.0.0.1:{free_port()}"
    router = fleet.router(policy="kv", coordinator_urls=(dead, fleet.coordinator.url))
    wait_until(lambda: sorted(available(router)), lambda v: v == urls, what="both engines")
    assert router.status().coordinator_url == fleet.coordinator.url
    wait_until(
        lambda: route(post(router, chat(DOC)))["reason"],
        lambda reason: reason == "kv: prefix",
        what="a route by the prefix the second replica knows",
    )


def test_a_coordinator_outage_routes_by_load(fleet: Fleet) -> None:
    """Last in this module: it stops the fleet's coordinator."""
    router = fleet.router(policy="kv-p2p", lookup_timeout_s=0.5)
    wait_until(lambda: len(available(router)), lambda n: n == 2, what="both engines")
    assert route(post(router, chat(DOC)))["reason"].startswith("kv-p2p")
    fleet.coordinator.stop(signal.SIGKILL)
    reasons = [route(post(router, chat(DOC + str(i))))["reason"] for i in range(4)]
    assert reasons == ["least-loaded: lookup unavailable"] * 4
    metrics = httpx.get(f"{router.url}/metrics", timeout=5).text
    assert re.search(r'kvatlas_router_degraded_total\{step="lookup"\} [1-9]', metrics)
    assert len(available(router)) == 2  # the last listing is kept


def test_the_route_header_reads_in_every_form_the_router_emits() -> None:
    first = "engine=http://a:1; cached=512; reason=kv: prefix; overhead_ms=0.250"
    plain = httpx.Headers({"x-kvatlas-route": first})
    second = "engine=http://b:2; cached=0; reason=least-loaded: lookup unavailable; retry"
    again = httpx.Headers({"x-kvatlas-route": f"{second}; overhead_ms=3.000"})
    assert route(plain) == {
        "engine": "http://a:1", "cached": "512", "reason": "kv: prefix", "overhead_ms": "0.250"
    }  # fmt: skip
    assert not retried(plain)
    assert route(again)["reason"] == "least-loaded: lookup unavailable; retry"
    assert route(again)["overhead_ms"] == "3.000" and retried(again)


def test_cli_refuses_bad_flags_naming_them(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--engine", "nourl"]) == 2
    assert "--engine" in capsys.readouterr().err
    assert main([]) == 2
    assert "--coordinator-url" in capsys.readouterr().err
    assert main(["--coordinator-url", "http://127.0.0.1:1", "--weight-load", "-1"]) == 2
    assert "--weight-load" in capsys.readouterr().err
    assert main(["--coordinator-url", "http://127.0.0.1:1,http://127.0.0.1:1/"]) == 2
    assert "--coordinator-url names http://127.0.0.1:1 more than once" in capsys.readouterr().err
    for bad in ("0", "-2", "nan", "inf"):
        assert main(["--coordinator-url", "http://127.0.0.1:1", "--max-held-answer-mb", bad]) == 2
        err = capsys.readouterr().err
        assert "--max-held-answer-mb must be a positive size in MiB" in err, err
    args = build_parser().parse_args(
        ["--coordinator-url", "http://a:1", "--max-held-answer-mb", ".5"]
    )
    assert config_from_args(args).max_held_answer_bytes == 1 << 19


def test_coordinator_urls_repeat_or_separate_by_commas() -> None:
    a, b, c = (f"http://10.0.0.{i}:9300" for i in (1, 2, 3))
    args = build_parser().parse_args(["--coordinator-url", f"{a},{b}", "--coordinator-url", c])
    assert config_from_args(args).coordinator_urls == (a, b, c)


def test_no_engine_is_a_503_with_a_reason(start_router: StartRouter) -> None:
    router = start_router(engines=(StaticEngine(f"http://127.0.0.1:{free_port()}", "gone"),))
    r = httpx.post(f"{router.url}/v1/chat/completions", json=chat("hi"), timeout=10)
    assert r.status_code == 503 and "no engine is available" in r.json()["error"]["message"]
    assert httpx.get(f"{router.url}/readyz", timeout=5).status_code == 503
