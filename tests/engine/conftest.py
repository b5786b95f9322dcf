"""Fixtures for the engine's model tests: the models are loaded once per session.

SmolLM2 is converted from its GGUF once into pytest's cache folder (``.pytest_cache``),
so only the first run on a machine pays the ~20 s GGUF parse.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvatlas.engine.model import LoadedModel, load_model
from support.services import ServerProc, start_server_process


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
# A real ``kvatlas server`` process on loopback for the connector and OpenAI server tests,
# started by the one launcher and stopped by the pid it started, never by name.

StartCacheServer = Callable[..., ServerProc]


@pytest.fixture
def start_cache_server(tmp_path: Path) -> Iterator[StartCacheServer]:
    """Start cache server processes (chunk size 256 unless given); all stopped at the end."""
    started: list[ServerProc] = []

    def start(*extra: str, port: int = 0, instance_id: str = "node-a") -> ServerProc:
        server = start_server_process(
            tmp_path, instance_id, "--l1-size-gb", "0.05", "--engine-workers", "2", *extra,
            port=port,
        )  # fmt: skip
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()
