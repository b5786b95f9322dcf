"""A request's prompt as token ids: the one definition the engine and a router share.

Owns how a chat (its messages through the model's chat template) or a completion (a
string, or token ids) becomes the ids the engine prefills (``chat_ids``, ``prompt_ids``,
``tokenize_ids``, which the engine's ``openai_server`` serves at ``/tokenize`` and
prefills from), and ``PromptTokenizer``: the same on a tokenizer loaded by
``loading.load_tokenizer`` (no transformers, no torch), for ``kvatlas router
--tokenizer`` (``load_prompt_tokenizer``), so that a router's ids are the engine's. For a
Hugging Face tokenizer (``HubTokenizer``), ``PromptTokenizer`` calls its Rust tokenizer
directly (``RustTokenizer``): the same pipeline and ids as the engine's path through
transformers, in a fraction of its time, and with the GIL released while it runs; and
for a byte-level BPE it keeps the ids of recent text pieces (``PieceCache``, cut only
where the ids provably cannot change), so the system prompt, document or earlier turns
a prompt shares with recent ones are not encoded again. Where fastokens is installed
and gives the Rust tokenizer's ids on a self-test corpus, it encodes instead, many
times faster (``fast_encoder``; ``inline_ok`` says when a call is cheap enough for an
event loop). Must not: run a model, do I/O beyond loading the tokenizer's files, or
decide what to do with a bad request (``BadRequest`` says what is wrong; callers
answer).
"""

from __future__ import annotations

import re
import sys
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from itertools import pairwise
from typing import Any, Final, TypeVar

import numpy as np

from kvatlas.tokenize.fast_encoder import FastEncoder, load_fast_encoder
from kvatlas.tokenize.loading import HubTokenizer, Tokenizer, load_tokenizer
from kvatlas.tokenize.request_shapes import (
    BadRequest,
    ChatMessage,
    TokenizeRequest,
    decode_tokenize,
)

_T = TypeVar("_T")
_WARM_UP: Final = b'{"messages":[{"role":"user","content":"hi"}]}'
_SAMPLE_CHAT: Final = [
    ChatMessage(role="system", content="You answer in one line.\n"),
    ChatMessage(role="user", content="What's 2 + 2?  Say it   twice:\tfour\n\nfour"),
    ChatMessage(role="assistant", content="4, 4 — done."),
    ChatMessage(role="user", content="Naïve café? 😀"),
]
"""A chat whose template text joins the fast encoder's self-test (``fast_path``)."""
INLINE_MAX_BYTES: Final = 256 << 10
"""Bodies up to this size (up to ~64k tokens) a fast encoder tokenizes quickly enough
for a caller's event loop (``inline_ok``; ``bench.router_bench`` measures it)."""
_PIECE_CHARS: Final = 2048
"""A text is cut into pieces encoded in parallel from about this many characters each."""
_CUT: Final = re.compile(r"(?<=[!-~]) ")
"""Where a byte-level BPE text may be cut: at a space after a printable ASCII character
(see ``RustTokenizer``)."""
CACHE_PIECE_CHARS: Final = 1024
"""With a ``PieceCache``, a text is cut at the first ``_CUT`` at least this many
characters after the previous cut (from its start: texts that share a prefix share the
pieces inside it)."""
_ARRAY_IS_LE_U32: Final = array("I").itemsize == 4 and sys.byteorder == "little"


def pack_ids(ids: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32 bytes (the router's keys and lookups);
    OverflowError for an id outside uint32."""
    if _ARRAY_IS_LE_U32:
        return array("I", ids).tobytes()
    return np.asarray(ids, dtype="<u4").tobytes()  # pragma: no cover - big-endian hosts


def chat_ids(
    tokenizer: Tokenizer, chat: list[ChatMessage], add_generation_prompt: bool = True
) -> list[int]:
    """The chat template's token ids (on the thread that owns ``tokenizer``)."""
    return _templated(
        chat, lambda messages: tokenizer.apply_chat_template(messages, add_generation_prompt)
    )


def _chat_text(
    tokenizer: RustTokenizer, chat: list[ChatMessage], add_generation_prompt: bool
) -> str:
    """The chat template's text, which ``chat_ids`` encodes (the same errors)."""
    return _templated(chat, lambda messages: tokenizer.render(messages, add_generation_prompt))


def _templated(chat: list[ChatMessage], apply: Callable[[list[dict[str, str]]], _T]) -> _T:
    """``apply`` (a chat template) to the messages; BadRequest for none, or for messages
    the template refuses (a template error is the messages' fault)."""
    if not chat:
        raise BadRequest("messages must not be empty", "messages")
    try:
        return apply([{"role": m.role, "content": m.text()} for m in chat])
    except Exception as exc:
        raise BadRequest(f"cannot apply the chat template: {exc}", "messages") from exc


def prompt_ids(
    tokenizer: Tokenizer, prompt: str | list[int | str], vocab_size: int | None
) -> list[int]:
    """A completion prompt's token ids (on the thread that owns ``tokenizer``); token ids
    outside ``[0, vocab_size)`` are refused (None: not checked)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    ids: list[int] = []
    for t in prompt:
        if isinstance(t, str):
            raise BadRequest("prompt must be one string or a list of token ids", "prompt")
        if vocab_size is not None and not 0 <= t < vocab_size:
            raise BadRequest(f"token id {t} is outside the vocabulary [0, {vocab_size})", "prompt")
        ids.append(t)
    return ids


def tokenize_ids(tokenizer: Tokenizer, req: TokenizeRequest, vocab_size: int | None) -> list[int]:
    """The ids of a ``/tokenize`` body (a chat or completion body is one too)."""
    if req.messages is not None:
        return chat_ids(tokenizer, req.messages, req.add_generation_prompt)
    assert req.prompt is not None  # decode_tokenize checked one of them is given
    return prompt_ids(tokenizer, req.prompt, vocab_size)


class RustTokenizer:
    """A ``HubTokenizer``'s ids from its Rust tokenizer (``tokenizers.Tokenizer``) in
    batches: what transformers runs for ``encode`` and, after rendering the chat
    template, for ``apply_chat_template`` (the whole pipeline: added tokens,
    normalizer, pre-tokenizer, model; no special tokens added, the template writes its
    own), so the ids are the same. Three things make the engine's path slow for a router
    (several times slower than this): transformers' Python around the
    call (its ``BatchEncoding``, attention masks), the character offsets it has Rust
    compute, and, through a plain ``encode``, holding the GIL for the whole call, which
    stops the router's event loop. ``encode_batch_fast`` computes no offsets and lets
    the GIL go while it runs.

    With ``pieces`` > 1 a long text is also cut into up to that many pieces that Rust
    encodes on its threads at once (less wall time on idle cores, more CPU time in all:
    Rust's threads wait for work spinning), where the cuts provably change no id: for a
    byte-level BPE (GPT-2's pre-tokenizer regex, SmolLM2's) with no normalizer, a space
    after a non-space character always starts a new pre-token (no pattern takes
    whitespace but as its first character, and nothing looks behind), and every
    pre-token is merged on its own; when no added token contains a space or strips the
    whitespace around it, the added tokens split the same way too. Any other tokenizer
    is encoded in one piece.

    With a ``cache`` (``encode_blob``), the same cuts (every ``piece_chars`` from the
    text's start) make pieces whose ids are kept: the ids of a text are the ids of
    its pieces, one after the other, each from the cache or encoded now (up to
    ``pieces`` missing pieces in one call)."""

    def __init__(
        self,
        hub: HubTokenizer,
        backend: Any,
        pieces: int = 1,
        cache: PieceCache | None = None,
        piece_chars: int = CACHE_PIECE_CHARS,
    ) -> None:
        self.hub = hub
        """The tokenizer it encodes for (its chat template, special tokens, decoder)."""
        self.backend = backend
        """The Rust tokenizer (``tokenizers.Tokenizer``)."""
        self.fast: FastEncoder | None = None
        """fastokens on the same ``tokenizer.json``, proven on a self-test corpus
        (``fast_encoder``): encodes in its stead where set."""
        self.fast_note = "not asked for"
        """Why ``fast`` is set or not (for the log and ``/status``)."""
        self.fast_refused = 0
        """Texts the fast encoder refused and ``tokenizers`` encoded (``_fast_blobs``)."""
        backend.encode_special_tokens = hub.backend.encode_special_tokens
        cuttable = _cuttable(backend)
        self.pieces = pieces if cuttable else 1
        """Pieces a long text is encoded in (1: whole), or, with ``cache``, the most
        missing pieces encoded in one call."""
        self.cache = cache if cuttable else None
        """The ids of recent pieces (None: none kept, or a tokenizer that may not be cut)."""
        self.piece_chars = piece_chars
        """With ``cache``: the least characters of a piece (its cut is the next ``_CUT``)."""

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.hub.eos_token_ids

    def encode(self, text: str) -> list[int]:
        blobs = self._fast_blobs([text])
        if blobs is not None:
            ids: list[int] = np.frombuffer(blobs[0], dtype="<u4").tolist()
            return ids
        encoded = self.backend.encode_batch_fast(self._cut(text), add_special_tokens=False)
        if len(encoded) == 1:
            whole: list[int] = encoded[0].ids
            return whole
        return [i for e in encoded for i in e.ids]

    def _fast_blobs(self, texts: list[str]) -> list[bytes] | None:
        """The texts' ids from the fast encoder; None without one, or where it refuses
        a text that ``tokenizers`` encodes (a character whose bytes have no token in
        the vocabulary: fastokens stops where tokenizers drops the byte; counted in
        ``fast_refused``), so that the caller encodes them the tokenizer's own way."""
        if self.fast is None or not texts:
            return None
        try:
            return self.fast.blobs(texts)
        except ValueError:
            self.fast_refused += len(texts)
            return None

    def _cut(self, text: str) -> list[str]:
        n = min(self.pieces, len(text) // _PIECE_CHARS)
        if n < 2:
            return [text]
        cuts = [0]
        for k in range(1, n):
            found = _CUT.search(text, max(len(text) * k // n, cuts[-1] + 1))
            if found is None:
                break
            cuts.append(found.start())
        cuts.append(len(text))
        return [text[a:b] for a, b in pairwise(cuts)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hub.decode(ids, skip_special_tokens)

    def render(self, messages: Sequence[Any], add_generation_prompt: bool = True) -> str:
        """The chat template's text (which ``apply_chat_template`` encodes)."""
        return self.hub.render(messages, add_generation_prompt)

    def apply_chat_template(
        self, messages: Sequence[Any], add_generation_prompt: bool = True
    ) -> list[int]:
        return self.encode(self.render(messages, add_generation_prompt))

    def encode_blob(self, text: str) -> bytes:
        """``encode(text)`` as little-endian uint32 bytes, through the cache when there
        is one."""
        cache = self.cache
        if cache is None:
            blobs = self._fast_blobs([text])
            return blobs[0] if blobs is not None else pack_ids(self.encode(text))
        pieces = aligned_pieces(text, self.piece_chars)
        found = [cache.get(p) for p in pieces]
        missing = [i for i, b in enumerate(found) if b is None]
        blobs = self._fast_blobs([pieces[i] for i in missing])
        if blobs is not None:
            for i, blob in zip(missing, blobs, strict=True):
                found[i] = cache.put(pieces[i], blob)
            missing = []
        for start in range(0, len(missing), self.pieces):
            batch = missing[start : start + self.pieces]
            encoded = self.backend.encode_batch_fast(
                [pieces[i] for i in batch], add_special_tokens=False
            )
            for i, e in zip(batch, encoded, strict=True):
                found[i] = cache.put(pieces[i], pack_ids(e.ids))
        return b"".join(b for b in found if b is not None)


def aligned_pieces(text: str, every: int) -> list[str]:
    """``text`` cut at the first ``_CUT`` at least ``every`` characters after the
    previous cut (the first: after the start), so where a text is cut depends on its
    characters up to the cut only: texts that share a prefix share its pieces (but the
    last piece that reaches past the shared part)."""
    out: list[str] = []
    start = 0
    while len(text) - start > every:
        found = _CUT.search(text, start + every)
        if found is None:
            break
        out.append(text[start : found.start()])
        start = found.start()
    out.append(text[start:])
    return out


class PieceCache:
    """Recently encoded text pieces -> their ids (little-endian uint32 bytes), least
    recently used first out once the entries' bytes pass ``max_bytes``; counts its hits
    and misses (pieces and tokens) for the router's metrics. Only ``RustTokenizer`` cuts
    the pieces, where the ids of a text are provably those of its pieces one after the
    other. Not thread-safe: used from the tokenizer's thread; the counters may be read
    from another."""

    _ENTRY_OVERHEAD: Final = 100
    """Bytes counted per entry beyond its piece and ids (the dict's slot, the objects'
    headers: an estimate)."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError(f"a piece cache needs a positive size, got {max_bytes} bytes")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, bytes] = OrderedDict()
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self.hit_tokens = 0
        self.miss_tokens = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def _size(self, piece: str, ids: bytes) -> int:
        return sys.getsizeof(piece) + len(ids) + self._ENTRY_OVERHEAD

    def get(self, piece: str) -> bytes | None:
        """The piece's ids if kept (a hit), else None (a miss: ``put`` them)."""
        ids = self._entries.get(piece)
        if ids is None:
            self.misses += 1
            return None
        self._entries.move_to_end(piece)
        self.hits += 1
        self.hit_tokens += len(ids) // 4
        return ids

    def put(self, piece: str, ids: bytes) -> bytes:
        """Keep ``ids`` as the piece's (one larger than an eighth of the cache is not
        kept); returns ``ids``."""
        self.miss_tokens += len(ids) // 4
        size = self._size(piece, ids)
        if size > self.max_bytes // 8:
            return ids
        old = self._entries.pop(piece, None)
        if old is not None:
            self.bytes -= self._size(piece, old)
        self._entries[piece] = ids
        self.bytes += size
        while self.bytes > self.max_bytes:
            p, b = self._entries.popitem(last=False)
            self.bytes -= self._size(p, b)
            self.evictions += 1
        return ids

    def clear(self) -> None:
        """Forget every piece (the counters stay)."""
        self._entries.clear()
        self.bytes = 0

    def stats(self) -> dict[str, float]:
        """The counters and sizes, for metrics (see ``PromptTokenizer.cache_stats``)."""
        return {
            "hits": self.hits,
            "misses": self.misses,
            "hit_tokens": self.hit_tokens,
            "miss_tokens": self.miss_tokens,
            "evictions": self.evictions,
            "entries": len(self._entries),
            "bytes": self.bytes,
            "max_bytes": self.max_bytes,
        }


def _cuttable(backend: Any) -> bool:
    """Whether ``backend`` encodes a text cut at ``_CUT`` as it encodes it whole (see
    ``RustTokenizer``)."""
    pre = backend.pre_tokenizer
    if backend.normalizer is not None or type(pre).__name__ != "ByteLevel":
        return False
    if not getattr(pre, "use_regex", False) or getattr(pre, "add_prefix_space", True):
        return False
    for token in backend.get_added_tokens_decoder().values():
        if token.lstrip or token.rstrip or token.single_word or token.normalized:
            return False
        if any(c.isspace() for c in token.content):
            return False
    return True


def fast_path(
    tokenizer: Tokenizer, pieces: int = 1, cache_bytes: int = 0, fast: bool = True
) -> Tokenizer:
    """``tokenizer`` through its Rust tokenizer where it has one (a ``HubTokenizer``
    whose bindings have ``encode_batch_fast``; a long text in up to ``pieces``
    at once; with ``cache_bytes``, a ``PieceCache`` of that size where the tokenizer may
    be cut; with ``fast``, encoded by fastokens where it passes its self-test), else
    itself."""
    if not isinstance(tokenizer, HubTokenizer):
        return tokenizer
    backend = tokenizer.backend
    if not hasattr(backend, "encode_batch_fast"):
        return tokenizer
    cache = PieceCache(cache_bytes) if cache_bytes > 0 else None
    rust = RustTokenizer(tokenizer, backend, pieces, cache)
    if fast:
        sample = (
            [_chat_text(rust, _SAMPLE_CHAT, g) for g in (True, False)]
            if tokenizer.template is not None
            else []
        )
        rust.fast, rust.fast_note = load_fast_encoder(backend, sample)
    return rust


class PromptTokenizer:
    """A chat or completion body -> its prompt's ids, as the engine serving ``source``
    would prefill them. Not thread-safe (a tokenizer must not be used from two threads
    at once): the router calls ``blob`` from one thread at a time (its event loop or its
    tokenizer thread, never both at once), and ``verify`` from a third."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        source: str,
        pieces: int = 1,
        cache_bytes: int = 0,
        fast: bool = True,
    ) -> None:
        self._tokenizer = fast_path(tokenizer, pieces, cache_bytes, fast)
        self.source = source
        self._reference: RustTokenizer | None = None
        """The tokenizer's own encoder on a backend of its own, built by the first
        ``verify`` (on its thread: none when the router checks nothing)."""
        self._distrust = ""
        """Why the fast encoder is to be switched off at the next ``blob`` ("": not)."""

    @property
    def encoder(self) -> str:
        """What encodes text: ``fastokens`` (see ``fast_encoder``), ``tokenizers``
        (the Rust tokenizer itself) or ``python`` (anything else); and why."""
        tok = self._tokenizer
        if isinstance(tok, RustTokenizer):
            name = "fastokens" if tok.fast is not None else "tokenizers"
            return f"{name} ({tok.fast_note})"
        return "python"

    def inline_ok(self, body: bytes) -> bool:
        """Whether ``blob(body)`` is cheap enough to run on the caller's event loop: a
        fast encoder and a body of at most ``INLINE_MAX_BYTES``."""
        tok = self._tokenizer
        return (
            isinstance(tok, RustTokenizer)
            and tok.fast is not None
            and (len(body) <= INLINE_MAX_BYTES)
        )

    def ids(self, body: bytes) -> list[int]:
        """The prompt's ids; BadRequest for a body the engine would refuse too."""
        return tokenize_ids(self._tokenizer, decode_tokenize(body), None)

    def blob(self, body: bytes) -> bytes:
        """``ids(body)`` as little-endian uint32 bytes (what the router keys and looks up
        by), a text through the piece cache where there is one; BadRequest as ``ids``,
        OverflowError for a token id outside uint32."""
        req = decode_tokenize(body)
        tok = self._tokenizer
        if self._distrust and isinstance(tok, RustTokenizer) and tok.fast is not None:
            # here, on the one thread that encodes now: the cache is this thread's too
            tok.fast, tok.fast_note = None, f"switched off: {self._distrust}"
            if tok.cache is not None:
                tok.cache.clear()
        if isinstance(tok, RustTokenizer) and tok.cache is not None:
            if req.messages is not None:
                return tok.encode_blob(_chat_text(tok, req.messages, req.add_generation_prompt))
            prompt = req.prompt
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                prompt = prompt[0]
            if isinstance(prompt, str):
                return tok.encode_blob(prompt)
        return pack_ids(tokenize_ids(tok, req, None))

    def cache_stats(self) -> dict[str, float]:
        """The piece cache's counters (``PieceCache.stats``) and, with a fast encoder,
        the texts it refused (``fast_refused``); empty without either."""
        tok = self._tokenizer
        out: dict[str, float] = {}
        if isinstance(tok, RustTokenizer):
            if tok.cache is not None:
                out.update(tok.cache.stats())
            if tok.fast is not None:
                out["fast_refused"] = tok.fast_refused
        return out

    def verify(self, body: bytes, blob: bytes) -> bool | None:
        """Whether the tokenizer's own encoder gives ``blob`` for ``body``; None without
        a fast encoder in use (nothing to check). Safe on one thread of its own beside
        ``blob``: it shares no encoder and no cache with it (the chat template's
        rendering is stateless); not from two threads at once."""
        tok = self._tokenizer
        if not isinstance(tok, RustTokenizer) or tok.fast is None:
            return None
        ref = self._reference
        if ref is None:
            ref = self._reference = RustTokenizer(
                tok.hub, type(tok.backend).from_str(tok.backend.to_str())
            )
        try:
            return pack_ids(tokenize_ids(ref, decode_tokenize(body), None)) == blob
        except (BadRequest, OverflowError):
            return None  # nothing to compare: the fast path's ids came from this body

    def distrust(self, why: str) -> None:
        """Switch the fast encoder off at the next ``blob`` (and empty the piece cache
        it filled); any thread."""
        self._distrust = why or "distrusted"

    def warm(self) -> None:
        """Ready the calling thread for the fast encoder (``FastEncoder.warm``); nothing
        without one."""
        tok = self._tokenizer
        if isinstance(tok, RustTokenizer) and tok.fast is not None:
            tok.fast.warm()


def load_prompt_tokenizer(
    name_or_path: str, pieces: int = 1, cache_bytes: int = 0, fast: bool = True
) -> PromptTokenizer:
    """The tokenizer of ``name_or_path`` (an engine's ``--model``), its chat template
    compiled once here rather than in the first request's time (a long text in up to
    ``pieces`` at once, see ``RustTokenizer``; with ``cache_bytes``, the ids of recent
    pieces kept, see ``PieceCache``; with ``fast``, encoded by fastokens where it
    passes its self-test, see ``fast_encoder``); TokenizerLoadError names the source."""
    tokenizer = PromptTokenizer(
        load_tokenizer(name_or_path), name_or_path, pieces, cache_bytes, fast
    )
    tokenizer.blob(_WARM_UP)
    return tokenizer
