"""Store through one cache server, retrieve the same prefix through its peer, with
LMCache's own MP client; run by .venv-lmcache's Python.

`lmcache bench server` speaks to one server, and the wall time of its LOOKUP comes in
steps of 50 ms (it polls the prefetch status every 50 ms), which hides a peer fetch of a
few tens of ms. This probe uses the same client pieces (`ServerBenchClient`: LMCache's
ZeroMQ request client and a transfer context over CPU KV tensors, the bench's KV shape)
for two stand-in engines, one per server, and per repeat:

1. writes fresh random bytes into A's blocks and stores them through server A (LOOKUP,
   then STORE of the missing chunks, END_SESSION), as an engine after its prefill;
2. waits ``--settle-s`` (2 s: more than a server's event flush interval, 1 s for
   kvatlas, after which the coordinator's directory names A as the holder; not timed);
3. on B: zeroes B's destination blocks, LOOKUP, then polls QUERY_PREFETCH_STATUS every
   ``--poll-ms`` (as vLLM's scheduler does, step by step) until B answers: this is where
   B fetches the prefix from A into its own L1 ("p2p lookup"); then RETRIEVE into B's
   tensors ("retrieve"), END_SESSION; and compares B's blocks with A's, byte for byte;
4. the same prefix on B once more: now a local L1 hit ("local lookup" / "local retrieve"),
   the reference the peer path is compared with, and again compared with A's bytes.

Per step it records the wall time and the client's own CPU time (this process, all
threads). One JSON line per repeat on stdout; the harness takes the medians.

    .venv-lmcache/bin/python bench/lmcache_p2p_probe.py --a tcp://... --b tcp://... \
        --mode lmcache_driven --chunks 4 --repeats 5

Not part of the kvatlas package: it imports lmcache, which only .venv-lmcache has.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import torch
from lmcache.cli.commands.bench.server_bench.client import RequestContext, ServerBenchClient
from lmcache.cli.commands.bench.server_bench.config import BenchConfig
from lmcache.cli.commands.bench.server_bench.helpers import (
    _TIMEOUT,
    _make_key,
    _send_lookup,
    _wait_for_result,
)

CHUNK = 256
BLOCK = 16


def make_client(rpc_url: str, mode: str, shape: str, blocks: int) -> ServerBenchClient:
    config = BenchConfig(
        rpc_url=rpc_url,
        http_url="",
        mode="cpu",
        transfer_mode=mode,
        tp_size=1,
        use_mla=False,
        num_tokens=CHUNK,
        kvcache_shape_spec=shape,
        num_blocks=blocks,
        block_size=BLOCK,
    )
    client = ServerBenchClient(config, log=lambda line: print(line, file=sys.stderr))
    client.start()
    return client


def tensors(client: ServerBenchClient) -> list[torch.Tensor]:
    return list(client._workers[0].kv_caches.values())


def blocks(t: torch.Tensor, n: int) -> torch.Tensor:
    return t.narrow(1, 0, n)  # (2, NB, BS, NH, HS): the block axis is 1


def request(tokens: tuple[int, ...], rid: str) -> RequestContext:
    """Like vLLM, the last token is never cached: k chunks + 1 token has k full chunks."""
    full = (len(tokens) - 1) // CHUNK * CHUNK
    return RequestContext(
        sequence_id=0,
        request_id=rid,
        request_kind="p2p",
        token_ids=tokens,
        num_full_tokens=full,
        total_chunks=full // CHUNK,
        chunk_size=CHUNK,
        block_offset=0,
        num_blocks=full // BLOCK,
    )


def lookup(client: ServerBenchClient, req: RequestContext, poll_s: float) -> int:
    """LOOKUP, then QUERY_PREFETCH_STATUS every ``poll_s`` until answered: hit chunks."""
    rpc = client._require_started()
    key = _make_key(req.token_ids, req.request_id, start=0, end=req.num_full_tokens)
    if not _send_lookup(rpc, key):
        raise RuntimeError("LOOKUP timed out")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        got = _wait_for_result(rpc.query_prefetch_status(req.request_id))
        if got is _TIMEOUT:
            raise RuntimeError("QUERY_PREFETCH_STATUS timed out")
        if got is not None:
            return int(got)
        time.sleep(poll_s)
    raise RuntimeError("the lookup did not finish in 60 s")


def timed(fn: Any, *args: Any) -> tuple[Any, float, float]:
    c0, w0 = time.process_time(), time.perf_counter()
    out = fn(*args)
    return out, (time.perf_counter() - w0) * 1e3, (time.process_time() - c0) * 1e3


def fetch(
    b: ServerBenchClient, req: RequestContext, poll_s: float, prefix: str
) -> tuple[dict[str, float], int]:
    hit, l_ms, l_cpu = timed(lookup, b, req, poll_s)
    row = {f"{prefix}_lookup_ms": l_ms, f"{prefix}_lookup_client_cpu_ms": l_cpu}
    if hit:
        got, r_ms, r_cpu = timed(b.retrieve, req, 0, hit * CHUNK)
        if got is None or not got.succeeded:
            raise RuntimeError(f"{prefix} RETRIEVE failed")
        row |= {f"{prefix}_retrieve_ms": r_ms, f"{prefix}_retrieve_client_cpu_ms": r_cpu}
    b.end_session(req)
    return row, hit


def one_repeat(
    a: ServerBenchClient, b: ServerBenchClient, n: int, args: argparse.Namespace
) -> dict[str, Any]:
    first = 1 + n * 1_000_000 + os.getpid() % 1000 * 10_000
    tokens = tuple(range(first, first + args.chunks * CHUNK + 1))
    nblocks = args.chunks * CHUNK // BLOCK
    for t in tensors(a):  # fresh bytes each repeat: nothing can be left from another
        blocks(t, nblocks).copy_(torch.randn_like(blocks(t, nblocks)))
    req = request(tokens, f"store-{n}")
    hit = lookup(a, req, args.poll_ms / 1e3)
    stored = a.store(req, hit * CHUNK, req.num_full_tokens - hit * CHUNK)
    a.end_session(req)
    if hit or stored is None or not stored.succeeded:
        raise RuntimeError(f"store through A: hit {hit} before, stored {stored}")
    time.sleep(args.settle_s)
    for t in tensors(b):
        blocks(t, nblocks).zero_()

    def same() -> bool:
        return all(
            torch.equal(blocks(ta, nblocks), blocks(tb, nblocks))
            for ta, tb in zip(tensors(a), tensors(b), strict=True)
        )

    row, p2p_hit = fetch(b, request(tokens, f"p2p-{n}"), args.poll_ms / 1e3, "p2p")
    p2p_same = same()
    for t in tensors(b):
        blocks(t, nblocks).zero_()
    local, local_hit = fetch(b, request(tokens, f"local-{n}"), args.poll_ms / 1e3, "local")
    return {
        "repeat": n,
        "chunks": args.chunks,
        "p2p_hit_chunks": p2p_hit,
        "p2p_bytes_match": bool(p2p_same and p2p_hit == args.chunks),
        "local_hit_chunks": local_hit,
        "local_bytes_match": bool(same() and local_hit == args.chunks),
        **row,
        **local,
    }


def main() -> int:
    ap = argparse.ArgumentParser(prog="lmcache_p2p_probe.py")
    ap.add_argument("--a", required=True, help="node A's MP endpoint, tcp://host:port")
    ap.add_argument("--b", required=True, help="node B's MP endpoint")
    ap.add_argument("--mode", choices=["engine_driven", "lmcache_driven"], required=True)
    ap.add_argument("--shape", default="(2,128,16,8,128):float16:32")
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--settle-s", type=float, default=2.0)
    ap.add_argument("--poll-ms", type=float, default=1.0)
    args = ap.parse_args()
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # LMCache prints progress to stdout: keep it off the results
    nb = int(args.shape.split(",")[1])
    if args.chunks * CHUNK // BLOCK > nb:
        ap.error(f"--chunks {args.chunks} needs more than the shape's {nb} blocks")
    a = make_client(args.a, args.mode, args.shape, nb)
    try:
        b = make_client(args.b, args.mode, args.shape, nb)
        try:
            for n in range(args.repeats):
                try:
                    row = one_repeat(a, b, n, args)
                except Exception as exc:  # reported per repeat; the harness names it
                    row = {"repeat": n, "error": f"{type(exc).__name__}: {exc}"}
                answers.write(json.dumps(row) + "\n")
        finally:
            b.close()
    finally:
        a.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
