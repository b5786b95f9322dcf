"""The synthetic fleet workload: who asks which node for which tokens, deterministically.

Owns the request stream of ``kvatlas bench fleet``: a few shared system prompts, documents
reused across sessions with Zipf popularity (doc QA), multi-turn chat sessions whose
history grows per turn, and fresh prompts that nobody can reuse. Every request goes to a
node drawn at random, the way a load balancer without cache affinity spreads a fleet's
traffic, which is exactly when fleet-wide reuse should pay. Also owns the expected KV bytes
of a chunk (blake3 XOF of its hash), so that a reader can tell any wrong byte.

The same ``WorkloadConfig`` (seed included) always yields the same requests. Must not: do
I/O, read clocks or talk to processes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

import blake3
import numpy as np
import numpy.typing as npt

VOCAB_SIZE: Final = 49152
"""Token ids are drawn from SmolLM2's vocabulary range, so the engine phase can reuse it."""

RequestKind = Literal["doc_qa", "chat", "fresh"]

TokenArray = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    """The shape of the request stream; every length is in tokens."""

    requests: int = 400
    """Requests in the stream."""
    nodes: int = 4
    """Nodes the requests are spread over (uniformly at random)."""
    seed: int = 7
    """Seed of the numpy Generator; the same seed gives the same stream."""
    chunk_size: int = 256
    """Tokens per chunk (lengths are drawn in chunks, most with a partial tail)."""
    system_prompts: int = 3
    """Distinct system prompts (one per application)."""
    system_prompt_tokens: tuple[int, int] = (300, 700)
    """Range of a system prompt's length."""
    documents: int = 60
    """Distinct documents for doc QA; document i belongs to application i % system_prompts."""
    document_chunks: tuple[int, int] = (3, 10)
    """Range of a document's length in chunks (plus a partial tail)."""
    zipf_s: float = 1.1
    """Zipf exponent of document popularity (rank r has weight 1 / r**s)."""
    question_tokens: tuple[int, int] = (20, 120)
    """Range of a question's (or a chat user turn's) length."""
    answer_tokens: tuple[int, int] = (60, 300)
    """Range of a chat assistant turn's length (appended to the history)."""
    share_doc_qa: float = 0.5
    """Share of requests that are doc QA."""
    share_chat: float = 0.35
    """Share of requests that are chat turns (the rest are fresh prompts)."""
    chat_sessions: int = 30
    """Chat sessions open at once; a finished session is replaced by a new one."""
    chat_turns: tuple[int, int] = (3, 8)
    """Range of turns per chat session."""
    fresh_chunks: tuple[int, int] = (1, 6)
    """Range of a fresh prompt's length in chunks."""
    max_tokens: int = 8192
    """Longest prompt; a chat session that would exceed it ends early."""

    def validate(self) -> None:
        """Raise ValueError naming the first setting that cannot produce a stream."""
        if self.requests < 1 or self.nodes < 1:
            raise ValueError("requests and nodes must be >= 1")
        if self.chunk_size < 1:
            raise ValueError("chunk_size must be >= 1")
        if not 0 <= self.share_doc_qa + self.share_chat <= 1:
            raise ValueError("share_doc_qa + share_chat must be within [0, 1]")
        if self.system_prompts < 1 or self.documents < 1 or self.chat_sessions < 1:
            raise ValueError("system_prompts, documents and chat_sessions must be >= 1")


@dataclass(frozen=True, slots=True)
class Request:
    """One prompt sent to one node."""

    index: int
    kind: RequestKind
    node: int
    tokens: TokenArray
    group: str
    """What it shares with other requests: ``doc-12``, ``chat-3``, ``fresh``."""
    turn: int = 0
    """Chat turn number (0 for other kinds)."""


def _tokens(rng: np.random.Generator, n: int) -> TokenArray:
    return rng.integers(0, VOCAB_SIZE, n, dtype=np.int64)


def _length(rng: np.random.Generator, lo_hi: tuple[int, int]) -> int:
    return int(rng.integers(lo_hi[0], lo_hi[1] + 1))


@dataclass(slots=True)
class _Session:
    sid: int
    history: TokenArray
    turns_left: int
    turn: int = 0


def generate(cfg: WorkloadConfig) -> list[Request]:
    """The request stream of ``cfg`` (deterministic in ``cfg.seed``)."""
    cfg.validate()
    rng = np.random.default_rng(cfg.seed)
    cs = cfg.chunk_size
    prompts = [
        _tokens(rng, _length(rng, cfg.system_prompt_tokens)) for _ in range(cfg.system_prompts)
    ]
    docs = [
        _tokens(rng, _length(rng, cfg.document_chunks) * cs + int(rng.integers(0, cs)))
        for _ in range(cfg.documents)
    ]
    # Popularity rank is a random permutation of documents, weights 1/r^s.
    ranks = rng.permutation(cfg.documents) + 1
    weights = 1.0 / ranks.astype(np.float64) ** cfg.zipf_s
    weights /= weights.sum()

    next_sid = 0

    def new_session() -> _Session:
        nonlocal next_sid
        app = int(rng.integers(0, cfg.system_prompts))
        s = _Session(next_sid, prompts[app].copy(), _length(rng, cfg.chat_turns))
        next_sid += 1
        return s

    sessions = [new_session() for _ in range(cfg.chat_sessions)]
    out: list[Request] = []
    for i in range(cfg.requests):
        node = int(rng.integers(0, cfg.nodes))
        u = float(rng.random())
        if u < cfg.share_doc_qa:
            d = int(rng.choice(cfg.documents, p=weights))
            q = _tokens(rng, _length(rng, cfg.question_tokens))
            toks = np.concatenate([prompts[d % cfg.system_prompts], docs[d], q])
            out.append(Request(i, "doc_qa", node, toks[: cfg.max_tokens], f"doc-{d}"))
        elif u < cfg.share_doc_qa + cfg.share_chat:
            slot = int(rng.integers(0, len(sessions)))
            s = sessions[slot]
            user = _tokens(rng, _length(rng, cfg.question_tokens))
            toks = np.concatenate([s.history, user])
            out.append(Request(i, "chat", node, toks, f"chat-{s.sid}", s.turn))
            answer = _tokens(rng, _length(rng, cfg.answer_tokens))
            s.history = np.concatenate([toks, answer])
            s.turn += 1
            s.turns_left -= 1
            if s.turns_left <= 0 or len(s.history) + cfg.question_tokens[1] > cfg.max_tokens:
                sessions[slot] = new_session()
        else:
            n = _length(rng, cfg.fresh_chunks) * cs + int(rng.integers(0, cs))
            out.append(Request(i, "fresh", node, _tokens(rng, n), "fresh"))
    return out


def expected_kv(chunk_hash: bytes, size: int) -> npt.NDArray[np.uint8]:
    """The KV bytes every node must hold for ``chunk_hash``: blake3 XOF of the hash.

    Any wrong byte a reader gets (a wrong chunk, a torn copy, a stale slot) differs from
    this with overwhelming probability.
    """
    raw = blake3.blake3(b"kvatlas-eval-kv" + chunk_hash).digest(length=size)
    return np.frombuffer(raw, dtype=np.uint8)


def summarize(requests: list[Request], chunk_size: int) -> dict[str, float]:
    """Counts that describe a stream (for the report)."""
    lens = np.array([len(r.tokens) for r in requests], dtype=np.int64)
    kinds = {k: sum(1 for r in requests if r.kind == k) for k in ("doc_qa", "chat", "fresh")}
    return {
        "requests": float(len(requests)),
        "tokens": float(lens.sum()),
        "full_chunks": float((lens // chunk_size).sum()),
        "mean_tokens": float(lens.mean()) if len(lens) else 0.0,
        "max_tokens": float(lens.max()) if len(lens) else 0.0,
        **{f"share_{k}": v / max(1, len(requests)) for k, v in kinds.items()},
    }
