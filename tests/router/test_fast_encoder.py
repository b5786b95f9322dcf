"""The router's fast encoder (fastokens on the tokenizer's own ``tokenizer.json``): the
same ids as Hugging Face ``tokenizers`` on SmolLM2's byte-level BPE for texts drawn
from what its pre-tokenizer and added tokens treat differently; taken only after its
self-test, refused when it gives other ids, absent without the package; and cheap
enough that the router runs it on its event loop, never beside the tokenizer's thread.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
import threading
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvatlas.cli.router import build_parser, main
from kvatlas.engine.model import HFTokenizer, load_tokenizer
from kvatlas.router.config import RouterConfig
from kvatlas.router.service import RouterService
from kvatlas.tokenize.fast_encoder import FastEncoder, load_fast_encoder, self_test_texts
from kvatlas.tokenize.loading import HubTokenizer
from kvatlas.tokenize.loading import load_tokenizer as load_hub
from kvatlas.tokenize.prompts import INLINE_MAX_BYTES, PromptTokenizer, RustTokenizer, pack_ids

from .test_token_cache import PARTS
from .test_tokenizer import BODIES

texts = st.one_of(
    st.lists(st.sampled_from(PARTS), max_size=150).map("".join),
    st.text(max_size=400),
    st.text(st.characters(codec="utf-8"), max_size=200),
)


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


@pytest.fixture(scope="module")
def fast(hf: HFTokenizer) -> FastEncoder:
    encoder, why = load_fast_encoder(hf.inner.backend_tokenizer)
    assert encoder is not None, why
    assert re.fullmatch(r"fastokens: the same ids on a \d+-text self-test", why)
    return encoder


@settings(
    max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(batch=st.lists(texts, min_size=1, max_size=4))
def test_fast_ids_are_the_tokenizers(hf: HFTokenizer, fast: FastEncoder, batch: list[str]) -> None:
    """Equal ids, or a refusal (ValueError) where tokenizers drops a byte the vocabulary
    has no token for: the router then encodes that text the tokenizer's own way."""
    backend = hf.inner.backend_tokenizer
    want = [pack_ids(e.ids) for e in backend.encode_batch_fast(batch, add_special_tokens=False)]
    try:
        got = fast.blobs(batch)
    except ValueError as exc:
        assert "has no token in vocabulary" in str(exc), batch
        return
    assert got == want, batch
    one = backend.encode(batch[0], add_special_tokens=False)  # tokenizers' single-text path
    assert fast.blobs([batch[0]])[0] == pack_ids(one.ids)


def test_what_the_fast_encoder_refuses_the_tokenizer_encodes(
    hf: HFTokenizer, hub: HubTokenizer
) -> None:
    """U+40000's first UTF-8 byte (0xf1) has no token in SmolLM2's vocabulary from its
    GGUF: tokenizers drops it, fastokens refuses the text. The router's ids are still
    the engine's, and the refusal is counted."""
    tok = PromptTokenizer(hub, "smollm2-135m", cache_bytes=1 << 20)
    text = "before \U00040000 after " * 3
    with pytest.raises(ValueError, match="has no token in vocabulary"):
        load_fast_encoder(hf.inner.backend_tokenizer)[0].blobs([text])  # type: ignore[union-attr]
    body = json.dumps({"prompt": text}).encode()
    assert tok.blob(body) == pack_ids(hf.encode(text)) and tok.ids(body) == hf.encode(text)
    assert tok.encoder.startswith("fastokens") and tok.cache_stats()["fast_refused"] == 2
    metrics = RouterService(RouterConfig(), None, tokenizer=tok).metrics.render().decode()
    assert "kvatlas_router_tokenize_fast_refused_total 2.0" in metrics


class _OtherMerges:
    """SmolLM2's Rust tokenizer, but what it hands fastokens has lost some merges: a
    fast encoder that is not the same tokenizer."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    def to_str(self) -> str:
        spec = json.loads(self._backend.to_str())
        del spec["model"]["merges"][200:400]
        return json.dumps(spec)


def test_a_fast_encoder_with_other_ids_is_refused(hf: HFTokenizer) -> None:
    backend = hf.inner.backend_tokenizer
    encoder, why = load_fast_encoder(_OtherMerges(backend))
    assert encoder is None and "gave other ids than the tokenizer for" in why
    # the corpus it was refused on covers every added token, inside text too
    corpus = self_test_texts(backend)
    assert "<|im_start|>" in corpus and any("a <|im_end|> b" in t for t in corpus)


def test_without_fastokens_the_tokenizers_own_encoder_serves(
    hf: HFTokenizer, monkeypatch: pytest.MonkeyPatch, hub: HubTokenizer
) -> None:
    monkeypatch.setitem(sys.modules, "fastokens", None)  # an import of it fails
    assert load_fast_encoder(hf.inner.backend_tokenizer) == (None, "fastokens is not installed")
    slow = PromptTokenizer(hub, "smollm2-135m", cache_bytes=1 << 20)
    assert slow.encoder == "tokenizers (fastokens is not installed)"
    assert not slow.inline_ok(b"{}") and slow.verify(b'{"prompt":"x"}', b"") is None
    monkeypatch.undo()
    quick = PromptTokenizer(hub, "smollm2-135m", cache_bytes=1 << 20)
    assert quick.encoder.startswith("fastokens (fastokens: the same ids")
    asked_not = PromptTokenizer(hub, "smollm2-135m", fast=False)
    assert asked_not.encoder == "tokenizers (not asked for)"
    for body in [*BODIES, *BODIES]:
        raw = json.dumps(body).encode()
        assert slow.blob(raw) == quick.blob(raw) == asked_not.blob(raw), body


def test_the_router_tokenizes_inline_only_when_cheap_and_its_thread_is_idle(
    hf: HFTokenizer, hub: HubTokenizer
) -> None:
    tok = PromptTokenizer(hub, "smollm2-135m", cache_bytes=1 << 20)
    small = json.dumps({"prompt": "a shared document. " * 200}).encode()
    big = json.dumps({"prompt": "word " * (INLINE_MAX_BYTES // 5 + 10)}).encode()
    assert tok.inline_ok(small) and not tok.inline_ok(big)

    async def run() -> tuple[list[bytes | None], str]:
        service = RouterService(RouterConfig(), None, tokenizer=tok)
        await service.start()  # readies the fast encoder on the loop's and the pool's thread
        try:
            first = await service.tokens.encode([], small)
            # while the thread works on the big body, a small one queues behind it
            both = await asyncio.gather(
                service.tokens.encode([], big), service.tokens.encode([], small)
            )
            return [first, *both], service.metrics.render().decode()
        finally:
            await service.close()

    blobs, metrics = asyncio.run(run())
    assert blobs[0] == blobs[2] == tok.blob(small) and blobs[1] == tok.blob(big)
    assert 'kvatlas_router_tokenized_total{where="inline"} 1.0' in metrics
    assert 'kvatlas_router_tokenized_total{where="thread"} 2.0' in metrics


def test_cli_names_the_encoder_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert build_parser().parse_args(["--tokenizer-encoder", "tokenizers"]).tokenizer_encoder == (
        "tokenizers"
    )
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--tokenizer-encoder", "tiktoken"])
    assert "--tokenizer-encoder: invalid choice: 'tiktoken'" in capsys.readouterr().err


def _metric(text: str, name: str) -> float:
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


async def _tokenize_and_wait_for_checks(
    service: RouterService, bodies: list[bytes], checks: int
) -> str:
    """Tokenize ``bodies`` one after the other, each after the previous one's check
    ended; the router's metrics once ``checks`` checks are counted (10 s at most)."""
    for body in bodies:
        blob = await service.tokens.encode([], body)
        assert blob is not None and service.tokenizer is not None
        service.checks.maybe_check(body, blob)  # as plan() does after choosing
        for _ in range(1000):
            if not service.checks.running:
                break
            await asyncio.sleep(0.01)
    text = service.metrics.render().decode()
    name = "kvatlas_router_tokenize_verified_total"
    counted = _metric(text, f'{name}{{result="same"}}') + _metric(
        text, f'{name}{{result="different"}}'
    )
    assert counted == checks, text
    return text


def test_live_prompts_are_checked_against_the_tokenizers_own_encoder(
    hf: HFTokenizer, hub: HubTokenizer
) -> None:
    tok = PromptTokenizer(hub, "smollm2-135m", cache_bytes=1 << 20)
    bodies = [json.dumps(b).encode() for b in BODIES]

    async def run() -> str:
        service = RouterService(RouterConfig(tokenizer_verify_every=2), None, tokenizer=tok)
        await service.start()
        try:
            return await _tokenize_and_wait_for_checks(service, bodies, len(bodies) // 2)
        finally:
            await service.close()

    text = asyncio.run(run())
    assert (
        _metric(text, 'kvatlas_router_tokenize_verified_total{result="same"}') == len(BODIES) // 2
    )
    assert tok.encoder.startswith("fastokens")


def test_a_fast_encoder_that_differs_on_a_live_prompt_is_switched_off(
    hf: HFTokenizer, hub: HubTokenizer
) -> None:
    """A fast encoder that passed no self-test (its merges cut) stands in: the first
    checked prompt shows it, and from the next one on the tokenizer's own encoder
    serves, its piece cache emptied of what the fast one put there."""
    tok = PromptTokenizer(hub, "smollm2-135m", cache_bytes=1 << 20)
    rust = tok._tokenizer
    assert isinstance(rust, RustTokenizer)
    other = json.loads(_OtherMerges(hf.inner.backend_tokenizer).to_str())
    module = pytest.importorskip("fastokens")
    rust.fast = FastEncoder(module.Tokenizer.from_json_str(json.dumps(other)), False)
    text = "The merges of this encoder were cut, so its ids differ. " * 20
    body = json.dumps({"prompt": text}).encode()
    assert tok.blob(body) != pack_ids(hf.encode(text))  # the stand-in is wrong

    async def run() -> str:
        service = RouterService(RouterConfig(tokenizer_verify_every=1), None, tokenizer=tok)
        await service.start()
        try:
            return await _tokenize_and_wait_for_checks(service, [body], 1)
        finally:
            await service.close()

    metrics = asyncio.run(run())
    assert 'kvatlas_router_tokenize_verified_total{result="different"} 1.0' in metrics
    assert tok.blob(body) == pack_ids(hf.encode(text))
    assert tok.encoder == (
        "tokenizers (switched off: other ids than the tokenizer's own on a live prompt)"
    )
    assert not tok.inline_ok(body) and tok.cache_stats()["entries"] >= 1


def test_cli_refuses_a_negative_check_rate(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--engine", "http://127.0.0.1:1=x", "--port", "0", "--tokenizer", "tiny-random"]
    assert main([*argv, "--tokenizer-verify-every", "-1"]) == 2
    assert "--tokenizer-verify-every must be in [0, 1000000], got -1" in capsys.readouterr().err


class _SlowFirst:
    """A ``LocalTokenizer`` whose first body of ``hold`` blocks until ``release`` is set
    (a tokenize that outlives the router's deadline), and that records how many of its
    calls ever ran at once."""

    source = "slow-first"
    encoder = "test (a tokenizer that holds one body)"

    def __init__(self, hold: bytes) -> None:
        self.hold = hold
        self.release = threading.Event()
        self._lock = threading.Lock()
        self._running = 0
        self.most_at_once = 0

    def blob(self, body: bytes) -> bytes:
        with self._lock:
            self._running += 1
            self.most_at_once = max(self.most_at_once, self._running)
        try:
            if body == self.hold:
                self.release.wait(30)
            return pack_ids([len(body)])
        finally:
            with self._lock:
                self._running -= 1

    def inline_ok(self, body: bytes) -> bool:
        return body != self.hold

    def warm(self) -> None:
        pass

    def verify(self, body: bytes, blob: bytes) -> bool | None:
        return None

    def distrust(self, why: str) -> None:
        pass

    def cache_stats(self) -> dict[str, float]:
        return {}


def test_the_prompts_after_a_tokenize_past_its_deadline_never_run_beside_it() -> None:
    """A tokenize on the thread outlives the deadline (that request is routed by load);
    the prompts after it queue on the thread while it still runs, never inline beside
    it, and run inline again once it has ended."""
    slow = _SlowFirst(b'{"prompt":"held"}')
    small = b'{"prompt":"small"}'

    async def run() -> tuple[list[bytes | None], str]:
        service = RouterService(RouterConfig(lookup_timeout_s=0.2), None, tokenizer=slow)
        try:
            held = await service.tokens.encode([], slow.hold)  # past its deadline
            behind = await service.tokens.encode([], small)  # queued behind it: past too
            slow.release.set()
            for _ in range(500):
                if not service.tokens.busy:
                    break
                await asyncio.sleep(0.01)
            after = await service.tokens.encode([], small)
            return [held, behind, after], service.metrics.render().decode()
        finally:
            slow.release.set()
            await service.close()

    (held, behind, after), metrics = asyncio.run(run())
    assert held is None and behind is None and after == pack_ids([len(small)])
    assert slow.most_at_once == 1  # "behind" did not run inline: it would have answered
    assert 'kvatlas_router_degraded_total{step="tokenize"} 2.0' in metrics
    assert 'kvatlas_router_tokenized_total{where="inline"} 1.0' in metrics
