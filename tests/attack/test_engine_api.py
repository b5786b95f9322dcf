"""Issue #14, item 1: four engine-API requests whose token is not ASCII killed a server's
engine-API workers (``TypeError`` in the comparison), and the same header made `/status`
and `/metrics` answer 500. Replayed against a real ``kvatlas server``: every such request
is refused, and the server keeps serving the right token afterwards.

The gate itself, on every input (hypothesis): ``tests/runtime/test_auth.py``.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from kvatlas.connector.client import CacheClient, Unauthorized

from .conftest import BEARER, CHUNK, TOKEN, start_server

MODEL = "tiny"


def test_non_ascii_tokens_are_refused_and_the_server_keeps_serving(
    tmp_path: Path, token_file: Path
) -> None:
    s = start_server(tmp_path, "node-secret", token_file)  # 2 engine workers
    try:
        for path in ("/status", "/metrics"):
            for value in ("Bearer é".encode(), "Bearer é".encode("latin-1"), b"\xff\xfe"):
                r = httpx.get(s.url + path, headers={"Authorization": value}, timeout=5)
                assert r.status_code == 401, (path, value, r.text)
        for _ in range(4):  # more than the workers
            bad = CacheClient(s.engine_url, timeout_s=5.0, auth_token="é")
            with pytest.raises(Unauthorized):
                bad.register(MODEL, "float16", (2, 2, 8), chunk_size=CHUNK)
            bad.close()
        trusted = CacheClient(s.engine_url, timeout_s=5.0, auth_token=TOKEN)
        trusted.register(MODEL, "float16", (2, 2, 8), chunk_size=CHUNK)
        assert trusted.lookup(list(range(CHUNK))).hit_tokens == 0
        trusted.close()
        assert httpx.get(f"{s.url}/status", headers=BEARER, timeout=5).status_code == 200
    finally:
        assert s.stop() == 0, s.text()
