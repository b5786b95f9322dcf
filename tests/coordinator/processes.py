"""A coordinator run as its own process through the real CLI (for kill -9 tests)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx


class CoordinatorProcess:
    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvatlas.cli.coordinator",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                *args,
            ],
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
        )
        self.lines: list[str] = []
        self._port: int | None = None
        self._found = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if not self._found.wait(20):
            self.kill()
            raise RuntimeError("coordinator did not start:\n" + "".join(self.lines))
        assert self._port is not None
        self.url = f"http://127.0.0.1:{self._port}"
        self.client = httpx.Client(base_url=self.url, timeout=30)

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)
            m = re.search(r"Coordinator listening on 127\.0\.0\.1:(\d+)", line)
            if m:
                self._port = int(m.group(1))
                self._found.set()

    def wait_ready(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while self.client.get("/readyz").status_code != 200:
            assert time.monotonic() < deadline, "not ready"
            time.sleep(0.05)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def terminate(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(20)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.kill()
        self._reader.join(10)
        if self.proc.stderr is not None:
            self.proc.stderr.close()
        if hasattr(self, "client"):
            self.client.close()
