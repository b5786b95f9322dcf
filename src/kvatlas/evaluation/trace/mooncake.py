"""Traces in Mooncake's format: load, validate, select a window, turn blocks into tokens.

Owns the reading of a Mooncake trace (kvcache-ai/Mooncake, ``FAST25-release/traces``): a
JSON Lines file, one request per line with ``timestamp`` (ms from the start),
``input_length`` and ``output_length`` (tokens) and ``hash_ids``, one id per prefix block
of ``block_tokens`` tokens (512 in Mooncake's traces, ``--trace-block-tokens``); equal ids
mean equal prefixes, so reusable KV. The last block may be partial: it holds
``input_length - (len(hash_ids) - 1) * block_tokens`` tokens, between 1 and
``block_tokens``. Bad input is refused with a ``TraceError`` naming the file and line.

It also turns a trace into token ids that a real fleet can hash (``block_token_ids``,
``prompt_token_ids``): every hash id becomes a fixed run of ``block_tokens`` token ids that
depends on the id alone, so equal ids give equal tokens and a request's prompt (its
blocks' runs, concatenated, cut to ``input_length``) shares exactly the prefixes the trace
says it shares with every other request.

The conversation trace of the FAST'25 paper ships with the package
(``bundled_conversation_trace``; source, licence and checksum in ``data/README.md``).

Must not: read a clock, download anything, or know any policy or fleet.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Final

import msgspec
import numpy as np
import numpy.typing as npt

from kvatlas.core.errors import InvalidInput

DEFAULT_BLOCK_TOKENS: Final = 512
"""Tokens per hash id in Mooncake's published traces."""

CONVERSATION_TRACE: Final = "conversation_trace.jsonl"
"""The vendored trace's file name under ``data/``."""


class TraceError(InvalidInput):
    """A trace file or line that is not a valid Mooncake trace; the message names the
    source and the line (1-based)."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace."""

    timestamp_ms: int
    """Arrival, in milliseconds from the trace's start."""
    input_length: int
    """Prompt tokens."""
    output_length: int
    """Generated tokens."""
    hash_ids: tuple[int, ...]
    """One id per prefix block; the last block may be partial."""
    line: int = 0
    """1-based line in its source (0: built in code)."""

    @property
    def arrival_s(self) -> float:
        """Arrival in seconds from the trace's start."""
        return self.timestamp_ms / 1000.0

    def block_lengths(self, block_tokens: int) -> list[int]:
        """Tokens of each block: ``block_tokens`` but the last, which holds the rest."""
        n = len(self.hash_ids)
        return [block_tokens] * (n - 1) + [self.input_length - (n - 1) * block_tokens]


@dataclass(frozen=True, slots=True)
class Trace:
    """A validated trace: requests in arrival order (ties keep the file's order)."""

    requests: tuple[TraceRequest, ...]
    block_tokens: int = DEFAULT_BLOCK_TOKENS
    source: str = "<memory>"

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def duration_s(self) -> float:
        """From the first arrival to the last."""
        if not self.requests:
            return 0.0
        return (self.requests[-1].timestamp_ms - self.requests[0].timestamp_ms) / 1000.0

    @property
    def input_tokens(self) -> int:
        return sum(r.input_length for r in self.requests)

    def window(self, start_s: float, duration_s: float) -> Trace:
        """The requests arriving in ``[start_s, start_s + duration_s)``, seconds from the
        trace's time zero, with their timestamps unchanged."""
        if start_s < 0 or duration_s <= 0:
            raise TraceError(
                f"{self.source}: a window needs start_s >= 0 and duration_s > 0,"
                f" got start_s={start_s}, duration_s={duration_s}"
            )
        lo, hi = start_s * 1000.0, (start_s + duration_s) * 1000.0
        kept = tuple(r for r in self.requests if lo <= r.timestamp_ms < hi)
        return replace(self, requests=kept, source=f"{self.source}[{start_s:g}s+{duration_s:g}s]")


class _Line(msgspec.Struct):
    # Unknown fields are allowed: Mooncake's other traces may carry more.
    timestamp: int
    input_length: int
    output_length: int
    hash_ids: list[int]


_DECODER: Final = msgspec.json.Decoder(_Line)


def parse_trace(
    lines: Iterable[str | bytes],
    *,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
    source: str = "<memory>",
) -> Trace:
    """Validate ``lines`` (one JSON object each; blank lines are skipped) as a trace.

    Refuses, naming ``source`` and the line: malformed JSON, a missing or mistyped field,
    a negative timestamp or length, a timestamp before the previous line's, an empty
    ``hash_ids``, a negative hash id, and an ``input_length`` that the blocks cannot hold
    or that leaves a block empty. An empty trace is refused too.
    """
    if block_tokens < 1:
        raise TraceError(f"{source}: block_tokens must be >= 1, got {block_tokens}")
    out: list[TraceRequest] = []
    previous = 0
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        where = f"{source}:{number}"
        try:
            item = _DECODER.decode(raw)
        except msgspec.ValidationError as exc:
            raise TraceError(f"{where}: {exc}") from exc
        except msgspec.DecodeError as exc:
            raise TraceError(f"{where}: not a JSON object: {exc}") from exc
        req = _checked(item, where, block_tokens, previous, number)
        previous = req.timestamp_ms
        out.append(req)
    if not out:
        raise TraceError(f"{source}: no requests")
    return Trace(tuple(out), block_tokens, source)


def _checked(
    item: _Line, where: str, block_tokens: int, previous: int, number: int
) -> TraceRequest:
    if item.timestamp < 0:
        raise TraceError(f"{where}: timestamp {item.timestamp} is negative")
    if item.timestamp < previous:
        raise TraceError(
            f"{where}: timestamp {item.timestamp} is before the previous line's {previous}"
            " (a trace is in arrival order)"
        )
    if item.input_length < 1:
        raise TraceError(f"{where}: input_length {item.input_length} must be >= 1")
    if item.output_length < 0:
        raise TraceError(f"{where}: output_length {item.output_length} is negative")
    n = len(item.hash_ids)
    if n == 0:
        raise TraceError(f"{where}: hash_ids is empty")
    if min(item.hash_ids) < 0:
        raise TraceError(f"{where}: hash_ids holds a negative id {min(item.hash_ids)}")
    if not (n - 1) * block_tokens < item.input_length <= n * block_tokens:
        raise TraceError(
            f"{where}: input_length {item.input_length} does not fit {n} blocks of"
            f" {block_tokens} tokens (needs {(n - 1) * block_tokens + 1}..{n * block_tokens};"
            " is --trace-block-tokens right?)"
        )
    return TraceRequest(
        item.timestamp, item.input_length, item.output_length, tuple(item.hash_ids), number
    )


def load_trace(path: str | Path, *, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> Trace:
    """Read and validate the trace at ``path`` (see ``parse_trace``)."""
    p = Path(path)
    try:
        with p.open("rb") as f:
            return parse_trace(f, block_tokens=block_tokens, source=str(p))
    except OSError as exc:
        raise TraceError(f"{p}: cannot read the trace: {exc}") from exc


def bundled_trace_path(name: str = CONVERSATION_TRACE) -> Path:
    """The path of a trace vendored under ``data/`` (installed with the package)."""
    ref = resources.files(__package__ or "kvatlas.evaluation.trace") / "data" / name
    return Path(str(ref))


def bundled_conversation_trace() -> Trace:
    """The FAST'25 conversation trace (12,031 requests over one hour), as vendored."""
    return load_trace(bundled_trace_path())


# splitmix64's constants: a bijective mix of 64-bit integers, so that nearby (id, position)
# pairs give unrelated token ids.
_GOLDEN: Final = np.uint64(0x9E3779B97F4A7C15)
_MIX1: Final = np.uint64(0xBF58476D1CE4E5B9)
_MIX2: Final = np.uint64(0x94D049BB133111EB)
_POSITION_BITS: Final = 24


def _token_ids(
    ids: npt.NDArray[np.uint64], positions: npt.NDArray[np.uint64], vocab: int
) -> npt.NDArray[np.uint32]:
    # numpy wraps uint64 array arithmetic modulo 2**64 without a warning, as intended
    x = (ids << np.uint64(_POSITION_BITS)) | positions
    x = x + _GOLDEN
    x ^= x >> np.uint64(30)
    x *= _MIX1
    x ^= x >> np.uint64(27)
    x *= _MIX2
    x ^= x >> np.uint64(31)
    return (x % np.uint64(vocab)).astype(np.uint32)


_MAX_HASH_ID: Final = (1 << (64 - _POSITION_BITS)) - 1


def _check_vocab(n: int, vocab: int, hash_ids: Iterable[int]) -> None:
    if max(hash_ids, default=0) > _MAX_HASH_ID:
        raise TraceError(f"hash ids above {_MAX_HASH_ID} have no distinct token runs")
    if not 1 <= n < 1 << _POSITION_BITS:
        raise TraceError(f"a block holds 1..{(1 << _POSITION_BITS) - 1} tokens, got {n}")
    if not 1 <= vocab <= 1 << 32:
        raise TraceError(f"vocab must be in 1..2**32, got {vocab}")


def block_token_ids(hash_id: int, n: int, vocab: int) -> npt.NDArray[np.uint32]:
    """The ``n`` token ids (in ``[0, vocab)``) that block ``hash_id`` stands for: the same
    for the same id, wherever it occurs; a shorter ``n`` gives a prefix of a longer one."""
    _check_vocab(n, vocab, (hash_id,))
    ids = np.full(n, hash_id, dtype=np.uint64)
    return _token_ids(ids, np.arange(n, dtype=np.uint64), vocab)


def prompt_token_ids(req: TraceRequest, block_tokens: int, vocab: int) -> npt.NDArray[np.uint32]:
    """A request's whole prompt: its blocks' runs concatenated, cut to ``input_length``."""
    _check_vocab(block_tokens, vocab, req.hash_ids)
    ids = np.repeat(np.asarray(req.hash_ids, dtype=np.uint64), block_tokens)[: req.input_length]
    positions = np.arange(req.input_length, dtype=np.uint64) % np.uint64(block_tokens)
    return _token_ids(ids, positions, vocab)
