"""Binding listening sockets, the same way in every process.

Owns ``bind``: a TCP socket on host:port (IPv4 or IPv6, by the host's form) that a
restarted process gets back while its old connections sit in TIME_WAIT, and a taken port
reported as ``PortInUse`` naming the flag to change. Must not: listen, accept or serve
(the HTTP servers and ZeroMQ sockets do).
"""

from __future__ import annotations

import errno
import socket

from kvatlas.core.errors import PortInUse, ServiceError


def bind(host: str, port: int, what: str, flag: str) -> socket.socket:
    """A bound, not yet listening TCP socket on host:port; PortInUse when taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
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
