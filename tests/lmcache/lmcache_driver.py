"""A stand-in engine for one `lmcache server`, run by .venv-lmcache's Python.

It drives the server through LMCache's own client path: `ServerBenchClient` (what
`lmcache bench server --mode cpu --transfer-mode lmcache_driven` uses) registers CPU KV
tensors that the server maps over POSIX shared memory, then LOOKUP / STORE / RETRIEVE
travel over LMCache's ZeroMQ request client, exactly as from a vLLM worker. No GPU.

Commands arrive as JSON lines on stdin, answers leave as JSON lines on the original
stdout (LMCache's own prints go to stderr):

    {"op": "store", "tokens": [...], "rid": "r1"}     -> {"ok": true, "hit": 0}
        (LOOKUP, then STORE of the chunks not hit, then END_SESSION)
    {"op": "fetch", "tokens": [...], "rid": "r2"}     -> {"ok": true, "hit": 2}
        (LOOKUP, then RETRIEVE of the chunks hit, then END_SESSION)
    {"op": "checksums", "tokens": [...]}              -> {"ok": true, "checksums": [...]}
    {"op": "quit"}

Every request's KV sits at block 0 of the worker's paged KV cache. Not part of the
kvatlas package: it imports lmcache, which only .venv-lmcache has.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from lmcache.cli.commands.bench.server_bench.client import RequestContext, ServerBenchClient
from lmcache.cli.commands.bench.server_bench.config import BenchConfig

CHUNK = 256
BLOCK = 16
BLOCKS = 128
SHAPE = f"(2,{BLOCKS},{BLOCK},2,16):float32:2"
"""Two layers, two KV heads of 16 floats: 512 bytes of KV per token."""


def main() -> None:
    rpc_url, http_url = sys.argv[1], sys.argv[2]
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # LMCache prints progress to stdout: keep it off the protocol
    config = BenchConfig(
        rpc_url=rpc_url,
        http_url=http_url,
        mode="cpu",
        transfer_mode="lmcache_driven",
        tp_size=1,
        use_mla=False,
        num_tokens=CHUNK,
        kvcache_shape_spec=SHAPE,
        num_blocks=BLOCKS,
        block_size=BLOCK,
    )
    client = ServerBenchClient(config, log=lambda line: print(line, file=sys.stderr))
    client.start()
    answers.write(json.dumps({"ok": True, "ready": True}) + "\n")
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["op"] == "quit":
                break
            try:
                answer = run(client, cmd)
            except Exception as exc:  # the test reads the reason
                answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            answers.write(json.dumps(answer) + "\n")
    finally:
        client.close()


def request(tokens: list[int], rid: str) -> RequestContext:
    """A request of ``tokens``; like vLLM, the last token is never cached, so a prompt
    of k chunks + 1 token has k full chunks."""
    full = (len(tokens) - 1) // CHUNK * CHUNK
    return RequestContext(
        sequence_id=0,
        request_id=rid,
        request_kind="kvatlas",
        token_ids=tuple(tokens),
        num_full_tokens=full,
        total_chunks=full // CHUNK,
        chunk_size=CHUNK,
        block_offset=0,
        num_blocks=full // BLOCK,
    )


def run(client: ServerBenchClient, cmd: dict[str, Any]) -> dict[str, Any]:
    req = request(cmd["tokens"], cmd.get("rid", "kvatlas"))
    if cmd["op"] == "checksums":
        return {"ok": True, "checksums": client.compute_checksums(req, 0, req.num_full_tokens)}
    lookup = client.lookup(req)
    hit = lookup.hit_chunks * CHUNK
    ok = lookup.succeeded
    if cmd["op"] == "store" and ok:
        stored = client.store(req, hit, req.num_full_tokens - hit)
        ok = stored is None or stored.succeeded
    elif cmd["op"] == "fetch" and ok and hit:
        got = client.retrieve(req, 0, hit)
        ok = got is not None and got.succeeded
    client.end_session(req)
    return {"ok": ok, "hit": lookup.hit_chunks, "error": lookup.error}


if __name__ == "__main__":
    main()
