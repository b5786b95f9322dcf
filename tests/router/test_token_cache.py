"""The router-side tokenizer's piece cache (``PieceCache`` through ``RustTokenizer``):
ids of a text = the ids of its pieces one after the other, where the pieces are cut;
texts sharing a prefix share its pieces; the cache stays in its bound and says so in the
router's metrics.

The ids through the cache are compared with the engine's own path (transformers,
whole text) on SmolLM2's byte-level BPE, for texts drawn from what its pre-tokenizer and
added tokens treat differently, sent in sequences that share prefixes (so that later
texts are served from pieces of earlier ones).
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvatlas.cli.router import main
from kvatlas.engine.model import HFTokenizer, load_tokenizer
from kvatlas.router.config import RouterConfig
from kvatlas.router.service import RouterService
from kvatlas.tokenize.fast_encoder import load_fast_encoder
from kvatlas.tokenize.loading import HubTokenizer
from kvatlas.tokenize.loading import load_tokenizer as load_hub
from kvatlas.tokenize.prompts import (
    PieceCache,
    PromptTokenizer,
    RustTokenizer,
    aligned_pieces,
    pack_ids,
    tokenize_ids,
)
from kvatlas.tokenize.request_shapes import decode_tokenize

from .test_tokenizer import BODIES

PARTS = [
    " ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", "\u00a0", "\u2003", "\u3000", " \n ",
    "word", "Words", "a", "I", "x1", "123", "4567890", "3.14", "'s", "'re", "'ll", "n't",
    "don't", "?!", "...", "--", "(", ")", "[x]", "{}", '"', "'", "#", "@", "$5", "_", "é",
    "Ünïcödé", "日本語", "テキスト", "\U0001f680", "\U0001f469\u200d\U0001f52c", "ﬁ",
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_start|>user\n", "\x1c", "\x0b",
    "<|im_", "start|>", "end", "|>", "<", ">",
]  # fmt: skip
texts = st.lists(st.sampled_from(PARTS), min_size=0, max_size=120).map("".join)


@pytest.fixture(scope="module")
def hf() -> HFTokenizer:
    tok = load_tokenizer("smollm2-135m")
    assert isinstance(tok, HFTokenizer)
    return tok


@pytest.fixture(scope="module")
def hub() -> HubTokenizer:
    """The router's own (no transformers), checked against ``hf``, the engine's."""
    tok = load_hub("smollm2-135m")
    assert isinstance(tok, HubTokenizer)
    return tok


def cached(
    hub: HubTokenizer,
    max_bytes: int = 1 << 20,
    *,
    every: int = 8,
    pieces: int = 1,
    fast: bool = False,
) -> RustTokenizer:
    tok = RustTokenizer(hub, hub.backend, pieces, PieceCache(max_bytes), every)
    assert tok.cache is not None, "SmolLM2's tokenizer may be cut"
    if fast:
        tok.fast, why = load_fast_encoder(hub.backend)
        assert tok.fast is not None, why
    return tok


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=texts, every=st.integers(1, 40), more=texts)
def test_aligned_pieces_cut_only_at_safe_spaces_and_keep_shared_prefixes(
    text: str, every: int, more: str
) -> None:
    pieces = aligned_pieces(text, every)
    assert "".join(pieces) == text and all(pieces[:-1])
    cuts = [sum(len(p) for p in pieces[:k]) for k in range(1, len(pieces))]
    for c in cuts:
        # a space after a printable ASCII character
        assert text[c] == " " and "!" <= text[c - 1] <= "~", (text, c)
    # a longer text with this prefix has the same pieces but the last
    longer = aligned_pieces(text + more, every)
    assert longer[: len(pieces) - 1] == pieces[:-1]


@pytest.mark.slow  # 150 examples through both tokenizers: 34 s measured on the 2-core VM
@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    prefix=texts,
    tails=st.lists(texts, min_size=1, max_size=4),
    every=st.sampled_from([1, 4, 8, 32]),
    pieces=st.sampled_from([1, 3]),
    max_bytes=st.sampled_from([2000, 1 << 20]),
    fast=st.booleans(),
)
def test_ids_through_the_cache_are_the_engines(
    hf: HFTokenizer,
    prefix: str,
    tails: list[str],
    every: int,
    pieces: int,
    max_bytes: int,
    fast: bool,
    hub: HubTokenizer,
) -> None:
    """Texts sharing a prefix, one after the other through one cache (a small one too,
    evicting as it goes), encoded by tokenizers or by the fast encoder: each text's ids
    are the engine's for the whole text."""
    tok = cached(hub, max_bytes, every=every, pieces=pieces, fast=fast)
    for tail in [*tails, *tails]:
        text = prefix + tail
        assert tok.encode_blob(text) == pack_ids(hf.encode(text)), text
    assert tok.cache is not None and tok.cache.bytes <= max_bytes


def test_a_shared_prefix_is_encoded_once(hf: HFTokenizer, hub: HubTokenizer) -> None:
    doc = "".join(f"Section {i}: what the fleet keeps about this document. " for i in range(200))
    tok = cached(hub, every=1024)
    cache = tok.cache
    assert cache is not None
    first = tok.encode_blob(doc + "First question?")
    assert cache.hits == 0 and cache.misses == len(cache) > 8
    second = tok.encode_blob(doc + "And a second one?")
    assert first != second and second == pack_ids(hf.encode(doc + "And a second one?"))
    # all pieces of the document but the one reaching into the question are reused
    assert cache.hits == cache.misses - 2 and cache.hit_tokens > 0.9 * len(second) // 4
    assert cache.hit_tokens + cache.miss_tokens == (len(first) + len(second)) // 4


def test_the_cache_stays_in_its_bound(hf: HFTokenizer) -> None:
    cache = PieceCache(4000)
    for i in range(100):
        cache.put(f"piece number {i}", pack_ids(range(i % 7 + 1)))
        assert cache.bytes <= 4000
    assert 0 < len(cache) < 100 and cache.evictions == 100 - len(cache)
    assert cache.get("piece number 0") is None and cache.get("piece number 99") is not None
    # one piece larger than an eighth of the cache is encoded but not kept
    assert cache.put("x" * 600, b"\0" * 4) == b"\0" * 4 and cache.get("x" * 600) is None
    stats = cache.stats()
    assert stats["hits"] == 1 and stats["misses"] == 2 and stats["max_bytes"] == 4000
    assert stats["entries"] == len(cache) and stats["bytes"] == cache.bytes
    with pytest.raises(ValueError, match="positive size"):
        PieceCache(0)


def test_bodies_through_the_cache_are_the_engines(hf: HFTokenizer, hub: HubTokenizer) -> None:
    """Every kind of body (chats with the template's special tokens, completions, token
    ids) twice: the second time partly from the cache, the same ids."""
    with_cache = PromptTokenizer(hub, "smollm2-135m", cache_bytes=1 << 20)
    without = PromptTokenizer(hub, "smollm2-135m", fast=False)  # tokenizers' own encoder
    assert without.cache_stats() == {}
    assert with_cache.encoder.startswith("fastokens")
    chat: list[dict[str, Any]] = [
        {"role": "system", "content": BODIES[1]["messages"][0]["content"]}
    ]
    bodies = [*BODIES, *BODIES]
    for turn in range(4):  # a growing multi-turn chat: earlier turns come again
        chat += [{"role": "user", "content": f"question {turn}?"}]
        bodies.append({"messages": list(chat)})
        chat += [{"role": "assistant", "content": f"answer {turn}."}]
    for body in bodies:
        raw = json.dumps(body).encode()
        engine = pack_ids(tokenize_ids(hf, decode_tokenize(raw), None))
        assert with_cache.blob(raw) == engine == without.blob(raw), body
    stats = with_cache.cache_stats()
    assert stats["hits"] > 0 and stats["hit_tokens"] > 1000


def test_the_router_exports_the_cache(hf: HFTokenizer, hub: HubTokenizer) -> None:
    tok = PromptTokenizer(hub, "smollm2-135m", cache_bytes=1 << 20)
    service = RouterService(RouterConfig(), None, tokenizer=tok)
    text = service.metrics.render().decode()
    assert 'kvatlas_router_tokenize_cache_pieces_total{result="hit"} 0.0' in text
    body = json.dumps({"prompt": "a shared document. " * 200}).encode()
    tok.blob(body)
    tok.blob(body)
    text = service.metrics.render().decode()
    hits = re.search(
        r'^kvatlas_router_tokenize_cache_tokens_total\{result="hit"\} (\S+)$', text, re.M
    )
    assert hits and float(hits.group(1)) > 500
    assert re.search(r"^kvatlas_router_tokenize_cache_capacity_bytes 1\.048576e\+06$", text, re.M)
    assert re.search(r"^kvatlas_router_tokenize_cache_bytes [1-9]", text, re.M)
    # without a cache: no such metrics
    bare = RouterService(RouterConfig(), None, tokenizer=PromptTokenizer(hub, "smollm2-135m"))
    assert "tokenize_cache" not in bare.metrics.render().decode()


def test_cli_refuses_a_negative_cache(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--engine", "http://127.0.0.1:1=x", "--port", "0", "--tokenizer", "tiny-random"]
    assert main([*argv, "--tokenizer-cache-mb", "-1"]) == 2
    assert "--tokenizer-cache-mb must be in [0, 1048576], got -1" in capsys.readouterr().err
