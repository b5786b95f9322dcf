"""``kv-p2p`` prices a peer-held token with the rates the fleet measured: the engines'
prefill rate and their cache servers' P2P read rate, from the engines' ``/metrics``
(a real fleet with P2P between two cache servers, conftest's ``p2p_fleet``)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from kvatlas.router.app import RouterApp
from kvatlas.router.policy import Weights
from support.wait import wait_until

from .conftest import Fleet

FLAG = 0.5
"""``--weight-p2p``: what a peer token costs until the rates are measured."""


def status(router: RouterApp) -> dict[str, Any]:
    answer: dict[str, Any] = httpx.get(f"{router.url}/status", timeout=5).json()
    return answer


def counter(text: str, name: str) -> float:
    line = next(x for x in text.splitlines() if x.startswith(name + " "))
    return float(line.split()[1])


def test_the_p2p_weight_comes_from_the_measured_rates(p2p_fleet: Fleet) -> None:
    router = p2p_fleet.router(policy="kv-p2p", weights=Weights(p2p=FLAG))
    wait_until(
        lambda: [e["available"] for e in status(router)["engines"]],
        lambda v: v == [True, True],
        what="both engines",
    )
    before = status(router)
    assert before["p2p_tokens_per_s"] is None
    assert [e["p2p_weight"] for e in before["engines"]] == [FLAG, FLAG]
    home, other = p2p_fleet.engines
    body = {"prompt": [5 + i % 250 for i in range(700)], "max_tokens": 2, "temperature": 0}
    stats = {"kv_transfer_params": {"cached_token_stats": True}}

    def complete(url: str) -> dict[str, Any]:
        r = httpx.post(f"{url}/v1/completions", json={**body, **stats}, timeout=60)
        assert r.status_code == 200, r.text
        st: dict[str, Any] = r.json()["cached_token_stats"]
        return st

    # computed on one node, then read from it by the other (straight to the engines:
    # which engine does what is the test's choice, not a policy's)
    assert complete(home.advertised_url)["num_prefilled_tokens"] == 700
    wait_until(
        lambda: httpx.get(f"{p2p_fleet.coordinator.url}/directory/stats", timeout=5).json(),
        lambda s: s["keys"] >= 2,
        what="the coordinator knows the prompt's two full chunks",
    )
    # one request per engine: each meter then holds one interval, which the router's
    # rates must equal
    read = complete(other.advertised_url)
    assert read["num_peer_cached_tokens"] == 512 and read["num_prefilled_tokens"] == 700 - 512
    m = {e.advertised_url: httpx.get(f"{e.advertised_url}/metrics").text for e in (home, other)}
    prefill = {
        url: counter(t, "kvatlas_engine_prefill_seconds_total")
        / counter(t, "kvatlas_engine_prefilled_tokens_total")
        for url, t in m.items()
    }
    peer_tokens = counter(m[other.advertised_url], "kvatlas_engine_peer_cached_tokens_total")
    peer_s = counter(m[other.advertised_url], "kvatlas_engine_peer_fetch_seconds_total")
    assert peer_tokens >= 512 and peer_s > 0
    after = wait_until(
        lambda: status(router),
        lambda s: (
            s["p2p_tokens_per_s"] is not None
            and all(e["prefill_tokens_per_s"] for e in s["engines"])
        ),
        what="the router measured both rates",
    )
    assert after["p2p_tokens_per_s"] == pytest.approx(peer_tokens / peer_s, rel=0.01)
    for e in after["engines"]:
        assert e["prefill_tokens_per_s"] == pytest.approx(1 / prefill[e["url"]], rel=0.01)
        assert e["p2p_weight"] == pytest.approx(
            (peer_s / peer_tokens) / prefill[e["url"]], rel=0.01
        )
        assert e["p2p_weight"] != FLAG
    metrics = httpx.get(f"{router.url}/metrics", timeout=5).text
    assert f'kvatlas_router_engine_p2p_weight{{engine="{home.advertised_url}"}}' in metrics
    assert counter(metrics, "kvatlas_router_p2p_tokens_per_second") == pytest.approx(
        peer_tokens / peer_s, rel=0.01
    )
