"""LMCache MP requests on the engine API's ROUTER: which frames are LMCache's, and answers.

``kvatlas server --port`` serves both protocols on one socket, so replacing ``lmcache
server`` by ``kvatlas server`` with the same flags is the whole migration. The framing
tells them apart without a handshake: a kvatlas engine (``connector.client``) sends
``[b"", envelope]`` (an empty delimiter, then one frame), while LMCache's DEALER sends
``[uid, operation, *payloads]`` with ``uid`` a msgpack int, never empty. The engine
API's I/O thread asks ``claims``; claimed requests are admitted under the same queue
bounds and answered by the same worker threads through ``answer``.

Every claimed request gets exactly one reply: a transfer that fails answers the result
LMCache's adapters read as a failed transfer (``wire.FAILURE_RESULTS``); anything else
that cannot be served gets an error reply (see ``wire``). Unknown operations, other
LMCache versions, malformed payloads, refusals and failures are all logged (at most
once per ``_LOG_EVERY_S`` per reason) and counted by reason. Stream control frames
(``[uid, b"", b"ack"|b"cancel"]``, for ``subscribe_kv_events``, which this server does
not advertise) expect no reply: they are dropped and counted.

Must not: touch the store (``service``) or the socket (the engine API's I/O thread).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Sequence
from typing import Protocol

from kvatlas.server.lmcache_mp.service import LMCacheMPService, MpError
from kvatlas.server.lmcache_mp.wire import (
    FAILURE_RESULTS,
    LMCACHE_VERSION,
    V056,
    Request,
    WireError,
    decode_operation,
    decode_request,
    encode_reply,
    error_reply,
)

log = logging.getLogger(__name__)

_LOG_EVERY_S = 10.0


class _Frame(Protocol):
    @property
    def bytes(self) -> bytes: ...


class LMCacheMPHandler:
    """The LMCache side of the shared ROUTER."""

    def __init__(self, service: LMCacheMPService, refusal: str | None = None) -> None:
        """``refusal``: why every request is refused (the protocol is off), or None."""
        self.service = service
        self._refusal = refusal
        self.errors: Counter[str] = Counter()
        """Error replies and dropped frames, by reason."""
        self._next_log: dict[str, float] = {}

    @staticmethod
    def claims(frames: Sequence[_Frame]) -> bool:
        """True for LMCache's framing (I/O thread: cheap, no decoding)."""
        return len(frames) >= 2 and frames[1].bytes != b""

    @staticmethod
    def expects_reply(frames: Sequence[_Frame]) -> bool:
        """False for a stream control frame (its operation frame is empty)."""
        return len(frames) >= 3 and frames[2].bytes != b""

    def drop(self, frames: Sequence[_Frame]) -> None:
        self._count("stream_control", "LMCache stream control frame dropped (no streams here)")

    def answer(self, frames: Sequence[_Frame]) -> list[bytes]:
        """The reply to one claimed request (worker thread); never raises."""
        raw = [f.bytes for f in frames]
        if self._refusal is not None:
            self._count("disabled", self._refusal)
            return error_reply(raw, self._refusal)
        try:
            req = decode_request(raw)
        except WireError as exc:
            self._count(exc.reason, str(exc))
            return error_reply(raw, str(exc))
        except Exception as exc:  # a payload no decoder anticipated: still one reply
            self._count("malformed", f"{type(exc).__name__}: {exc}")
            return error_reply(raw, f"malformed request: {type(exc).__name__}: {exc}")
        if req.unknown_fields:  # a newer client: served, its extra fields skipped
            self._count(
                "newer_fields",
                f"{req.operation} carried fields LMCache {req.version or V056} does not have",
            )
        try:
            result = self.service.handle(req.operation, req.args)
            return encode_reply(req, result)
        except MpError as exc:
            self._count(exc.reason, f"{req.operation}: {exc}")
            reason = f"{req.operation}: {exc}"
        except Exception as exc:
            self.errors["internal"] += 1
            log.exception(
                "LMCache %s failed on instance %s incarnation %d",
                req.operation,
                self.service.identity.instance_id,
                self.service.identity.incarnation,
            )
            reason = f"{req.operation} failed: {type(exc).__name__}: {exc}"
        if req.operation in FAILURE_RESULTS:
            return encode_reply(req, FAILURE_RESULTS[req.operation])
        return error_reply(raw, reason)

    def overloaded(self, frames: Sequence[_Frame], reason: str) -> list[bytes]:
        """The at-once reply to a request the engine API's queue bounds refuse (I/O
        thread): a transfer's failure result, else an error reply; the operation frame
        alone is decoded."""
        raw = [f.bytes for f in frames]
        self._count("overloaded", reason)
        try:
            op = decode_operation(raw[2]) if len(raw) > 2 else ""
        except WireError:
            op = ""
        if op in FAILURE_RESULTS:
            return encode_reply(Request(raw[0], raw[1], raw[2], op, ()), FAILURE_RESULTS[op])
        return error_reply(raw, f"overloaded: {reason}; recompute, or retry later")

    def _count(self, reason: str, message: str) -> None:
        self.errors[reason] += 1
        now = time.monotonic()
        if now >= self._next_log.get(reason, 0.0):
            self._next_log[reason] = now + _LOG_EVERY_S
            log.warning(
                "LMCache MP request refused (%s, %d so far; this server speaks LMCache %s):"
                " %s (instance %s incarnation %d)",
                reason,
                self.errors[reason],
                LMCACHE_VERSION,
                message,
                self.service.identity.instance_id,
                self.service.identity.incarnation,
            )
