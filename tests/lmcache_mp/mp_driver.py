"""A stand-in vLLM for one cache server, run by .venv-lmcache's Python (LMCache 0.5.6) or
.venv-lmcache057's (LMCache 0.5.7rc2).

It drives the server through that LMCache's UNMODIFIED vLLM adapters, the code vLLM's
LMCacheMPConnector runs: ``LMCacheMPSchedulerAdapter`` (lookup, prefetch status,
end_session) and ``LMCacheMPWorkerAdapter`` (KV registration, store, retrieve,
get_finished), with CPU KV tensors in vLLM's layout ``[2, blocks, block_size, heads,
head_size]`` per layer. The transfer mode comes from argv (``engine_driven`` or
``lmcache_driven``), through LMCache's own switch, ``LMCACHE_MP_TRANSFER_MODE``.

Commands arrive as JSON lines on stdin, answers leave as JSON lines on the original
stdout (LMCache's own prints go to stderr):

    {"op": "store", "tokens": [...], "rid": "r1", "seed": 7}
        fills the request's blocks with seeded random KV, looks up, stores the chunks
        not hit -> {"ok": true, "hit": 0, "digests": [sha256 of each chunk's KV]}
    {"op": "fetch", "tokens": [...], "rid": "r2"}
        zeroes other blocks, looks up, retrieves the hit chunks into them
        -> {"ok": true, "hit": 2, "digests": [...]}  (digests of what landed)
    either with "salt": "tenant-a": the request's ``cache_salt`` (vLLM's per-tenant
        isolation) in every key it looks up, stores or retrieves (default "": none)
    {"op": "reset"}  scheduler.reset_cache() (vLLM's prefix-cache reset) -> {"ok": true}
    {"op": "checksums", "first": 0, "blocks": 48}
        LMCache's bench's own client-side digests of those blocks (what a server's
        ``/cache/checksums`` must answer) -> {"ok": true, "instance_id": ..., "client": [...]}
    {"op": "store", ..., "null_chunks": [1]}  those chunks' block ids are all the null
        block (0), as a hybrid model's dropped window sends them
    {"op": "fetch", ..., "null_first_block": true}  the first block id of the retrieve is
        the null block, whose bytes are set to a sentinel first
        -> {..., "null_block_kept": true}  (the sentinel is still there)
    {"op": "call", "name": "cb_unregister_rope", "args": [1]}
        this LMCache's own ``MessageQueueClient`` sends one operation (a server module
        call's argument is given as [method, payload]); -> {"ok": true, "result": ...,
        "seconds": ...} or {"ok": false, "error": "...", "seconds": ...}
    {"op": "quit"}

A third argument ``hybrid`` (0.5.7 only) registers a hybrid model as vLLM's connector
does, with two KV groups: layer 0 full attention, layer 1 a sliding window of one chunk
whose blocks before the last chunk are the null block, as vLLM's block tables have them.
Answers then also carry ``group_digests``: each group's (layer's) digests per chunk.

With 0.5.7 the token ids travel packed (``token_codec``), and both adapters are given
the model's block alignment, so they ask the server ``negotiate_chunk_size`` instead of
``get_chunk_size``, as 0.5.7's vLLM connector does; which LMCache runs is told by
whether ``token_codec`` imports. ``reset`` and ``checksums`` are 0.5.6's only.

Not part of the kvatlas package: it imports lmcache, which only those venvs have.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from typing import Any

import torch
import zmq
from lmcache.integration.vllm.vllm_multi_process_adapter import (
    LMCacheMPSchedulerAdapter,
    LMCacheMPWorkerAdapter,
    LoadStoreOp,
    ParallelStrategy,
)
from lmcache.v1.multiprocess.futures import MessagingStream
from lmcache.v1.multiprocess.protocols.server_module import ServerModuleCallRequest
from lmcache.v1.multiprocess.transport.zmq_impl.mq import MessageQueueClient

try:  # LMCache 0.5.6's bench helper, for `checksums` (0.5.7 has none by that name)
    from lmcache.cli.commands.bench.server_bench.helpers import _compute_client_checksums
except ImportError:
    _compute_client_checksums = None
try:  # LMCache 0.5.7: token ids packed, the chunk size negotiated
    from lmcache.v1.multiprocess.token_codec import pack_token_ids
except ImportError:  # LMCache 0.5.6
    pack_token_ids = None

CHUNK = 256
"""Tokens per chunk: the server's, read once registered."""
BLOCK = 16
BLOCKS = 256
LAYERS = 2
HEADS = 4
HEAD = 8
MODEL = "test-model"
STORE_AT = 1
FETCH_AT = 128
"""Stores read blocks from 1, fetches write blocks from 128: a fetch cannot pass by
finding the stored bytes still in place."""
NULL_BLOCK = 0
"""vLLM's null block (LMCache's ``null_block_id`` default): no store reads it (both
LMCache releases' servers, and kvatlas, skip a chunk of null blocks only)."""
HYBRID = False
WAIT_S = 30.0


def main() -> None:
    url, mode = sys.argv[1], sys.argv[2]
    global HYBRID  # noqa: PLW0603 (set once, before any command)
    HYBRID = sys.argv[3:] == ["hybrid"]
    os.environ["LMCACHE_MP_TRANSFER_MODE"] = mode
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # LMCache prints to stdout: keep it off the protocol
    ctx = zmq.Context()
    strategy = ParallelStrategy(
        mla_only=False, vllm_world_size=1, vllm_worker_id=0, tp_size=1, pp_size=1, n_servers=1
    )
    extra = {"required_chunk_alignment": BLOCK} if pack_token_ids else {}
    scheduler = LMCacheMPSchedulerAdapter(
        [url], ctx, MODEL, BLOCK, strategy, mq_timeout=10.0, **extra
    )
    worker = LMCacheMPWorkerAdapter(url, ctx, MODEL, BLOCK, strategy, mq_timeout=10.0, **extra)
    kv = {
        f"model.layers.{i}.self_attn": torch.zeros(2, BLOCKS, BLOCK, HEADS, HEAD)
        for i in range(LAYERS)
    }
    if HYBRID:
        from lmcache.v1.multiprocess.group_view import EngineGroupInfo  # noqa: PLC0415

        groups = [
            EngineGroupInfo(engine_group_id=0, layer_indices=(0,), tokens_per_block=BLOCK),
            EngineGroupInfo(
                engine_group_id=1, layer_indices=(1,), tokens_per_block=BLOCK, sw_size_tokens=256
            ),
        ]
        worker.register_kv_caches(kv, groups, layout_hints={"kv_layout": "NHD"})
    else:
        worker.register_kv_caches(kv, layout_hints={"kv_layout": "NHD"})
    kv = worker.kv_caches  # lmcache-driven moves them into shared memory
    global CHUNK  # noqa: PLW0603 (set once, before any command)
    CHUNK = worker.lmcache_tokens_per_chunk  # the server's --chunk-size
    answers.write(
        json.dumps({"ok": True, "ready": True, "chunk": worker.lmcache_tokens_per_chunk}) + "\n"
    )
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["op"] == "quit":
                break
            if cmd["op"] == "reset":  # vLLM's /reset_prefix_cache
                answers.write(json.dumps({"ok": scheduler.reset_cache()}) + "\n")
                continue
            if cmd["op"] == "call":
                answers.write(json.dumps(call(url, ctx, cmd["name"], cmd["args"])) + "\n")
                continue
            if cmd["op"] == "checksums":
                client = _compute_client_checksums(
                    list(kv.values()), cmd["first"], cmd["blocks"], BLOCK, CHUNK
                )
                answer = {"ok": True, "instance_id": worker.instance_id, "client": client}
                answers.write(json.dumps(answer) + "\n")
                continue
            try:
                answer = run(scheduler, worker, kv, cmd)
            except Exception as exc:  # the test reads the reason
                answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            answers.write(json.dumps(answer) + "\n")
    finally:
        worker.shutdown()
        scheduler.shutdown()


def call(url: str, ctx: zmq.Context[Any], name: str, args: list[Any]) -> dict[str, Any]:
    """One operation through this LMCache's own client, as its adapters send it."""
    if name.startswith("server_module"):
        args = [ServerModuleCallRequest(method=args[0], payload=args[1].encode())]
    client = MessageQueueClient(url, ctx)
    t0 = time.monotonic()
    try:
        future = client.submit_request(name, args)
        if isinstance(future, MessagingStream):  # a stream the server ends at once
            result: Any = [repr(item) for item in future]
        else:
            result = repr(future.result(timeout=WAIT_S))
        return {"ok": True, "result": result, "seconds": time.monotonic() - t0}
    except Exception as exc:
        return {
            "ok": False,
            "error": f"{type(exc).__name__}: {exc}",
            "seconds": time.monotonic() - t0,
        }
    finally:
        client.close()


def digests(kv: dict[str, torch.Tensor], first_block: int, chunks: int) -> list[str]:
    """sha256 of each chunk's KV as ``[2, layers, tokens, hidden]`` float32 bytes."""
    bpc = CHUNK // BLOCK
    out = []
    for c in range(chunks):
        blocks = slice(first_block + c * bpc, first_block + (c + 1) * bpc)
        chunk = torch.stack([t[:, blocks].reshape(2, CHUNK, -1) for t in kv.values()], dim=1)
        out.append(hashlib.sha256(chunk.contiguous().numpy().tobytes()).hexdigest())
    return out


def lookup(
    scheduler: LMCacheMPSchedulerAdapter, rid: str, tokens: list[int], salt: str = ""
) -> int:
    packed = pack_token_ids(tokens) if pack_token_ids else tokens
    scheduler.maybe_submit_lookup_request(rid, packed, cache_salt=salt)
    deadline = time.monotonic() + WAIT_S
    while (hit := scheduler.check_lookup_result(rid)) is None:
        if time.monotonic() > deadline:
            raise TimeoutError("lookup result never came")
        time.sleep(0.01)
    return int(hit)


def _tokens(tokens: list[int]) -> dict[str, Any]:
    """A ``LoadStoreOp``'s tokens, in this LMCache's field."""
    return {"token_bytes": pack_token_ids(tokens)} if pack_token_ids else {"token_ids": tokens}


def finish(worker: LMCacheMPWorkerAdapter, rid: str, store: bool) -> bool:
    """Wait, as vLLM's connector does, until get_finished reports ``rid``."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        stores, retrieves = worker.get_finished({rid})
        if rid in ((stores or set()) if store else (retrieves or set())):
            failed = (
                worker.get_failed_store_requests() if store else worker.get_failed_request_ids()
            )
            return rid not in (failed or set())
        time.sleep(0.01)
    raise TimeoutError(f"{'store' if store else 'retrieve'} of {rid} never finished")


def run(
    scheduler: LMCacheMPSchedulerAdapter,
    worker: LMCacheMPWorkerAdapter,
    kv: dict[str, torch.Tensor],
    cmd: dict[str, Any],
) -> dict[str, Any]:
    tokens: list[int] = cmd["tokens"]
    rid: str = cmd["rid"]
    salt: str = cmd.get("salt", "")
    full = len(tokens) // CHUNK * CHUNK
    hit = lookup(scheduler, rid, tokens, salt)
    ok = True
    if cmd["op"] == "store":
        gen = torch.Generator().manual_seed(int(cmd.get("seed", 0)))
        blocks = slice(STORE_AT, STORE_AT + full // BLOCK)
        for t in kv.values():
            t[:, blocks] = torch.rand(t[:, blocks].shape, generator=gen)
        if full > hit:
            ids = list(range(STORE_AT + hit // BLOCK, STORE_AT + full // BLOCK))
            bpc = CHUNK // BLOCK
            for c in cmd.get("null_chunks", []):
                ids[c * bpc : (c + 1) * bpc] = [NULL_BLOCK] * bpc
            op = LoadStoreOp(
                **_tokens(tokens), block_ids=block_table(ids, hit, full), start=hit, end=full
            )
            worker.submit_store_request(rid, op, worker.create_recorded_event(), cache_salt=salt)
            ok = finish(worker, rid, store=True)
        out = digests(kv, STORE_AT, full // CHUNK)
        at = STORE_AT
    else:
        blocks = slice(FETCH_AT, FETCH_AT + full // BLOCK)
        for t in kv.values():
            t[:, blocks] = 0
        null_first = bool(cmd.get("null_first_block"))
        sentinel = torch.full_like(next(iter(kv.values()))[:, NULL_BLOCK], -1.0)
        if null_first:
            for t in kv.values():
                t[:, NULL_BLOCK] = sentinel
        if hit:
            ids = list(range(FETCH_AT, FETCH_AT + hit // BLOCK))
            if null_first:
                ids[0] = NULL_BLOCK
            op = LoadStoreOp(
                **_tokens(tokens), block_ids=block_table(ids, 0, hit), start=0, end=hit
            )
            worker.submit_retrieve_request(rid, op, worker.create_recorded_event(), cache_salt=salt)
            ok = finish(worker, rid, store=False)
        out = digests(kv, FETCH_AT, hit // CHUNK)
        at, full = FETCH_AT, hit
        if null_first:
            kept = all(bool(torch.equal(t[:, NULL_BLOCK], sentinel)) for t in kv.values())
            scheduler.end_session(rid)
            scheduler.cleanup_lookup_result(rid)
            return {"ok": ok, "hit": hit // CHUNK, "digests": out, "null_block_kept": kept}
    scheduler.end_session(rid)
    scheduler.cleanup_lookup_result(rid)
    answer = {"ok": ok, "hit": hit // CHUNK, "digests": out}
    if HYBRID:
        layers = list(kv.values())
        answer["group_digests"] = [
            digests({"g": layers[g]}, at, full // CHUNK) for g in range(len(layers))
        ]
    return answer


def block_table(ids: list[int], start: int, end: int) -> list[list[int]]:
    """The request's block ids per KV group: one group, or (hybrid) the full-attention
    group's and the window group's, null before the last chunk of ``end``."""
    if not HYBRID:
        return [ids]
    bpc = CHUNK // BLOCK
    last = end // CHUNK - 1  # the window: the last chunk
    window = [b if start // CHUNK + i // bpc >= last else NULL_BLOCK for i, b in enumerate(ids)]
    return [ids, window]


if __name__ == "__main__":
    main()
