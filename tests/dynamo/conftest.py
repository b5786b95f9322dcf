"""The Dynamo compatibility suite's environment: .venv-dynamo (NVIDIA Dynamo 1.6.1's
runtime wheel), built on first use by scripts/dynamo_env.sh (scripts/test.sh builds it
before `make check`; the script returns at once when it is built), and Dynamo's
standalone KV indexer, ``python -m dynamo.indexer``, run from it.

`DynamoIndexer` starts one on a free port (Dynamo binds every interface; the tests
reach it on 127.0.0.1), registers the ZeroMQ sources it reads through its own HTTP API
(``POST /register``: unlike its ``--workers`` flag it takes a replay endpoint, so a
subscriber that joins late catches up as it would in a deployment), answers ``POST
/query`` and stops by its pid. Must not: judge what Dynamo answers (the tests do).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvatlas.launch.procs import free_port
from support.wait import wait_until

ROOT = Path(__file__).resolve().parents[2]
DYNAMO_VERSION = "1.6.1"


@pytest.fixture(scope="session")
def dynamo_venv() -> Path:
    venv = Path(os.environ.get("KVATLAS_DYNAMO_VENV", ROOT / ".venv-dynamo"))
    subprocess.run(
        ["bash", str(ROOT / "scripts" / "dynamo_env.sh")],
        check=True,
        env={**os.environ, "KVATLAS_DYNAMO_VENV": str(venv)},
    )
    return venv


@dataclass(eq=False)
class DynamoIndexer:
    """One ``python -m dynamo.indexer`` process and its HTTP API."""

    proc: subprocess.Popen[bytes]
    url: str
    model: str
    block_size: int
    log: Path

    @classmethod
    def start(cls, venv: Path, log: Path, *, model: str, block_size: int) -> DynamoIndexer:
        port = free_port()
        argv = [
            str(venv / "bin" / "python"), "-m", "dynamo.indexer", "--port", str(port),
            "--threads", "1", "--block-size", str(block_size), "--model-name", model,
        ]  # fmt: skip
        with log.open("wb") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        indexer = cls(proc, f"http://127.0.0.1:{port}", model, block_size, log)
        try:
            wait_until(indexer._answers, what=f"Dynamo's indexer on port {port}", timeout=60)
        except BaseException:
            indexer.stop()
            raise
        return indexer

    def _answers(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"Dynamo's indexer exited {self.proc.returncode}:\n{self.tail()}")
        try:
            return httpx.get(f"{self.url}/workers", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    def register(self, instance_id: int, endpoint: str, replay: str | None = None) -> None:
        """Read a source of vLLM KV events as worker ``instance_id``, as the indexer's
        ``--workers`` would, with a replay endpoint when given."""
        body: dict[str, Any] = {
            "instance_id": instance_id,
            "endpoint": endpoint,
            "model_name": self.model,
            "block_size": self.block_size,
        }
        if replay is not None:
            body["replay_endpoint"] = replay
        r = httpx.post(f"{self.url}/register", json=body, timeout=10)
        assert r.status_code == 201, r.text

    def query(self, tokens: Sequence[int], cache_salt: str | None = None) -> dict[str, Any]:
        """``POST /query``: ``scores`` (its device tier only), ``instances`` (per worker:
        ``longest_matched``, ``gpu``, ``cpu``, ``disk``, matched tokens, cumulative
        through the tiers before)."""
        body: dict[str, Any] = {"token_ids": list(tokens), "model_name": self.model}
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        r = httpx.post(f"{self.url}/query", json=body, timeout=10)
        assert r.status_code == 200, r.text
        answer: dict[str, Any] = r.json()
        return answer

    def tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def stop(self) -> int:
        """Stop the process by its pid; its exit status."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


@pytest.fixture
def start_dynamo_indexer(
    dynamo_venv: Path, tmp_path: Path
) -> Iterator[Callable[..., DynamoIndexer]]:
    """Start Dynamo indexers (``model``, ``block_size``); each is stopped at the end."""
    started: list[DynamoIndexer] = []

    def start(*, model: str = "m", block_size: int = 16) -> DynamoIndexer:
        log = tmp_path / f"dynamo-indexer-{len(started)}.log"
        indexer = DynamoIndexer.start(dynamo_venv, log, model=model, block_size=block_size)
        started.append(indexer)
        return indexer

    yield start
    for indexer in started:
        indexer.stop()
