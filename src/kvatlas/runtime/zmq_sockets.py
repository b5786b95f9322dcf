"""ZeroMQ listening sockets, set up one way in every process.

Owns how a process binds a ZeroMQ socket others connect to: no linger at close (a
stopping process never waits on a peer that reads slowly), for a ROUTER a cap on one
inbound message (ZeroMQ refuses a larger one from its size header and disconnects the
sender before anything of it is buffered) and an optional receive high-water mark,
IPv6 by the host's form (`kvatlas.runtime.net.zmq_tcp`, as the plain sockets read it).
Two ways to say where:

- ``bind_router``: a ROUTER on host:port (port 0: a free one), a taken port reported as
  ``PortInUse`` naming the flag to change, as `kvatlas.runtime.net.bind` does for TCP
  (the engine API, the P2P control channel);
- ``bind_endpoint``: a socket of any kind on an endpoint an operator wrote whole
  (``tcp://*:5557``, ``ipc://...``), a failure reported as ``ConfigError`` naming the flag
  (the vLLM KV-event PUB and replay ROUTER).

Must not: own a context, poll, send or receive (the sockets' owners do, on their threads).
"""

from __future__ import annotations

from dataclasses import dataclass

import zmq

from kvatlas.core.errors import ConfigError, PortInUse, ServiceError
from kvatlas.runtime.net import zmq_tcp

Context = zmq.Context[zmq.Socket[bytes]]


@dataclass(frozen=True, slots=True)
class BoundSocket:
    """A bound socket and where it listens."""

    socket: zmq.Socket[bytes]
    endpoint: str
    """What the socket bound, as ZeroMQ reports it (``tcp://127.0.0.1:6555``)."""
    port: int
    """The TCP port bound (the free one picked for port 0)."""


def _configured(
    ctx: Context, kind: int, ipv6: bool, max_message_bytes: int | None, recv_hwm: int | None
) -> zmq.Socket[bytes]:
    sock: zmq.Socket[bytes] = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IPV6, ipv6)
    if max_message_bytes is not None:
        sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    if recv_hwm is not None:
        sock.setsockopt(zmq.RCVHWM, recv_hwm)
    return sock


def bind_router(
    ctx: Context,
    host: str,
    port: int,
    *,
    what: str,
    flag: str,
    max_message_bytes: int,
    recv_hwm: int | None = None,
) -> BoundSocket:
    """A ROUTER bound on host:port (port 0: a free one); PortInUse when the port is
    taken, ServiceError for another failure, both naming ``what`` and ``flag``."""
    where, v6 = zmq_tcp(host)
    sock = _configured(ctx, zmq.ROUTER, v6, max_message_bytes, recv_hwm)
    try:
        if port == 0:
            port = sock.bind_to_random_port(where)
        else:
            sock.bind(f"{where}:{port}")
    except zmq.ZMQError as exc:
        sock.close(linger=0)
        if exc.errno == zmq.EADDRINUSE:
            raise PortInUse(what, host, port, flag) from exc
        raise ServiceError(f"cannot bind {what} on {host}:{port} ({flag}): {exc}") from exc
    return BoundSocket(sock, sock.getsockopt_string(zmq.LAST_ENDPOINT), port)


def bind_endpoint(
    ctx: Context, kind: int, endpoint: str, *, flag: str, max_message_bytes: int | None = None
) -> zmq.Socket[bytes]:
    """A socket of ``kind`` bound on ``endpoint`` as written (``tcp://[::1]:5557`` binds
    IPv6); ConfigError naming ``flag`` when it cannot bind."""
    sock = _configured(ctx, kind, "[" in endpoint, max_message_bytes, None)
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        sock.close(linger=0)
        raise ConfigError(f"{flag} {endpoint}: cannot bind: {exc}") from exc
    return sock
