"""One vLLM engine's sockets, stepped by the coordinator's ingest thread
(`kvatlas.coordinator.vllm.ingest`, which polls every engine's at once).

Owns an engine's ZeroMQ SUB on its PUB socket (with a monitor of its connections), the
DEALER on its replay ROUTER, the replay request in flight and its deadline, and the
idle check's clock; what a message or a clock asks of the engine's stream goes to the
ingest (`_take`, `_apply`, under its lock). Must not: decode (that is
`kvatlas.wire.vllm_events`), index, or run a thread of its own.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvatlas.coordinator.vllm.sources import VllmSource
from kvatlas.core.coordinator.engine_stream import Outcome
from kvatlas.wire.vllm_events import is_replay_end, replay_request

if TYPE_CHECKING:
    from kvatlas.coordinator.vllm.ingest import VllmIngest

log = logging.getLogger("kvatlas.coordinator.vllm.ingest")
"""The ingest's logger: an engine's lines read as the ingest's, as they did."""


class EngineLink:
    """One engine's sockets and replay bookkeeping, stepped by the ingest thread: a SUB
    on its PUB socket (with a monitor of its connections), a DEALER on its replay socket,
    the replay request in flight and its deadline, and the idle check's clock."""

    def __init__(self, ingest: VllmIngest, src: VllmSource) -> None:
        self.ingest = ingest
        self.src = src
        self.engine = src.engine
        self.stream = ingest.streams[src.engine]
        ctx = ingest._ctx
        self.sub: zmq.Socket[bytes] = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, src.topic.encode())
        self.sub.setsockopt(zmq.LINGER, 0)
        # Every (re)connection of the SUB asks for a full replay: it fills what was
        # published before the subscription took, and reveals a restarted publisher. The
        # monitor is attached before the connect, or the first connection's event (and
        # with it the first replay) could be over before anyone listens.
        self.monitor = self.sub.get_monitor_socket(zmq.EVENT_CONNECTED)
        self.sub.connect(src.endpoint)
        self.dealer: zmq.Socket[bytes] | None = None
        if src.replay:
            self.dealer = ctx.socket(zmq.DEALER)
            self.dealer.setsockopt(zmq.LINGER, 0)
            # Requests queue only on a live connection: a send while the engine is down
            # fails at once (zmq.Again) instead of piling up stale requests.
            self.dealer.setsockopt(zmq.IMMEDIATE, 1)
            self.dealer.connect(src.replay)
        self.deadline = 0.0
        self.full_owed = False
        """A full replay a (re)connection asked for, not sent yet."""
        self.unsent: int | None = None
        """A replay request the socket has not taken yet."""
        self.last_heard = time.monotonic()
        self.seen: dict[tuple[int, int], None] = {}
        """Malformed messages counted: (seq, payload fingerprint)."""
        log.info("vLLM KV events of %s: SUB %s, replay %s", src.engine, src.endpoint, src.replay)

    def sockets(self) -> list[zmq.Socket[bytes]]:
        out = [self.sub, self.monitor]
        if self.dealer is not None:
            out.append(self.dealer)
        return out

    def close(self) -> None:
        self.sub.disable_monitor()
        self.monitor.close(linger=0)
        self.sub.close(linger=0)
        if self.dealer is not None:
            self.dealer.close(linger=0)

    def _send(self, start: int) -> None:
        assert self.dealer is not None
        try:
            self.dealer.send_multipart(replay_request(start), zmq.NOBLOCK)
        except zmq.Again:
            # Not connected to the replay socket (yet): retried every poll until the
            # replay's deadline; live batches wait meanwhile.
            self.unsent = start
            return
        self.unsent = None
        self.stream.replay_sent()
        if start == 0:
            self.full_owed = False

    def _handle(self, out: Outcome, resync: bool = False) -> None:
        ing = self.ingest
        ing._apply(self.engine, out)
        if out.replay_from is None:
            return
        if self.dealer is None:
            ing._apply(self.engine, self.stream.replay_done())
            return
        # An idle check is a resync, counted apart: an idle engine asks one every
        # ``resync_s``, and replays should count what repairs something.
        ing.counts[self.engine]["resyncs" if resync else "replays"] += 1
        log.log(
            logging.DEBUG if resync else logging.INFO,
            "vLLM KV events of %s: %s from seq %d",
            self.engine,
            "resync" if resync else "replay",
            out.replay_from,
        )
        self.deadline = time.monotonic() + ing._replay_timeout
        self._send(out.replay_from)

    def step(self, ready: Mapping[Any, int], now: float) -> None:
        """Read what is ready on this engine's sockets, then its clocks."""
        ing, stream = self.ingest, self.stream
        if self.monitor in ready:
            while self.monitor.poll(0):
                recv_monitor_message(self.monitor)
                log.info("vLLM KV events of %s: connected to %s", self.engine, self.src.endpoint)
                with ing.lock:
                    self._handle(stream.reconnected())
        if self.dealer is not None and self.dealer in ready:
            while self.dealer.poll(0):
                frames = self.dealer.recv_multipart()[1:]
                if is_replay_end(frames):
                    with ing.lock:
                        self._handle(stream.replay_end())
                else:
                    ing._take(self.engine, frames, stream.replayed, self._handle, self.seen)
            self.last_heard = now
        if self.sub in ready:
            for _ in range(1000):
                try:
                    frames = self.sub.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                ing._take(self.engine, frames, stream.live, self._handle, self.seen)
            self.last_heard = now
        if self.unsent is None and not stream.replaying and now - self.last_heard <= ing._resync:
            return  # the usual case: nothing owed, nothing late
        with ing.lock:
            if self.unsent is not None and now <= self.deadline:
                self._send(self.unsent)
            if stream.replaying and now > self.deadline and self.deadline:
                if self.unsent is not None:
                    # Never reached the engine: the next quiet spell asks again (in
                    # full when this was the full replay of a connection).
                    ing.counts[self.engine]["replay_unsent"] += 1
                    self.full_owed = self.full_owed or self.unsent == 0
                    self.unsent = None
                else:
                    ing.counts[self.engine]["replay_timeouts"] += 1
                log.warning(
                    "vLLM KV events of %s: replay not ended within %.1fs",
                    self.engine,
                    ing._replay_timeout,
                )
                self.deadline = 0.0
                self._handle(stream.replay_done())
            elif (
                self.dealer is not None
                and not stream.replaying
                and now - self.last_heard > ing._resync
            ):
                self.last_heard = now
                self._handle(
                    stream.reconnected() if self.full_owed else stream.connect(), resync=True
                )
