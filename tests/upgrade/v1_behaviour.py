"""What the first release did with protocol versions (copied from commit 5277bc7): the
P2P channel's and the engine API's servers answer version 1 only and refuse any other
with a bare ``version`` error; the P2P client asks in 1 and never moves.

Functions to put in place of today's methods (``ChannelServer._answer``,
``ChannelClient.call``, ``EngineApi._answer``): `v1_node` does so in a whole server,
the unit tests in one part. They use the frozen wire (`support.frozen_wire_v1`) and
today's private helpers of those classes, so they fail loudly when those move.
"""

from __future__ import annotations

import threading
from typing import Any

import msgspec
import zmq

from kvatlas.server.p2p import channel
from kvatlas.wire.engine_proto import PeerFallback
from support.frozen_wire_v1 import engine_proto as frozen_engine
from support.frozen_wire_v1 import p2p_proto as frozen_p2p


def channel_answer(self: Any, handler: Any, payload: bytes) -> Any:
    try:
        req = frozen_p2p.decode_request(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        self.errors += 1
        env = frozen_p2p.decode_envelope(payload)
        code: frozen_p2p.P2PErrorCode = (
            "version" if env.v != frozen_p2p.P2P_PROTOCOL_VERSION else "invalid_input"
        )
        return frozen_p2p.P2PResponse(
            frozen_p2p.P2P_PROTOCOL_VERSION,
            env.id,
            frozen_p2p.P2PError(code, f"bad request: {exc}"),
        )
    if req.v != frozen_p2p.P2P_PROTOCOL_VERSION:
        self.errors += 1
        return frozen_p2p.P2PResponse(
            frozen_p2p.P2P_PROTOCOL_VERSION,
            req.id,
            frozen_p2p.P2PError(
                "version", f"protocol version {req.v} is not {frozen_p2p.P2P_PROTOCOL_VERSION}"
            ),
        )
    try:
        body = handler(req.body)
    except Exception as exc:
        self.errors += 1
        body = frozen_p2p.P2PError("internal", f"{type(exc).__name__}: {exc}")
    return frozen_p2p.P2PResponse(frozen_p2p.P2P_PROTOCOL_VERSION, req.id, body)


def channel_call(
    self: Any, body: Any, timeout_s: float, abandon: threading.Event | None = None
) -> Any:
    fallback = PeerFallback
    if timeout_s <= 0:
        raise channel.ChannelError(f"no time left to ask {self.url}", fallback.TIMEOUT)
    rid = next(self._ids)
    conn = self._take()
    try:
        conn.sock.send_multipart(
            [
                b"",
                frozen_p2p.encode(
                    frozen_p2p.P2PRequest(frozen_p2p.P2P_PROTOCOL_VERSION, rid, body)
                ),
            ],
            flags=zmq.NOBLOCK,
        )
        resp = frozen_p2p.decode_response(self._wait(conn, body, timeout_s, abandon))
    except zmq.ZMQError as exc:
        conn.close()
        raise channel.ChannelError(f"{self.url} failed: {exc}", fallback.PEER_DEAD) from exc
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        conn.close()
        raise channel.ChannelError(f"{self.url} answered garbage: {exc}", fallback.REFUSED) from exc
    except channel.ChannelError:
        conn.close()
        raise
    self._give_back(conn)
    if isinstance(resp.body, frozen_p2p.P2PError):
        raise channel.ChannelError(
            f"{self.url} refused: {resp.body.code}: {resp.body.message}", fallback.REFUSED
        )
    return resp.body


def engine_answer(self: Any, data: memoryview) -> bytes:
    version = frozen_engine.PROTOCOL_VERSION
    try:
        req = frozen_engine.decode_request(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        env = frozen_engine.decode_envelope(data)
        code: frozen_engine.ErrorCode = "invalid_input"
        msg = f"malformed engine request: {exc}"
        if env.v and env.v != version:
            code = "version"
            msg = f"engine protocol version {env.v} is not supported; this server speaks {version}"
        return frozen_engine.encode(
            frozen_engine.Response(version, env.id, frozen_engine.ErrorReply(code, msg))
        )
    if req.v != version:
        body: Any = frozen_engine.ErrorReply(
            "version",
            f"engine protocol version {req.v} is not supported; this server speaks {version}",
        )
    elif not self._gate.check(req.token):
        body = frozen_engine.ErrorReply(
            "unauthorized", "this cache server requires its --auth-token on engine requests"
        )
    else:
        body = self._service.handle(req.body)
    return frozen_engine.encode(frozen_engine.Response(version, req.id, body))
