"""A second encoder for a Hugging Face Rust tokenizer, taken only once it proved itself.

Owns ``FastEncoder``: the same ``tokenizer.json`` (the Rust tokenizer's own serialization,
so the same vocabulary, merges, added tokens, normalizer and pre-tokenizer) loaded into
fastokens, an independent implementation of that pipeline that returns a text's ids as
little-endian uint32 bytes without making a Python int per token. It encodes a
prompt many times faster than ``tokenizers``, whose encode is most of what a router
adds to a request that brings new text (docs/benchmarks.md holds the figures).

It is another implementation, so it is not trusted by construction as ``tokenizers``'
own pipeline is: ``load_fast_encoder`` encodes a self-test corpus with both (ASCII and
other scripts, digits, runs of each kind of whitespace, punctuation, contractions, every
added token inside text, the chat template's own text) and returns nothing unless every
id agrees. A router keeps it only then, and can check it again on live prompts
(``verify``). What a wrong id would cost is bounded: the router's ids only choose where a
request runs (a wrong id misses in the coordinator's lookup); the engine tokenizes the
request again itself.

Must not: be used for a tokenizer it was not checked against, or decide what happens on
a mismatch (callers log, count and fall back).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any, Final

import numpy as np

_MODULE: Final = "fastokens"
_SCRIPTS: Final = (
    "The quick brown fox jumps over the lazy dog. It's 3:45pm; we'll see, won't we?",
    "naïve café résumé — \u201cquotes\u201d \u2018single\u2019 … Ünïcödé ß ø å",
    "日本語のテキストと中文文本\uff0c还有한국어 텍스트。",
    "emoji 😀👍🏽🚀 and symbols ©®™ ∑∫√ ≤≥ ≠ ←→",
    "numbers 0 7 42 1234567890 3.14159 -2e10 0x1F 1,000,000 12:30:45 2026-12-03",
    "  leading spaces\tand\ttabs\n\nnew lines\r\n  \n\t \n   trailing   ",
    "def f(x):\n    return {'a': [1, 2, 3], \"b\": (x ** 2) // 3}  # comment\n\n\n",
    "punctuation!!! ??? ... ;;; ::: ''' \"\"\" ``` ~~~ ### @@@ $$$ %%% ^^^ &&& *** ((( )))",
    "'s 't 're 've 'm 'll 'd 'S 'T 'RE I'M YOU'LL",
    "ALLCAPS camelCase snake_case kebab-case PascalCase mixedCASE123abc",
    "http://example.com/path?q=1&r=two#frag user@example.org C:\\Users\\x",
    "a" * 300 + " " + "ab" * 200 + " " + " " * 40 + "\n" * 12 + "\t" * 9,
)
"""Texts of the kinds a byte-level BPE's pre-tokenizer and merges treat differently."""


class FastEncoder:
    """fastokens loaded from a Rust tokenizer's ``tokenizer.json``: a text or a batch of
    texts -> ids, with no special tokens added (the chat template writes its own) and
    added tokens in the text recognized, as ``tokenizers``' ``encode`` does them. Safe
    to call from one thread at a time; the GIL is let go while it encodes."""

    def __init__(self, native: Any, split_special_tokens: bool) -> None:
        self._native = native
        self._split = split_special_tokens

    def blobs(self, texts: Sequence[str]) -> list[bytes]:
        """Each text's ids as little-endian uint32 bytes."""
        if not texts:
            return []
        ids, offsets = self._native.encode_batch_flat(
            list(texts), add_special_tokens=False, split_special_tokens=self._split
        )
        ends = memoryview(offsets).cast("Q")
        return [bytes(ids[4 * ends[i] : 4 * ends[i + 1]]) for i in range(len(texts))]

    def warm(self) -> None:
        """Ready the calling thread: fastokens' first encode on a thread is slow
        (it builds per-thread state), every later one is not."""
        self.blobs(["ready this thread: 1 2 3, \u00e9\u00e8 <|im_start|>"])


def self_test_texts(backend: Any, extra: Sequence[str] = ()) -> list[str]:
    """The corpus ``load_fast_encoder`` checks on: the texts above, each added token of
    ``backend`` alone and between words (with and without spaces around it), and
    ``extra`` (a chat template's text, say)."""
    texts = list(_SCRIPTS)
    for token in backend.get_added_tokens_decoder().values():
        t = token.content
        texts += [t, f"x{t}y", f"a {t} b", f"\n{t}\n", f"{t}{t} {t}"]
    texts.append(" ".join(texts))  # one long text: the pieces' joins too
    texts.extend(extra)
    return texts


def load_fast_encoder(backend: Any, extra: Sequence[str] = ()) -> tuple[FastEncoder | None, str]:
    """fastokens for ``backend`` (a ``tokenizers.Tokenizer``) if it is installed, loads
    the backend's ``tokenizer.json`` and gives the backend's ids on every text of the
    self-test corpus (``self_test_texts``); else None. The reason comes with either
    (for the log and ``/status``)."""
    try:
        module = importlib.import_module(_MODULE)
    except ImportError:
        return None, f"{_MODULE} is not installed"
    split = bool(getattr(backend, "encode_special_tokens", False))
    try:
        native = module.Tokenizer.from_json_str(backend.to_str())
    except Exception as exc:  # whatever it cannot load, tokenizers' own encoder serves
        return None, f"{_MODULE} cannot load this tokenizer: {exc}"
    fast = FastEncoder(native, split)
    texts = self_test_texts(backend, extra)
    want = [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=False)]
    try:
        # one text at a time, then all in one batch: both paths, each warmed up here
        # rather than in a request's time (a first batch starts fastokens' threads)
        got = [fast.blobs([t])[0] for t in texts]
        batch = fast.blobs(texts)
    except Exception as exc:
        return None, f"{_MODULE} failed its self-test: {exc}"
    for text, w, g, b in zip(texts, want, got, batch, strict=True):
        if not np.array_equal(np.frombuffer(g, dtype="<u4"), w) or b != g:
            return None, f"{_MODULE} gave other ids than the tokenizer for {text[:60]!r}"
    return fast, f"{_MODULE}: the same ids on a {len(texts)}-text self-test"
