"""End to end: two vLLM engines (vLLM's own publisher) feed a real coordinator over
``--vllm-kv-events``; ``POST /directory/device-lookup`` names the engine whose prefix
cache holds a prompt, the metrics count it, and bad input is a 4xx with a reason."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvatlas.cli.coordinator import config_from_args
from kvatlas.coordinator.vllm.sources import parse_sources
from kvatlas.core.errors import ConfigError
from support.coordinator import RunningCoordinator
from support.wait import wait_until

from .test_vllm_ingest import BLOCK, _batch, _port, _prompt, _publisher, _stored

pytest.importorskip(
    "vllm.distributed.kv_events", reason="vLLM not installed (scripts/bootstrap.sh)"
)


@pytest.fixture
def engines() -> Iterator[dict[str, tuple[Any, str]]]:
    out: dict[str, tuple[Any, str]] = {}
    for name in ("a", "b"):
        pub_port, replay_port = _port(), _port()
        spec = (
            f"{name}=tcp://127.0.0.1:{pub_port},replay=tcp://127.0.0.1:{replay_port},"
            f"topic=kv-events,block_size={BLOCK},hash=sha256_cbor"
        )
        out[name] = (_publisher(pub_port, replay_port), spec)
    yield out
    for pub, _ in out.values():
        pub.shutdown()


def test_repeated_prompt_goes_to_the_engine_holding_it(
    engines: dict[str, tuple[Any, str]],
    start_coordinator: Callable[..., RunningCoordinator],
) -> None:
    rc = start_coordinator(
        vllm_kv_events=parse_sources([spec for _, spec in engines.values()]),
        max_lookup_tokens=4096,
    )
    engines["a"][0].publish(_batch(_stored(_prompt(1))))
    engines["b"][0].publish(_batch(_stored(_prompt(2)[: 2 * BLOCK])))

    def answer(tokens: list[int]) -> dict[str, Any]:
        r = rc.client.post("/directory/device-lookup", json={"token_ids": tokens})
        assert r.status_code == 200, r.text
        body: dict[str, Any] = r.json()
        return body

    wait_until(lambda: answer(_prompt(1))["best"] == "a", what="engine a's blocks")
    wait_until(lambda: answer(_prompt(2))["best"] == "b", what="engine b's blocks")
    got = answer([*_prompt(1), 7, 8, 9])
    assert got["engines"][0] == {
        "engine": "a",
        "tokens": 4 * BLOCK,
        "blocks": 4,
        "block_size": BLOCK,
        "media": ["GPU"],
        "tiers": [4, 0, 0],
    }
    assert got["engines"][1]["tokens"] == 0
    assert answer(_prompt(2))["engines"][0]["tokens"] == 2 * BLOCK
    assert answer(_prompt(3))["best"] is None
    metrics = rc.client.get("/metrics").text
    assert 'kvatlas_vllm_device_blocks{engine="a"} 4.0' in metrics
    assert 'kvatlas_vllm_events_batches_total{engine="b"} 1.0' in metrics

    # Blocks stored without a LoRA never answer a LoRA's prompt (the name seeds the keys).
    r = rc.client.post("/directory/device-lookup", json={"token_ids": _prompt(1), "lora_name": "x"})
    assert r.status_code == 200 and r.json()["best"] is None
    r = rc.client.post("/directory/device-lookup", json={"token_ids": list(range(5000))})
    assert r.status_code == 413 and "--max-lookup-tokens" in r.text
    r = rc.client.post("/directory/device-lookup", json={"tokens": [1]})
    assert r.status_code == 400
    r = rc.client.post("/directory/device-lookup", json={"token_ids": [2**63] * BLOCK})
    assert r.status_code == 400 and "2**32" in r.text, r.text

    doc = rc.client.get("/openapi.json").json()
    routes = {(r.path, r.method.lower()) for r in rc.coordinator.http.router.routes()}
    assert routes == {(p, m) for p, ops in doc["paths"].items() for m in ops}


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("e1", "ENGINE_ID=tcp://HOST:PORT"),
        ("e1=http://x:1", "tcp://HOST:PORT"),
        ("e1=tcp://127.0.0.1:5557,replay=tcp://h", "tcp://HOST:PORT"),
        ("e1=tcp://127.0.0.1:5557,hash=md5", "hash="),
        ("e1=tcp://127.0.0.1:5557,dp_size=0", "dp_size"),
        ("e1=tcp://127.0.0.1:5557,colour=red", "unknown option"),
        ("e1=tcp://127.0.0.1:5557,block_size", "KEY=VALUE"),
        ("e1=tcp://127.0.0.1:5557,url=ftp://h", "url="),
    ],
)
def test_bad_flag_values_name_the_flag(value: str, reason: str) -> None:
    with pytest.raises(ConfigError, match="--vllm-kv-events") as exc:
        config_from_args(["--vllm-kv-events", value], {})
    assert reason in str(exc.value)


def test_flag_parses_ranks_and_rejects_twice_named_engines() -> None:
    cfg = config_from_args(
        ["--vllm-kv-events", "e=tcp://h:5557,replay=tcp://h:5558,dp_size=3,hash=xxhash,seed=s"],
        {},
    )
    assert [(s.engine, s.endpoint, s.replay) for s in cfg.vllm_kv_events] == [
        ("e/dp0", "tcp://h:5557", "tcp://h:5558"),
        ("e/dp1", "tcp://h:5558", "tcp://h:5559"),
        ("e/dp2", "tcp://h:5559", "tcp://h:5560"),
    ]
    assert {(s.hash_algo, s.seed) for s in cfg.vllm_kv_events} == {("xxhash", "s")}
    with pytest.raises(ConfigError, match="named twice"):
        config_from_args(["--vllm-kv-events", "e=tcp://h:1", "--vllm-kv-events", "e=tcp://h:2"], {})
