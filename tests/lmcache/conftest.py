"""The LMCache compatibility suite's environment: .venv-lmcache, built on first use by
scripts/lmcache_env.sh (scripts/test.sh builds it before `make check`; the script
returns at once when it is built)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def lmcache_venv() -> Path:
    venv = Path(os.environ.get("KVATLAS_LMCACHE_VENV", ROOT / ".venv-lmcache"))
    subprocess.run(
        ["bash", str(ROOT / "scripts" / "lmcache_env.sh")],
        check=True,
        env={**os.environ, "KVATLAS_LMCACHE_VENV": str(venv)},
    )
    return venv
