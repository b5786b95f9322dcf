"""Per engine, the first-byte deadline: how long the router's requests may wait on an
engine that shows no sign of progress before it is taken out.

The probe catches an engine whose process stops (its ``/metrics`` stops answering too).
An engine can also answer its probe while its work is stuck (a hung model thread, a GPU
that no longer completes kernels): requests sent to it would wait the whole
``--engine-timeout-s``. So the router watches, per engine, the last sign of progress: a
first byte or a stream's piece from it, or, at a probe, a progress counter of its
metrics that moved (tokens prefilled or generated). While requests wait on it (for a
first byte or a stream's next piece) and it has shown no progress for longer than its
deadline, it is out: its breaker opens, the requests that wait for a first byte go to
their next choice and its streams end with an error event (``tripwires``), as when the
probe finds it frozen.

The deadline is learned from the engine's own answers: ``factor`` times the longest wait
for a first byte it has had recently (a decaying maximum: one slow answer is forgotten
slowly, at ``DECAY`` per answer), at least ``floor_s`` and at most ``cap_s`` (the
engine timeout). It runs from the last progress, not from a request's send, so a request
queued behind others on a busy engine does not trip it while the engine answers them.
An engine busy with a long non-streamed answer (its bytes come only with its last token)
shows progress through its counters: vLLM's move every step, the reference engine
counts each token as it is decoded (``kvatlas_engine_decoded_tokens_total``). An engine
whose metrics have no such counter is covered by the floor and by what it answered
before.

Single-threaded (the router's loop); time is a parameter. Must not: do I/O, or end any
await itself (the service trips the wires).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final

DECAY: Final = 0.98
"""Per observed first byte, the learned wait shrinks by this factor unless matched."""
PROGRESS_METRICS: Final = (
    "kvatlas_engine_decoded_tokens_total",
    "kvatlas_engine_prefilled_tokens_total",
    "kvatlas_engine_generation_tokens_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
)
"""Counters whose movement between two probes shows that an engine works."""


@dataclass(slots=True)
class FirstByteWatch:
    """One engine's progress and its learned wait for a first byte."""

    learned_s: float = 0.0
    """The decaying maximum of its waits for a first byte (0 before one)."""
    last_progress: float = 0.0
    """When it last showed progress (or began work while idle)."""
    trips: int = 0
    _counters: tuple[float, ...] = ()

    def began(self, idle: bool, now: float) -> None:
        """A request was sent to it; when it had none in flight, the silence starts now."""
        if idle:
            self.last_progress = now

    def first_byte(self, waited_s: float, now: float) -> None:
        """A request's answer began (a stream's first piece, any other answer's head)
        after ``waited_s``."""
        self.learned_s = max(waited_s, self.learned_s * DECAY)
        self.last_progress = now

    def piece(self, now: float) -> None:
        """A piece of a relayed answer came."""
        self.last_progress = now

    def probed(self, samples: Mapping[str, float], now: float) -> None:
        """A probe's samples: progress when a progress counter moved since the last."""
        if not samples:  # no answer, or none of its metrics: nothing learned
            return
        counters = tuple(samples.get(m, -1.0) for m in PROGRESS_METRICS)
        if self._counters and counters != self._counters:
            self.last_progress = now
        self._counters = counters

    def deadline_s(self, floor_s: float, factor: float, cap_s: float) -> float:
        return min(cap_s, max(floor_s, factor * self.learned_s))


@dataclass(frozen=True, slots=True)
class Overdue:
    """An engine past its deadline: its URL, how long it has been silent, the deadline."""

    url: str
    silent_s: float
    deadline_s: float


def overdue(
    watches: Iterable[tuple[str, FirstByteWatch, int]],
    now: float,
    floor_s: float,
    factor: float,
    cap_s: float,
) -> list[Overdue]:
    """The engines, given as (URL, watch, awaits waiting on it), that have awaits
    waiting and have been silent for longer than their deadline."""
    out = []
    for url, watch, waiting in watches:
        if not waiting:
            continue
        silent = now - watch.last_progress
        deadline = watch.deadline_s(floor_s, factor, cap_s)
        if silent > deadline:
            out.append(Overdue(url, silent, deadline))
    return out
