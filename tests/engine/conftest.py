"""Fixtures for the engine's model tests: the models are loaded once per session.

SmolLM2 is converted from its GGUF once into pytest's cache folder (``.pytest_cache``),
so only the first run on a machine pays the ~20 s GGUF parse.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported

from pathlib import Path

import pytest

from kvatlas.engine.model import LoadedModel, load_model


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
