"""LMCache 0.5.6 and 0.5.7rc2 MP clients on one ``kvatlas server`` port.

Without LMCache: 0.5.7's ``token_bytes`` codec, how each request's release is told from
what it sends, and what 0.5.7's new arguments and operations do. With both releases'
own, unmodified vLLM adapters (``mp_driver.py`` in .venv-lmcache, and in
.venv-lmcache057, marker ``lmcache``): one server, each client retrieves what the other
stored, byte for byte, and an operation kvatlas does not know is answered at once.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import msgspec
import pytest

from kvatlas.server.lmcache_mp.service import LMCacheMPService, MpError
from kvatlas.server.lmcache_mp.wire import (
    LMCACHE_VERSIONS,
    V056,
    V057,
    EngineDrivenRegistration,
    GroupLayout,
    IPCKey,
    WireError,
    decode_request,
    pack_token_ids,
    unpack_token_ids,
)
from lmcache_mp.driver import QUIET, Driver
from lmcache_mp.test_lmcache_mp import CHUNK as SERVER_CHUNK
from lmcache_mp.test_lmcache_mp import _ask, prompt, server
from lmcache_mp.test_service import CHUNK, key, register, svc
from support.launch import launch
from support.services import start_server_process

__all__ = ["svc"]  # the in-process service fixture, shared with test_service

ROOT = Path(__file__).resolve().parents[2]
DRIVER057 = Path(__file__).with_name("mp_driver.py")
"""The same stand-in vLLM as 0.5.6's: it tells the LMCache it runs under."""
enc = msgspec.msgpack.encode


# ---------------------------------------------------------------------- no LMCache


def key_map(token_field: str, tokens: list[int], **over: object) -> dict[str, object]:
    packed: object = pack_token_ids(tokens) if token_field == "token_bytes" else tokens
    base: dict[str, object] = {
        "model_name": "m",
        "world_size": 1,
        "worker_id": 0,
        token_field: packed,
        "start": 0,
        "end": len(tokens),
        "request_id": "r",
        "cache_salt": "",
        "request_configs": None,
        "num_kv_readers": 1,
    }
    return {**base, **over}


def test_token_bytes_are_big_endian_uint32() -> None:
    assert pack_token_ids([1, 0x01020304, 0xFFFFFFFF]) == (
        b"\x00\x00\x00\x01\x01\x02\x03\x04\xff\xff\xff\xff"
    )
    tokens = [0, 1, 255, 256, 65_535, 128_000, 2**32 - 1]
    assert unpack_token_ids(pack_token_ids(tokens)) == tokens
    assert unpack_token_ids(b"") == []
    with pytest.raises(WireError) as err:
        unpack_token_ids(b"\x00\x00\x01")
    assert err.value.reason == "malformed"


def test_each_request_names_its_release() -> None:
    tokens = list(range(40))
    old = decode_request([b"i", enc(1), enc(8), enc(key_map("token_ids", tokens)), enc(1)])
    new = decode_request([b"i", enc(2), enc(8), enc(key_map("token_bytes", tokens)), enc(1)])
    assert (old.version, new.version) == (V056, V057)
    assert not old.unknown_fields and not new.unknown_fields
    # the rest of the server sees the same key either way
    assert isinstance(new.args[0], IPCKey)
    assert msgspec.structs.astuple(new.args[0]) == msgspec.structs.astuple(old.args[0])
    # the argument count of a changed operation names the release too
    k57 = enc(key_map("token_bytes", tokens))
    k56 = enc(key_map("token_ids", tokens))
    prep = decode_request([b"i", enc(3), enc(16), k57, enc(1), enc([[1]])])
    assert prep.version == V057 and prep.args[2] == [[1]]
    free = decode_request([b"i", enc(4), enc(12), k57, enc(1), enc([[0, 16]])])
    assert free.version == V057 and free.args[2] == [(0, 16)]
    assert decode_request([b"i", enc(5), enc(12), k56, enc(1)]).version == V056
    # and so does a 0.5.7-only operation; one both send alike names none
    assert decode_request([b"i", enc(6), enc("negotiate_chunk_size"), enc(16)]).version == V057
    assert decode_request([b"i", enc(7), enc(21)]).version is None
    # a newer field in a 0.5.7 key is skipped and said, as for 0.5.6
    extra = decode_request(
        [b"i", enc(8), enc(8), enc(key_map("token_bytes", tokens, future=1)), enc(1)]
    )
    assert extra.version == V057 and extra.unknown_fields


@pytest.mark.parametrize(
    ("frames", "reason"),
    [
        # a 0.5.7 key with 0.5.6's argument count: no release sends that
        ([enc(16), enc(key_map("token_bytes", [1] * 16)), enc(1)], "version"),
        ([enc(12), enc(key_map("token_ids", [1] * 16)), enc(1), enc([])], "version"),
        ([enc(16), enc(key_map("token_ids", [1])), enc(1), enc([]), enc(0)], "version"),
        ([enc(8), enc(key_map("token_bytes", [1], token_bytes=b"\x00\x01")), enc(1)], "malformed"),
        ([enc("server_module_affinity_call"), enc({})], "version"),  # no method
        (
            [enc(5), enc(key_map("token_bytes", [1] * 16)), enc(1), enc([[1]]), enc(b"")],
            "unsupported",
        ),  # store_q (q cache): 0.5.6's and 0.5.7's, not served here
        ([enc("cb_reorder_plan"), enc(key_map("token_ids", [1])), enc(1), enc(2)], "unsupported"),
        ([enc("no_such_operation")], "version"),
    ],
)
def test_shapes_no_release_sends_are_refused(frames: list[bytes], reason: str) -> None:
    with pytest.raises(WireError) as err:
        decode_request([b"i", enc(1), *frames])
    assert err.value.reason == reason
    if reason == "version":
        assert all(v in str(err.value) for v in LMCACHE_VERSIONS)


def test_negotiate_chunk_size_answers_the_fixed_chunk_size(svc: LMCacheMPService) -> None:
    assert svc.handle("negotiate_chunk_size", (4,)) == CHUNK
    assert svc.handle("negotiate_chunk_size", (CHUNK,)) == CHUNK
    for bad in (0, 3, 2 * CHUNK):
        with pytest.raises(MpError):
            svc.handle("negotiate_chunk_size", (bad,))


def test_prepare_store_skips_the_chunks_057_names(svc: LMCacheMPService) -> None:
    register(svc)
    tokens = list(range(3 * CHUNK))
    prep = svc.handle("prepare_store", (key(tokens, 0, 3 * CHUNK, "s"), 1, [[1]]))
    assert prep["context"]["chunk_indices"] == [0, 2]
    assert svc.handle("commit_store", (key(tokens, 0, 3 * CHUNK, "s"), 1, b"")) is True
    svc.handle("lookup", (key(tokens, 0, 3 * CHUNK, "r", None), 1))
    assert svc.handle("query_prefetch_status", ("r",)) == 1  # chunk 1 was never written
    svc.handle("end_session", ("r",))
    for bad in ([[0], [1]], [[3]]):  # two groups for one; outside the range
        with pytest.raises(MpError):
            svc.handle("prepare_store", (key(tokens, 0, 3 * CHUNK, "t"), 1, bad))


def test_free_lookup_locks_releases_057s_extra_ranges(svc: LMCacheMPService) -> None:
    register(svc)
    tokens = list(range(2 * CHUNK))
    svc.handle("prepare_store", (key(tokens, 0, 2 * CHUNK, "s"), 1))
    svc.handle("commit_store", (key(tokens, 0, 2 * CHUNK, "s"), 1, b""))
    svc.handle("lookup", (key(tokens, 0, 2 * CHUNK, "r", None), 1))
    assert svc.handle("query_prefetch_status", ("r",)) == 2
    assert svc.guarded.store.pool.stats().read_leases == 2
    # an empty range of its own, an abandoned lookup's range as an extra one
    svc.handle("free_lookup_locks", (key(tokens, CHUNK, CHUNK, "r"), 1, [(0, CHUNK)]))
    assert svc.guarded.store.pool.stats().read_leases == 1
    svc.handle("free_lookup_locks", (key(tokens, CHUNK, 2 * CHUNK, "r"), 1, []))
    assert svc.guarded.store.pool.stats().read_leases == 0


def test_a_hybrid_worker_stores_and_retrieves_each_group_in_its_window(
    svc: LMCacheMPService,
) -> None:
    """Two KV groups as 0.5.7's worker registers them: full attention, and a sliding
    window of one chunk whose chunk objects hold half a chunk of tokens."""
    window = GroupLayout(1, 8, "float16", 4, window_tokens=CHUNK // 2, window_chunks=1)
    reg = EngineDrivenRegistration(
        1, "h", 1, 4, 2, 8, "float16", False, CHUNK, [GroupLayout(2, 8, "float16", 4), window]
    )
    assert svc.handle("register_kv_cache_engine_driven_context", (reg,))["null_block_id"] == 0
    tokens = list(range(3 * CHUNK))

    def hkey(rid: str, end: int = 3 * CHUNK, worker: int | None = 0) -> IPCKey:
        return IPCKey("h", 1, worker, tokens[:end], 0, end, rid, "", None, 1)

    # the window group's chunks 0 and 1 are all null blocks: the worker skips them
    prep = svc.handle("prepare_store", (hkey("s"), 1, [[], [0, 1]]))["context"]
    assert (prep["group_ids"], prep["chunk_indices"]) == ([0, 0, 0, 1], [0, 1, 2, 2])
    assert prep["slots"][0]["shape"] == [2, 2, CHUNK, 8]
    assert prep["slots"][3]["shape"] == [2, 1, CHUNK // 2, 8]
    assert svc.handle("commit_store", (hkey("s"), 1, b"")) is True
    svc.handle("lookup", (hkey("r", worker=None), 1))
    assert svc.handle("query_prefetch_status", ("r",)) == 3
    got = svc.handle("prepare_retrieve", (hkey("r"), 1))
    assert got["success"]
    ctx = got["context"]
    assert (ctx["group_ids"], ctx["chunk_indices"]) == ([0, 0, 0, 1], [0, 1, 2, 2])
    assert [s["offset"] for s in ctx["slots"]] == [s["offset"] for s in prep["slots"]]
    assert svc.handle("commit_retrieve", (hkey("r"), 1)) is True
    svc.handle("end_session", ("r",))
    # a shorter prefix needs the window group's chunk 1, never stored: a miss
    svc.handle("lookup", (hkey("q", end=2 * CHUNK, worker=None), 1))
    assert svc.handle("query_prefetch_status", ("q",)) == 0
    svc.handle("end_session", ("q",))
    assert svc.guarded.store.pool.stats().read_leases == 0
    with pytest.raises(MpError, match="2 registered"):  # one list per group
        svc.handle("prepare_store", (hkey("t"), 1, [[0]]))


def test_the_version_table_is_shown_in_help_and_deploy_doc() -> None:
    from kvatlas.cli.server import build_parser  # noqa: PLC0415 (the CLI, only here)

    help_text = " ".join(build_parser().format_help().split())
    doc = (ROOT / "docs" / "deploy.md").read_text()
    table = doc[doc.index("### LMCache versions this server answers") :]
    rows = {line.split("|")[1].strip() for line in table.splitlines() if line.startswith("| 0.")}
    assert rows == set(LMCACHE_VERSIONS)
    option = help_text[help_text.index("--lmcache-mp LMCACHE_MP LMCache") :][:200]
    assert all(version in option for version in LMCACHE_VERSIONS), option
    for version, how in LMCACHE_VERSIONS.items():  # the whole table, in the epilog
        assert f"{version}: {how}" in help_text, version


# ---------------------------------------------------------------------- real clients


@pytest.fixture(scope="session")
def lmcache057_venv() -> Path:
    venv = Path(os.environ.get("KVATLAS_LMCACHE057_VENV", ROOT / ".venv-lmcache057"))
    subprocess.run(
        ["bash", str(ROOT / "scripts" / "lmcache057_env.sh")],
        check=True,
        env={**os.environ, "KVATLAS_LMCACHE057_VENV": str(venv)},
    )
    return venv


class Driver057(Driver):
    """``Driver`` with LMCache 0.5.7rc2's adapters (``mp_driver.py`` in .venv-lmcache057)."""

    def __init__(self, venv: Path, url: str, mode: str, log: Path, *extra: str) -> None:
        env = {**os.environ, **QUIET}
        env.pop("PYTHONPATH", None)  # kvatlas' sources stay out of LMCache's interpreter
        self.proc = launch(
            [str(venv / "bin" / "python"), str(DRIVER057), url, mode, *extra],
            name=f"driver057-{mode}",
            log=log,
            env=env,
            wait=False,
            pipes=True,
        )
        self.ready = self._read()
        assert self.ready.get("ready"), self.ready


@pytest.mark.lmcache
@pytest.mark.parametrize("mode", ["engine_driven", "lmcache_driven"])
def test_056_and_057_clients_share_one_port(
    tmp_path: Path, lmcache_venv: Path, lmcache057_venv: Path, mode: str
) -> None:
    srv = server(tmp_path)
    old = new = None
    try:
        old = Driver(lmcache_venv, srv.engine_url, mode, tmp_path / "driver056.log")
        new = Driver057(lmcache057_venv, srv.engine_url, mode, tmp_path / "driver057.log")
        assert old.ready["chunk"] == new.ready["chunk"] == SERVER_CHUNK
        # 0.5.6 stores, 0.5.7 retrieves the same bytes; and the other way round
        for writer, reader, seed in ((old, new, 1), (new, old, 2)):
            tokens = prompt(seed)
            stored = writer.call("store", tokens, f"s{seed}", seed=seed)
            assert stored["ok"] and stored["hit"] == 0 and len(stored["digests"]) == 2, stored
            got = reader.call("fetch", tokens, f"f{seed}")
            assert got["ok"] and got["hit"] == 2, got
            assert got["digests"] == stored["digests"]
        metrics = srv.metrics()
        assert 'operation="negotiate_chunk_size"' in metrics  # 0.5.7's registration
        assert 'reason="version"' not in metrics and 'reason="malformed"' not in metrics
        assert srv.status()["leases"]["read"] == 0
    finally:
        for drv in (old, new):
            if drv is not None:
                drv.close()
        srv.stop()


@pytest.mark.lmcache
def test_unknown_and_057_only_operations_are_answered_at_once(tmp_path: Path) -> None:
    srv = start_server_process(tmp_path, "mp-b", "--l1-size-gb", "0.02")
    try:
        assert _ask(srv.engine_url, [enc(1), enc("negotiate_chunk_size"), enc(16)]) == [
            enc(1),
            enc("negotiate_chunk_size"),
            enc(SERVER_CHUNK),
        ]
        # a plug-in method: LMCache's own answer to one its server does not serve
        call = enc({"method": "pkg.echo", "payload": b"x"})
        for op in ("server_module_affinity_call", "server_module_call"):
            reply = _ask(srv.engine_url, [enc(5), enc(op), call])
            assert reply[:2] == [enc(5), enc(op)], reply
            assert msgspec.msgpack.decode(reply[2]) == {
                "success": False,
                "payload": b"",
                "error": "unknown server module method: pkg.echo",
            }
        for frames, want in (
            ([enc(2), enc("no_such_operation")], "0.5.7rc2"),
            (
                [enc(3), enc("cb_reorder_plan"), enc(key_map("token_ids", [1])), enc(1), enc(2)],
                "does not implement",
            ),
            ([enc(4), enc("negotiate_chunk_size"), enc(100)], "multiple"),
        ):
            reply = _ask(srv.engine_url, frames)  # fails if no reply within 10 s
            assert reply[0] == frames[0] and len(reply) == 2, reply
            text = msgspec.msgpack.decode(reply[1])
            assert text.startswith("error: ") and want in text, text
    finally:
        srv.stop()


@pytest.mark.lmcache
def test_057_client_fails_at_once_on_what_kvatlas_does_not_serve(
    tmp_path: Path, lmcache057_venv: Path
) -> None:
    """0.5.7rc2's own MessageQueueClient: an operation kvatlas does not serve fails the
    call at once (never the client's timeout), a stream is ended at once, and a plug-in
    call gets LMCache's own unknown-method reply, affinity or not."""
    srv = server(tmp_path)
    drv = Driver057(lmcache057_venv, srv.engine_url, "engine_driven", tmp_path / "d.log")
    try:
        for name, args in (
            ("cb_unregister_rope", [1]),  # a legacy id
            ("p2p_unlock_objects", [[]]),
            ("unregister_q_cache", [1]),
        ):
            got = drv.call("call", [], "", name=name, args=args)
            assert not got["ok"] and got["seconds"] < 5, got
            assert "error: " in got["error"] and "does not implement" in got["error"], got
        stream = drv.call("call", [], "", name="subscribe_kv_events", args=[1, "m", 0, 8])
        assert stream["ok"] and stream["result"] == [] and stream["seconds"] < 5, stream
        for name in ("server_module_affinity_call", "server_module_call"):
            got = drv.call("call", [], "", name=name, args=["pkg.echo", "x"])
            assert got["ok"] and got["seconds"] < 5, got
            assert "success=False" in got["result"], got
            assert "unknown server module method: pkg.echo" in got["result"], got
        assert 'reason="server_module"' in srv.metrics()
    finally:
        drv.close()
        srv.stop()


@pytest.mark.lmcache
def test_057_null_blocks_are_skipped_not_copied(tmp_path: Path, lmcache057_venv: Path) -> None:
    """0.5.7rc2's worker adapter, lmcache-driven on CPU (the server copies): a chunk whose
    block ids are all the null block (a hybrid model's dropped window) is not stored, so
    a later lookup stops before it; a retrieve never writes into the null block."""
    srv = server(tmp_path)
    drv = Driver057(lmcache057_venv, srv.engine_url, "lmcache_driven", tmp_path / "d.log")
    try:
        tokens = prompt(7, chunks=3)
        stored = drv.call("store", tokens, "s", seed=7, null_chunks=[1])
        assert stored["ok"], stored
        got = drv.call("fetch", tokens, "f")
        assert got["ok"] and got["hit"] == 1, got  # chunk 1 was never stored
        assert got["digests"] == stored["digests"][:1]
        into_null = drv.call("fetch", tokens, "g", null_first_block=True)
        assert into_null["ok"] and into_null["hit"] == 1, into_null
        assert into_null["null_block_kept"], into_null
        assert srv.status()["leases"]["read"] == 0
    finally:
        drv.close()
        srv.stop()


@pytest.mark.lmcache
def test_057_hybrid_worker_stores_and_retrieves_each_group(
    tmp_path: Path, lmcache057_venv: Path
) -> None:
    """0.5.7rc2's worker adapter registers a hybrid model (a full-attention group and a
    one-chunk sliding-window group, engine-driven on CPU): the window group's null
    chunks are never reserved nor stored, a lookup hits when each group holds what it
    needs, and a retrieve fills each group's chunks byte for byte."""
    srv = server(tmp_path)
    drv = Driver057(lmcache057_venv, srv.engine_url, "engine_driven", tmp_path / "d.log", "hybrid")
    try:
        tokens = prompt(9, chunks=3)
        stored = drv.call("store", tokens, "s", seed=9)
        assert stored["ok"] and stored["hit"] == 0, stored
        full, window = stored["group_digests"]
        got = drv.call("fetch", tokens, "f")
        assert got["ok"] and got["hit"] == 3, got
        assert got["group_digests"][0] == full  # every chunk of the full-attention group
        assert got["group_digests"][1][2] == window[2]  # the window group's last chunk
        # a shorter prefix: the window group's chunk 1 was the null block, never stored
        short = drv.call("fetch", tokens[: 2 * SERVER_CHUNK + 1], "g")
        assert short["ok"] and short["hit"] == 0, short
        assert srv.status()["leases"]["read"] == 0
        assert 'reason="version"' not in srv.metrics()
    finally:
        drv.close()
        srv.stop()
