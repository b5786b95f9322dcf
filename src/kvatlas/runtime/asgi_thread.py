"""uvicorn serving an ASGI app on a socket bound at construction, in a thread.

The cache server's status endpoints, the reference engine's OpenAI server and the router
all serve a Starlette app this way: bind first (a port in use raises ``PortInUse`` naming
the flag before anything slow starts), serve in a daemon thread, wait until uvicorn says
it started, stop by asking it to exit. ``serve_until_signal`` is their process' run loop.
Must not: know what the app serves.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any, Literal

import uvicorn

from kvatlas.core.errors import KvatlasError
from kvatlas.runtime.net import bind

log = logging.getLogger(__name__)


class ServeError(KvatlasError):
    """The HTTP server did not start, or stopped while it should be serving."""


class AsgiThread:
    """One ASGI app, one pre-bound socket, one uvicorn thread.

    ``what``/``flag`` name the server and the flag of its port in a ``PortInUse``.
    ``lifespan`` "on" runs the app's startup/shutdown (the router's clients open there).
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        what: str,
        flag: str,
        lifespan: Literal["on", "off"] = "off",
        loop: Literal["auto", "uvloop", "asyncio"] = "auto",
    ) -> None:
        self._sock = bind(host, port, what, flag)
        self.port: int = self._sock.getsockname()[1]
        self._what = what
        self._lifespan: Literal["on", "off"] = lifespan
        self._loop: Literal["auto", "uvloop", "asyncio"] = loop
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    def start(self, app: Any, *, name: str, timeout_s: float = 10.0) -> None:
        """Serve ``app`` in a thread called ``name``; returns once uvicorn has started."""
        config = uvicorn.Config(
            app, log_level="warning", lifespan=self._lifespan, access_log=False, loop=self._loop
        )
        server = self._server = uvicorn.Server(config)
        thread = self._thread = threading.Thread(
            target=server.run, kwargs={"sockets": [self._sock]}, name=name, daemon=True
        )
        thread.start()
        deadline = time.monotonic() + timeout_s
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise ServeError(f"{self._what} on port {self.port} did not start")
            time.sleep(0.01)

    @property
    def alive(self) -> bool:
        """False once a started server's thread has ended (it crashed or was stopped)."""
        return self._thread is None or self._thread.is_alive()

    def stop(self, timeout_s: float = 15.0) -> None:
        """Ask uvicorn to exit, wait up to ``timeout_s``, close the socket. Idempotent."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
        self._sock.close()


def serve_until_signal(
    http: AsgiThread,
    stop: threading.Event,
    start: Callable[[], None],
    shutdown: Callable[[], None],
) -> None:
    """A process' run loop: on SIGTERM or SIGINT set ``stop``; call ``start``, wait until
    ``stop`` is set (a ``ServeError`` if ``http``'s thread ends first), always ``shutdown``.
    Must be called from the main thread (signal handlers are installed there)."""

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("signal %d: stopping", signum)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        start()
        while not stop.wait(0.5):
            if not http.alive:
                raise ServeError(f"{http._what} stopped unexpectedly")
    finally:
        shutdown()
