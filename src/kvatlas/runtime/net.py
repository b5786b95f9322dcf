"""Binding listening sockets, the same way in every process.

Owns ``bind``: a TCP socket on host:port (IPv4 or IPv6, by the host's form) that a
restarted process gets back while its old connections sit in TIME_WAIT, and a taken port
reported as ``PortInUse`` naming the flag to change; ``tcp_family`` and ``zmq_tcp``, the
same reading of a host for the plain and ZeroMQ sockets that bind it themselves
(`zmq_sockets`, the tcp transport), so that every listening socket of a
process is on the host its flag names, an IPv6 address included. Must not: listen,
accept or serve (the HTTP servers and ZeroMQ sockets do).
"""

from __future__ import annotations

import errno
import socket

from kvatlas.core.errors import PortInUse, ServiceError


def tcp_family(host: str) -> socket.AddressFamily:
    """AF_INET6 for an IPv6 address (``::1``, with or without brackets), else AF_INET
    (an IPv4 address or a name, which resolves to IPv4 as every kvatlas socket binds)."""
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def zmq_tcp(host: str, port: int | None = None) -> tuple[str, bool]:
    """The ZeroMQ endpoint of ``host`` (and ``port``, when given; none for
    ``bind_to_random_port``) and whether the socket needs ``zmq.IPV6`` set: ZeroMQ takes
    an IPv6 address only in brackets and only on a socket with that option, and refuses
    it otherwise ("No such device")."""
    bare = host.strip("[]")
    v6 = ":" in bare
    where = f"tcp://[{bare}]" if v6 else f"tcp://{bare}"
    return (where if port is None else f"{where}:{port}"), v6


def bind(host: str, port: int, what: str, flag: str) -> socket.socket:
    """A bound, not yet listening TCP socket on host:port; PortInUse when taken."""
    family = tcp_family(host)
    sock = socket.socket(family, socket.SOCK_STREAM)
    # A restarted process must get its port back while the old connections sit in
    # TIME_WAIT; a port another process listens on still fails (Linux semantics).
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise PortInUse(what, host, port, flag) from exc
        raise ServiceError(f"cannot bind {what} on {host}:{port} ({flag}): {exc}") from exc
    return sock
