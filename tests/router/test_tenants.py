"""Tenants share the fleet, not their prompts: a real fleet with tokens (a coordinator and
two cache servers as processes, P2P between them over tcp, two reference engines on the
tiny model) behind ``kvatlas router --tenants``.

The paired suite: the same document under the same salt hits (locally and over P2P),
under another tenant's salt, with no salt, or salted against unsalted KV it misses; a
shared namespace hits across its members. The oracle test: a tenant tries every route it
can reach to learn whether another tenant's prompt is cached, and learns nothing.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvatlas.core.tenancy import TenantTable, key_digest
from kvatlas.engine.config import CacheLinkConfig
from kvatlas.engine.engine_app import EngineApp
from kvatlas.engine.model import LoadedModel
from kvatlas.launch.procs import HOST, free_port
from kvatlas.router.app import RouterApp
from kvatlas.router.config import RouterConfig
from kvatlas.router.service import ROUTE_HEADER
from support.launch import Proc
from support.services import ServerProc, start_coordinator_process, start_server_process
from support.wait import wait_until

from .conftest import engine_config

FLEET = "fleet-token-" + "f" * 20
OPERATOR = "operator-token-" + "o" * 20
KEY_A, KEY_B, KEY_C = "sk-tenant-a-1", "sk-tenant-b-1", "sk-tenant-c-1"
TENANTS = f"""
secret = "{"s" * 40}"
client_salt = "replace"

[shared]
public = ["a", "b"]

[tenants.a]
api_keys = ["sha256:{key_digest(KEY_A).hex()}"]

[tenants.b]
api_keys = ["{KEY_B}"]

[tenants.c]
api_keys = ["{KEY_C}"]
"""
CHUNK = 256
DOC_TOKENS = 4 * CHUNK + 40
"""Four full chunks and a partial one (always recomputed)."""


@dataclass
class TenantFleet:
    coordinator: Proc
    servers: list[ServerProc]
    engines: list[EngineApp]
    router: RouterApp
    table: TenantTable
    tenants_file: Path

    def ask(self, key: str | None, body: dict[str, Any], path: str = "/v1/completions") -> Any:
        headers = {"authorization": f"Bearer {key}"} if key else {}
        return httpx.post(f"{self.router.url}{path}", json=body, headers=headers, timeout=120)


def doc(seed: int, n: int = DOC_TOKENS) -> list[int]:
    return [(seed * 7919 + i * 31) % 250 + 5 for i in range(n)]


def completion(prompt: list[int], **extra: Any) -> dict[str, Any]:
    return {
        "prompt": prompt,
        "max_tokens": 1,
        "temperature": 0,
        "kv_transfer_params": {"cached_token_stats": True},
        **extra,
    }


def cached(answer: httpx.Response) -> int:
    assert answer.status_code == 200, answer.text
    body = answer.json()
    n: int = body["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert body["cached_token_stats"]["num_cached_tokens"] == n
    return n


@pytest.fixture(scope="module")
def tfleet(tmp_path_factory: pytest.TempPathFactory, tiny: LoadedModel) -> Iterator[TenantFleet]:
    tmp = tmp_path_factory.mktemp("tenant-fleet")
    token_file = tmp / "fleet.token"
    token_file.write_text(FLEET + "\n")
    tenants_file = tmp / "tenants.toml"
    tenants_file.write_text(TENANTS)
    coordinator = start_coordinator_process(
        "--auth-token-file", str(token_file), log=tmp / "coordinator.log"
    )
    servers: list[ServerProc] = []
    engines: list[EngineApp] = []
    router: RouterApp | None = None
    try:
        for name in ("node-a", "node-b"):
            flags = [
                "--coordinator-url", coordinator.url, "--auth-token-file", str(token_file),
                "--coordinator-heartbeat-interval", "0.5", "--event-flush-interval", "0.05",
                "--l1-size-gb", "0.05", "--engine-workers", "2",
                "--p2p-advertise-url", f"{HOST}:{free_port()}", "--p2p-transfer-engine", "tcp",
            ]  # fmt: skip
            servers.append(start_server_process(tmp, name, *flags))
        for server in servers:
            link = CacheLinkConfig(port=server.port, auth_token=FLEET)
            app = EngineApp(engine_config(cache=link), model=tiny)
            app.start()
            engines.append(app)
        router = RouterApp(
            RouterConfig(
                port=0,
                coordinator_urls=(coordinator.url,),
                policy="kv-p2p",
                auth_token=FLEET,
                operator_token=OPERATOR,
                tenants_file=str(tenants_file),
                refresh_interval_s=0.2,
                health_interval_s=0.2,
                lookup_timeout_s=2.0,
                seed=1,
            )
        )
        router.start()
        wait_until(
            lambda: sum(e.available for e in router.status().engines),
            lambda n: n == 2,
            what="both engines behind the router",
        )
        table = TenantTable.from_document(tomllib.loads(TENANTS))
        yield TenantFleet(coordinator, servers, engines, router, table, tenants_file)
    finally:
        if router is not None:
            router.stop()
        for e in engines:
            e.stop()
        for s in servers:
            s.stop()
        coordinator.stop()


def keys_known(f: TenantFleet) -> int:
    """The keys the coordinator's directory holds."""
    stats = httpx.get(
        f"{f.coordinator.url}/directory/stats",
        headers={"authorization": f"Bearer {FLEET}"},
        timeout=5,
    ).json()
    n: int = stats["keys"]
    return n


def _wait_known(f: TenantFleet, keys: int) -> None:
    wait_until(
        lambda: keys_known(f), lambda n: n >= keys, what=f"the coordinator knows {keys} keys"
    )


def test_same_salt_hits_other_salts_and_no_salt_miss_at_every_tier(tfleet: TenantFleet) -> None:
    """Straight to the engines, with the salts the router would derive: the owner's node
    (L1), the other node (P2P), each against another tenant, no salt, and the reverse."""
    home, other = (e.advertised_url for e in tfleet.engines)
    salt_a = tfleet.table.tenants["a"].salt
    salt_b = tfleet.table.tenants["b"].salt
    prompt = doc(1)

    def direct(url: str, salt: str | None) -> dict[str, Any]:
        body = completion(prompt, **({"cache_salt": salt} if salt else {}))
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        stats: dict[str, Any] = r.json()["cached_token_stats"]
        return stats

    known = keys_known(tfleet)
    assert direct(home, salt_a)["num_cached_tokens"] == 0  # cold: computed under a's salt
    _wait_known(tfleet, known + 4)
    assert direct(home, salt_a)["num_cached_tokens"] == 4 * CHUNK  # L1, same salt
    for salt in (salt_b, None):
        got = direct(home, salt)
        assert got["num_cached_tokens"] == 0, salt  # same node, another namespace
    # (those two misses stored b's and an unsalted copy on home: they are theirs now)
    # the other node: a peer read for a's salt, nothing for a salt that stored none
    assert direct(other, tfleet.table.tenants["c"].salt)["num_cached_tokens"] == 0
    got = direct(other, salt_a)
    assert got["num_cached_tokens"] == 4 * CHUNK and got["num_peer_cached_tokens"] == 4 * CHUNK
    # the reverse: unsalted KV is no salted request's
    plain = doc(2)
    known = keys_known(tfleet)
    first = httpx.post(f"{home}/v1/completions", json=completion(plain), timeout=120)
    assert cached(first) == 0
    _wait_known(tfleet, known + 4)
    again = httpx.post(f"{home}/v1/completions", json=completion(plain), timeout=120)
    assert cached(again) == 4 * CHUNK
    # (each miss stores its own copy: a second salt for the second node)
    for url, salt in ((home, salt_a), (other, salt_b)):
        r = httpx.post(
            f"{url}/v1/completions", json=completion(plain, cache_salt=salt), timeout=120
        )
        assert cached(r) == 0


def test_through_the_router_a_tenant_hits_its_own_and_no_one_else_does(
    tfleet: TenantFleet,
) -> None:
    prompt = doc(3)
    known = keys_known(tfleet)
    assert cached(tfleet.ask(KEY_A, completion(prompt))) == 0
    _wait_known(tfleet, known + 4)
    repeat = tfleet.ask(KEY_A, completion(prompt))
    assert cached(repeat) >= 0.9 * 4 * CHUNK
    assert ROUTE_HEADER not in repeat.headers  # a tenant is never told how it was routed
    known = keys_known(tfleet)
    for key in (KEY_B, KEY_C, FLEET):  # the fleet's token: a request of no tenant, unsalted
        r = tfleet.ask(key, completion(prompt))
        assert cached(r) == 0, key
        assert ROUTE_HEADER not in r.headers
    # a client's own cache_salt is replaced by its tenant's: b now hits b's own copy
    mine = tfleet.ask(KEY_B, completion(prompt, cache_salt="whatever-a-used"))
    assert cached(mine) == 4 * CHUNK
    # b's, c's and the fleet's own copies are new keys: three namespaces, four each
    _wait_known(tfleet, known + 12)
    # the operator is told, and is a request of no tenant too
    op = tfleet.ask(OPERATOR, completion(prompt))
    assert cached(op) == 4 * CHUNK  # the fleet token's request above stored it unsalted
    assert "cached=" in op.headers[ROUTE_HEADER]


def test_a_shared_namespace_is_shared_by_its_members_only(tfleet: TenantFleet) -> None:
    prompt = doc(4)
    shared = completion(prompt, cache_salt="shared:public")
    known = keys_known(tfleet)
    assert cached(tfleet.ask(KEY_A, shared)) == 0
    _wait_known(tfleet, known + 4)
    assert cached(tfleet.ask(KEY_B, shared)) == 4 * CHUNK  # another member hits
    assert cached(tfleet.ask(KEY_A, completion(prompt))) == 0  # a's own namespace: no
    refused = tfleet.ask(KEY_C, shared)  # c is not a member
    assert refused.status_code == 403, refused.text
    assert "public" in refused.json()["error"]["message"]


def test_the_oracle_a_tenant_learns_nothing_of_anothers_prompt(tfleet: TenantFleet) -> None:
    """Tenant b, with every route it can reach, asks whether a's secret prompt is cached:
    every answer is the same as for a prompt nobody ever sent."""
    secret, never = doc(5), doc(6)
    known = keys_known(tfleet)
    assert cached(tfleet.ask(KEY_A, completion(secret))) == 0
    _wait_known(tfleet, known + 4)
    assert cached(tfleet.ask(KEY_A, completion(secret))) == 4 * CHUNK

    def observe(prompt: list[int]) -> dict[str, Any]:
        seen: dict[str, Any] = {}
        for endpoint, body in (
            ("/v1/completions", completion(prompt)),
            ("/v1/completions", completion(prompt, stream=True)),
            ("/v1/completions", completion(prompt, cache_salt="shared:public")),
        ):
            r = tfleet.ask(KEY_B, body, endpoint)
            assert r.status_code == 200, r.text
            if body.get("stream"):
                text = r.text
                seen[f"{endpoint} stream cached"] = '"num_cached_tokens":0' in text.replace(" ", "")
            else:
                answer = r.json()
                seen[f"{endpoint} {body.get('cache_salt')}"] = (
                    answer["usage"]["prompt_tokens_details"],
                    {
                        k: v
                        for k, v in answer["cached_token_stats"].items()
                        if not k.endswith("_ms") and k != "breakdown_ms"
                    },
                )
            seen[f"{endpoint} headers"] = sorted(
                k for k in r.headers if k not in ("date", "x-request-id", "content-length")
            )
        return seen

    # the shared namespace was not used for either prompt: both observations read cold
    # (b's first look at each stores them under b's salt, so each is looked at once)
    assert observe(secret) == observe(never)
    # the router's own figures and the coordinator are closed to a tenant's key
    for path in ("/metrics", "/status"):
        r = httpx.get(
            f"{tfleet.router.url}{path}", headers={"authorization": f"Bearer {KEY_B}"}, timeout=5
        )
        assert r.status_code == 403, (path, r.text)
    unknown = tfleet.ask("sk-not-a-key", completion(secret))
    assert unknown.status_code == 401 and unknown.json()["error"]["code"] == "unknown_key"
    assert tfleet.ask(None, completion(secret)).status_code == 401
    for path in ("/ui/fleet.json", "/directory/stats", "/directory/keys", "/instances"):
        r = httpx.get(
            f"{tfleet.coordinator.url}{path}",
            headers={"authorization": f"Bearer {KEY_B}"},
            timeout=5,
        )
        assert r.status_code == 401, (path, r.status_code)
    lookup = httpx.post(
        f"{tfleet.coordinator.url}/directory/lookup",
        json={"token_ids": secret, "model_name": "tiny-random-llama-s0"},
        headers={"authorization": f"Bearer {KEY_B}"},
        timeout=5,
    )
    assert lookup.status_code == 401


def test_tenants_reload_without_a_restart_and_a_bad_file_keeps_the_table(
    tfleet: TenantFleet,
) -> None:
    before = tfleet.tenants_file.read_text()
    new_key = "sk-tenant-d-1"
    try:
        tfleet.tenants_file.write_text(before + f'\n[tenants.d]\napi_keys = ["{new_key}"]\n')
        wait_until(
            lambda: tfleet.ask(new_key, completion(doc(7, 40))).status_code,
            lambda code: code == 200,
            what="the new tenant admitted",
        )
        tfleet.tenants_file.write_text("secret = 'short'\n")  # refused: the table stays
        metrics = f"{tfleet.router.url}/metrics"
        wait_until(
            lambda: (
                httpx.get(metrics, headers={"authorization": f"Bearer {OPERATOR}"}, timeout=5).text
            ),
            lambda t: 'kvatlas_router_tenant_reloads_total{outcome="failed"} 1.0' in t,
            what="the failed reload counted",
        )
        assert tfleet.ask(new_key, completion(doc(7, 40))).status_code == 200
        assert tfleet.ask(KEY_A, completion(doc(7, 40))).status_code == 200
    finally:
        tfleet.tenants_file.write_text(before)
        os.utime(tfleet.tenants_file)
    wait_until(
        lambda: tfleet.ask(new_key, completion(doc(7, 40))).status_code,
        lambda code: code == 401,
        what="the removed tenant refused",
    )


def test_per_tenant_figures_are_the_operators(tfleet: TenantFleet) -> None:
    tfleet.ask(KEY_C, completion(doc(8, 40)))
    text = httpx.get(
        f"{tfleet.router.url}/metrics", headers={"authorization": f"Bearer {OPERATOR}"}, timeout=5
    ).text
    assert 'kvatlas_router_tenant_requests_total{code="200",tenant="c"}' in text
