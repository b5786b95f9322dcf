"""Fixtures for the engine's model tests: the models are loaded once per session.

SmolLM2 is converted from its GGUF once into pytest's cache folder (``.pytest_cache``),
so only the first run on a machine pays the ~20 s GGUF parse.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported

import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from kvatlas.engine.model import LoadedModel, load_model
from procs import free_port


@pytest.fixture(scope="session")
def tiny() -> LoadedModel:
    return load_model("tiny-random")


@pytest.fixture(scope="session")
def smol_cache_dir(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    cache = getattr(request.config, "cache", None)
    if cache is not None:
        return Path(cache.mkdir("kvatlas-models"))
    return tmp_path_factory.mktemp("kvatlas-models")


@pytest.fixture(scope="session")
def smol(smol_cache_dir: Path) -> LoadedModel:
    return load_model("smollm2-135m", conversion_cache=smol_cache_dir)


# ----------------------------------------------------------------------------- cache server
# A real ``kvatlas server`` process on loopback for the connector and OpenAI server tests.
# Processes are stopped by the pid the fixture started, never by name.


@dataclass
class CacheServerProc:
    """A cache server process this test started (stop it by its pid only)."""

    proc: subprocess.Popen[bytes]
    port: int
    http_port: int
    log: Path

    @property
    def url(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def status(self) -> dict[str, object]:
        return dict(httpx.get(f"http://127.0.0.1:{self.http_port}/status", timeout=5).json())

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        url = f"http://127.0.0.1:{self.http_port}/healthz"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"cache server exited: {self.log.read_text()}")
            try:
                if httpx.get(url, timeout=0.5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise AssertionError("cache server did not come up")

    def kill(self) -> None:
        """SIGKILL: the server dies without cleaning anything up."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return int(self.proc.returncode)


StartCacheServer = Callable[..., CacheServerProc]


@pytest.fixture
def start_cache_server(tmp_path: Path) -> Iterator[StartCacheServer]:
    """Start cache server processes (chunk size 256 unless given); all stopped at the end."""
    started: list[CacheServerProc] = []

    def start(
        *extra: str, port: int | None = None, instance_id: str = "node-a", wait: bool = True
    ) -> CacheServerProc:
        port = port or free_port()
        http_port = free_port()
        log = tmp_path / f"{instance_id}-{port}-{len(started)}.log"
        args = [
            sys.executable, "-m", "kvatlas.cli.server",
            "--host", "127.0.0.1", "--port", str(port), "--http-port", str(http_port),
            "--instance-id", instance_id, "--l1-size-gb", "0.05",
            "--state-dir", str(tmp_path / "state"), "--engine-workers", "2", *extra,
        ]  # fmt: skip
        with log.open("wb") as f:
            proc = subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT)
        server = CacheServerProc(proc, port, http_port, log)
        started.append(server)
        if wait:
            server.wait_ready()
        return server

    yield start
    for server in started:
        server.stop()
