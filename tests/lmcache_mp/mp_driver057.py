"""A stand-in vLLM for one cache server, run by .venv-lmcache057's Python.

``mp_driver.py``'s ``store``, ``fetch`` and ``quit`` commands (see there) through LMCache
0.5.7rc2's UNMODIFIED vLLM adapters: token ids travel packed (``token_codec``), and both
adapters are given the model's block alignment, so they ask the server
``negotiate_chunk_size`` instead of ``get_chunk_size``, as 0.5.7's vLLM connector does.

Not part of the kvatlas package: it imports lmcache 0.5.7rc2, which only .venv-lmcache057
has.
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
from lmcache.v1.multiprocess.token_codec import pack_token_ids

CHUNK = 256
"""Tokens per chunk: the server's, read once registered."""
BLOCK = 16
BLOCKS = 256
LAYERS = 2
HEADS = 4
HEAD = 8
MODEL = "test-model"
STORE_AT = 0
FETCH_AT = 128
"""Stores read blocks from 0, fetches write blocks from 128: a fetch cannot pass by
finding the stored bytes still in place."""
WAIT_S = 30.0


def main() -> None:
    url, mode = sys.argv[1], sys.argv[2]
    os.environ["LMCACHE_MP_TRANSFER_MODE"] = mode
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # LMCache prints to stdout: keep it off the protocol
    ctx = zmq.Context()
    strategy = ParallelStrategy(
        mla_only=False, vllm_world_size=1, vllm_worker_id=0, tp_size=1, pp_size=1, n_servers=1
    )
    scheduler = LMCacheMPSchedulerAdapter(
        [url], ctx, MODEL, BLOCK, strategy, mq_timeout=10.0, required_chunk_alignment=BLOCK
    )
    worker = LMCacheMPWorkerAdapter(
        url, ctx, MODEL, BLOCK, strategy, mq_timeout=10.0, required_chunk_alignment=BLOCK
    )
    kv = {
        f"model.layers.{i}.self_attn": torch.zeros(2, BLOCKS, BLOCK, HEADS, HEAD)
        for i in range(LAYERS)
    }
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
            try:
                answer = run(scheduler, worker, kv, cmd)
            except Exception as exc:  # the test reads the reason
                answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            answers.write(json.dumps(answer) + "\n")
    finally:
        worker.shutdown()
        scheduler.shutdown()


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
    scheduler.maybe_submit_lookup_request(rid, pack_token_ids(tokens), cache_salt=salt)
    deadline = time.monotonic() + WAIT_S
    while (hit := scheduler.check_lookup_result(rid)) is None:
        if time.monotonic() > deadline:
            raise TimeoutError("lookup result never came")
        time.sleep(0.01)
    return hit


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
            op = LoadStoreOp(
                token_bytes=pack_token_ids(tokens),
                block_ids=[list(range(STORE_AT + hit // BLOCK, STORE_AT + full // BLOCK))],
                start=hit,
                end=full,
            )
            worker.submit_store_request(rid, op, worker.create_recorded_event(), cache_salt=salt)
            ok = finish(worker, rid, store=True)
        out = digests(kv, STORE_AT, full // CHUNK)
    else:
        blocks = slice(FETCH_AT, FETCH_AT + full // BLOCK)
        for t in kv.values():
            t[:, blocks] = 0
        if hit:
            op = LoadStoreOp(
                token_bytes=pack_token_ids(tokens),
                block_ids=[list(range(FETCH_AT, FETCH_AT + hit // BLOCK))],
                start=0,
                end=hit,
            )
            worker.submit_retrieve_request(rid, op, worker.create_recorded_event(), cache_salt=salt)
            ok = finish(worker, rid, store=False)
        out = digests(kv, FETCH_AT, hit // CHUNK)
    scheduler.end_session(rid)
    scheduler.cleanup_lookup_result(rid)
    return {"ok": ok, "hit": hit // CHUNK, "digests": out}


if __name__ == "__main__":
    main()
