"""The .venv-lmcache fixture of the LMCache compatibility suite, shared."""

from __future__ import annotations

from lmcache.conftest import lmcache_venv

__all__ = ["lmcache_venv"]
