"""``kvatlas router --auth-token``: the router's clients must bear the fleet's token, and
the client's own ``Authorization`` still reaches the engine byte for byte.

A real reference engine (the fleet's, on the tiny random model) behind an ``HttpTap`` that
records what the router put on the wire; routers in this process and one as a process
started by the command line.
"""

from __future__ import annotations

import re
from pathlib import Path

import httpx

from kvatlas.launch.procs import free_port
from kvatlas.router.config import StaticEngine
from support.launch import launch, python_module
from support.tap import HttpTap
from support.wait import wait_until

from .conftest import Fleet, StartRouter

TOKEN = "fleet-s3cret"
BODY = {"prompt": "Once upon a time", "max_tokens": 2, "temperature": 0}


def refusal(r: httpx.Response, reason: str) -> None:
    assert r.status_code == 401, r.text
    assert r.headers["www-authenticate"].startswith("Bearer")
    error = r.json()["error"]
    assert error["type"] == "authentication_error" and error["code"] == f"{reason}_token"
    assert "--auth-token" in error["message"] and "Proxy-Authorization" in error["message"]
    assert TOKEN not in r.text


def test_the_token_gates_every_path_but_the_probes(fleet: Fleet, start_router: StartRouter) -> None:
    engine = fleet.engines[0]
    with HttpTap(engine.port) as tap:
        # probes every 1 s with a 2 s deadline: a loaded machine must not take the one
        # engine out between two requests
        router = start_router(
            engines=(StaticEngine(tap.url, "node-a"),),
            policy="round-robin",
            auth_token=TOKEN,
            health_interval_s=1.0,
        )
        wait_until(lambda: router.status().engines[0].available, what="the tapped engine")
        base = router.url
        for path in ("/healthz", "/readyz"):
            assert httpx.get(base + path, timeout=10).status_code == 200, path

        refusal(httpx.post(f"{base}/v1/completions", json=BODY, timeout=10), "missing")
        refusal(httpx.post(f"{base}/v1/chat/completions", json={}, timeout=10), "missing")
        for path in ("/v1/models", "/metrics", "/status"):
            refusal(httpx.get(base + path, timeout=10), "missing")
        wrong = {"Authorization": f"Bearer {TOKEN}x", "Proxy-Authorization": "Bearer nope"}
        refusal(httpx.post(f"{base}/v1/completions", json=BODY, headers=wrong, timeout=10), "wrong")
        refusal(httpx.get(f"{base}/metrics", headers={"Authorization": TOKEN}, timeout=10), "wrong")
        assert not [q for q in tap.requests if q.target.startswith("/v1/")]

        # the token in Authorization: admitted, and the header goes on as it came
        bearer = {"Authorization": f"Bearer {TOKEN}", "X-Request-Id": "auth-1"}
        r = httpx.post(f"{base}/v1/completions", json=BODY, headers=bearer, timeout=60)
        assert r.status_code == 200, r.text
        # the token in Proxy-Authorization: the client's Authorization (the engines' own
        # key) goes on byte for byte, the router's token does not
        both = {
            "Authorization": "Bearer engine-key \t;=",
            "Proxy-Authorization": f"Bearer {TOKEN}",
            "X-Request-Id": "auth-2",
        }
        r = httpx.post(f"{base}/v1/completions", json=BODY, headers=both, timeout=60)
        assert r.status_code == 200, r.text
        sent = {
            q.headers["x-request-id"]: q.headers
            for q in tap.requests
            if q.target == "/v1/completions"
        }
        assert sent["auth-1"]["authorization"] == f"Bearer {TOKEN}"
        assert sent["auth-2"]["authorization"] == "Bearer engine-key \t;="
        assert "proxy-authorization" not in sent["auth-1"] | sent["auth-2"]

        metrics = httpx.get(f"{base}/metrics", headers=bearer, timeout=10).text
        assert re.search(r'kvatlas_router_auth_refusals_total\{reason="missing"\} 5\.0', metrics)
        assert re.search(r'kvatlas_router_auth_refusals_total\{reason="wrong"\} 2\.0', metrics)
        assert re.search(
            r'kvatlas_router_requests_total\{code="200",endpoint="/v1/completions"\} 2\.0', metrics
        )


def test_without_a_token_nothing_is_asked(fleet: Fleet, start_router: StartRouter) -> None:
    router = start_router(
        engines=(StaticEngine(fleet.engines[0].url, "node-a"),), health_interval_s=1.0
    )
    wait_until(lambda: router.status().engines[0].available, what="the engine")
    headers = {"Authorization": "Bearer anything"}
    assert httpx.post(f"{router.url}/v1/completions", json=BODY, timeout=60).status_code == 200
    r = httpx.post(f"{router.url}/v1/completions", json=BODY, headers=headers, timeout=60)
    assert r.status_code == 200
    metrics = httpx.get(f"{router.url}/metrics", timeout=10).text
    assert not re.search(r"^kvatlas_router_auth_refusals_total\{", metrics, re.M)


def test_the_command_reads_the_token_file(fleet: Fleet, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(f"{TOKEN}\n")
    port = free_port()
    argv = python_module(
        "kvatlas.cli.router", "--port", str(port), "--auth-token-file", str(token_file),
        "--engine", f"{fleet.engines[0].url}=node-a", "--policy", "least-loaded",
        "--health-interval", "1",
    )  # fmt: skip
    with launch(argv, name="router", log=tmp_path / "router.log", http_port=port) as proc:
        wait_until(
            lambda: httpx.get(f"{proc.url}/readyz", timeout=5).status_code,
            lambda code: code == 200,
            what="the router's engine",
        )
        refusal(httpx.post(f"{proc.url}/v1/completions", json=BODY, timeout=10), "missing")
        headers = {"Proxy-Authorization": f"Bearer {TOKEN}"}
        r = httpx.post(f"{proc.url}/v1/completions", json=BODY, headers=headers, timeout=60)
        assert r.status_code == 200, r.text
