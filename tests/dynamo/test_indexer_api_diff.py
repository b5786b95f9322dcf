"""Issue #38 item 4: kvatlas' indexer API (``kvatlas coordinator --kv-indexer-api``)
answers as NVIDIA Dynamo 1.6.1's standalone indexer does, except where Dynamo is wrong.

One Dynamo indexer (``python -m dynamo.indexer``) and one real kvatlas coordinator
process take the same requests; vLLM engines (`indexer_procs.Engine`: vLLM's own cache
manager and publisher, real block hashes and events) are registered with both. Every
scenario compares the two answers, and both to what vLLM's prefix cache would hit
(the oracle) where they differ. The differences are those docs/dynamo.md lists under
"Intended differences", each asserted by the test named in `DIFFERENCES` (and nowhere
else do the answers differ): gaps, removals, evictions, clears, data-parallel ranks,
LoRA, CPU tiers, ``/query_by_hash``, the registry's rules and messages are equal.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import random
import re
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import xxhash

from kvatlas.core.tenancy import TenantTable
from support.services import start_coordinator_process
from support.wait import wait_until

from .conftest import ROOT, DynamoIndexer

pytest.importorskip(
    "vllm.distributed.kv_events", reason="vLLM not installed (scripts/bootstrap.sh)"
)

from .indexer_procs import (  # vLLM's own code: only where it is installed
    BlockRemoved,
    BlockStored,
    DroppingPub,
    Engine,
    Pair,
    gpu_tokens,
)

pytestmark = pytest.mark.dynamo

B = 16
TOKEN = "indexer-diff-token"
SECRET = "s" * 40
TENANTS = f'secret = "{SECRET}"\n[tenants.acme]\napi_keys = ["k-acme"]\n'
ACME = TenantTable.from_document(
    {"secret": SECRET, "tenants": {"acme": {"api_keys": ["k-acme"]}}}
).tenants["acme"]

DIFFERENCES = {
    "salt": "test_cache_salt_and_tenants",
    "tenant": "test_cache_salt_and_tenants",
    "restart": "test_engine_restart",
    "late join": "test_late_join",
    "hybrid": "test_hybrid_sliding_window",
    "unregister rank": "test_registry_rules_and_refusals",
    "registration checks": "test_registry_rules_and_refusals",
    "error bodies": "test_registry_rules_and_refusals",
    "batch rank": "test_batch_rank",
    "dump": "test_dump",
    "auth": "test_registry_rules_and_refusals",
}
"""Each intended difference (docs/dynamo.md) -> the test that asserts it."""


@pytest.fixture(scope="module")
def pair(dynamo_venv: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    logs = tmp_path_factory.mktemp("indexer-diff")
    dynamo = DynamoIndexer.start(dynamo_venv, logs / "dynamo.log", model="unused", block_size=B)
    tenants = logs / "tenants.toml"
    tenants.write_text(TENANTS)
    kvatlas = start_coordinator_process(
        "--kv-indexer-api",
        "--tenants",
        str(tenants),
        log=logs / "coordinator.log",
        env={**os.environ, "KVATLAS_AUTH_TOKEN": TOKEN},
    )
    p = Pair(dynamo.url, kvatlas.url, TOKEN)
    yield p
    p.close()
    kvatlas.stop()
    dynamo.stop()


@pytest.fixture(autouse=True)
def unregistered(pair: Pair) -> Iterator[None]:
    """Every test's workers leave both indexers at its end."""
    yield
    pair.unregister_all()


@pytest.fixture
def engines() -> Iterator[Callable[..., Engine]]:
    made: list[Engine] = []

    def make(**kwargs: Any) -> Engine:
        e = Engine(block=B, **kwargs)
        made.append(e)
        return e

    yield make
    for e in made:
        e.stop()


_seeds = iter(range(10**6, 10**9, 10**4))


def prompt(blocks: int, seed: int | None = None) -> list[int]:
    """``blocks`` full blocks of fresh tokens and one token more (vLLM never hits a
    prompt's last token, so every full block can hit)."""
    rng = random.Random(next(_seeds) if seed is None else seed)
    return [rng.randrange(50_000) for _ in range(blocks * B + 1)]


def full_blocks(tokens: list[int]) -> list[int]:
    """``tokens`` cut to whole blocks and one token more (see `prompt`)."""
    return tokens[: (len(tokens) - 1) // B * B + 1]


def settle(check: Callable[[], list[str]], what: str, timeout: float = 10.0) -> None:
    """Poll ``check`` (what is still wrong) until it is empty; fail with the last list."""
    wait_until(lambda: check()[:20], lambda wrong: not wrong, what=what, timeout=timeout)


def join(pair: Pair, engine: Engine, iid: int, model: str, **extra: Any) -> None:
    """Register with both, then wait until both apply what the engine publishes now:
    each subscribes asynchronously, and a batch published before a subscription took
    is seen only after a replay (kvatlas' at once, Dynamo's at the next batch), or never
    without a replay socket. So the engine caches a fresh one-block prompt until both
    show the latest."""
    pair.register(engine.registration(iid, model, **extra))
    warm: list[list[int]] = []

    def check() -> list[str]:
        got = None
        if warm:
            dyn, kv = pair.query(token_ids=warm[-1], model_name=model)
            got = gpu_tokens(dyn, iid, engine.rank), gpu_tokens(kv, iid, engine.rank)
            if got == (B, B):
                return []
        warm.append(prompt(1))
        engine.serve(warm[-1])
        return [f"warm-up of {iid}:{engine.rank}: (dynamo, kvatlas) {got}"]

    settle(check, f"both indexers following worker {iid} rank {engine.rank}")


def compare(
    pair: Pair,
    model: str,
    workers: dict[tuple[int, int], Engine],
    probes: list[list[int]],
    **query: Any,
) -> Callable[[], list[str]]:
    """A check: both answers equal, and each worker's GPU tokens equal vLLM's hit."""

    def check() -> list[str]:
        wrong = []
        for i, tokens in enumerate(probes):
            dyn, kv = pair.query(token_ids=tokens, model_name=model, **query)
            if dyn != kv:
                wrong.append(f"probe {i}: dynamo {dyn} != kvatlas {kv}")
            for (iid, rank), engine in workers.items():
                want = engine.hit(tokens, query.get("lora_name"))
                if gpu_tokens(kv, iid, rank) != want:
                    wrong.append(f"probe {i} {iid}:{rank}: kvatlas {kv}, vLLM hits {want}")
        return wrong

    return check


# -- where the two agree -------------------------------------------------------------


def test_prefix_hits_evictions_clears_and_ranks_match_vllm(
    pair: Pair, engines: Callable[..., Engine]
) -> None:
    model = "base"
    workers = {
        (1, 0): engines(num_blocks=20),
        (2, 0): engines(num_blocks=20, rank=0),
        (2, 1): engines(num_blocks=20, rank=1),
    }
    for (iid, _), e in workers.items():
        join(pair, e, iid, model)
    rng = random.Random(38)
    stems = [prompt(6, seed=s) for s in range(4)]

    def draw() -> list[int]:
        stem = rng.choice(stems)[: rng.randrange(1, 6 * B)]
        return full_blocks(stem + [rng.randrange(50_000) for _ in range(rng.randrange(B, 3 * B))])

    evicted = 0
    for step in range(24):
        engine = rng.choice(list(workers.values()))
        events = engine.serve(draw()) or []
        evicted += sum(isinstance(ev, BlockRemoved) for ev in events)
        probes = [s[: (1 + step % 5) * B + 1] for s in stems] + [draw()]
        settle(compare(pair, model, workers, probes), f"step {step}")
    assert evicted, "the workload never evicted a block (no BlockRemoved)"
    for e in workers.values():
        e.clear()
    settle(compare(pair, model, workers, stems), "after every engine's AllBlocksCleared")
    dyn, kv = pair.query(token_ids=stems[0], model_name=model)
    assert dyn == kv == {"scores": {}, "frequencies": [], "instances": {}}


@pytest.mark.parametrize("replay", [True, False])
def test_gaps(pair: Pair, engines: Callable[..., Engine], replay: bool) -> None:
    """Batches lost on the wire: with a replay socket both repair the gap (the last
    batch's too); without one both lose the same blocks (vLLM still holds them)."""
    model = f"gaps-{replay}"
    e = engines(replay=replay)
    join(pair, e, 1, model)
    prompts = [prompt(2) for _ in range(6)]
    first = e.published
    # vLLM types _pub as its zmq socket; the stand-in forwards all but send_multipart
    e.publisher._pub = DroppingPub(e.publisher._pub, {first + 2, first + 3, first + 5})  # type: ignore[assignment]
    for p in prompts:
        e.serve(p)
    if replay:
        settle(compare(pair, model, {(1, 0): e}, prompts), "gaps repaired by replay")
        return

    def check() -> list[str]:
        got = [pair.query(token_ids=p, model_name=model) for p in prompts]
        want = [0 if i in (2, 3, 5) else 2 * B for i in range(len(prompts))]
        seen = [(gpu_tokens(d, 1), gpu_tokens(k, 1)) for d, k in got]
        return [] if seen == [(w, w) for w in want] else [f"(dynamo, kvatlas): {seen}"]

    settle(check, "both lose the dropped batches alike")
    assert all(e.hit(p) == 2 * B for p in prompts)


def test_lora(pair: Pair, engines: Callable[..., Engine]) -> None:
    model = "lora"
    e = engines()
    join(pair, e, 1, model)
    tokens = prompt(3)
    e.serve(tokens, lora="adapter-a")
    w = {(1, 0): e}
    settle(compare(pair, model, w, [tokens], lora_name="adapter-a"), "the LoRA's blocks")
    settle(compare(pair, model, w, [tokens]), "the base model's (none)")
    settle(compare(pair, model, w, [tokens], lora_name="adapter-b"), "another LoRA's (none)")
    dyn, _ = pair.query(token_ids=tokens, model_name=model, lora_name="adapter-a")
    assert gpu_tokens(dyn, 1) == 3 * B


def test_cpu_tier_and_query_by_hash(pair: Pair, engines: Callable[..., Engine]) -> None:
    """An offloaded copy (vLLM's CPU offloading publishes the GPU block's hash with
    medium CPU), then the GPU copy evicted: the RFC's cumulative tiers, alike; and the
    same answers from Dynamo's local block hashes (``/query_by_hash``)."""
    model = "tiers"
    e = engines()
    join(pair, e, 1, model)
    tokens = prompt(3)
    stored = [ev for ev in (e.serve(tokens) or []) if isinstance(ev, BlockStored)]
    assert stored
    e.publish(*(BlockStored(**{**_fields(ev), "medium": "CPU"}) for ev in stored))
    full = {"longest_matched": 3 * B, "gpu": 3 * B, "dp": {"0": 3 * B}, "cpu": 3 * B}
    both_media = {"1": {**full, "disk": 3 * B}}

    def answers(want_instances: dict[str, Any], want_scores: dict[str, Any]) -> list[str]:
        dyn, kv = pair.query(token_ids=tokens, model_name=model)
        want = {"scores": want_scores, "frequencies": [], "instances": want_instances}
        return [] if dyn == kv == want else [f"dynamo {dyn}", f"kvatlas {kv}", f"want {want}"]

    settle(lambda: answers(both_media, {"1": {"0": 3 * B}}), "GPU and CPU copies")
    gone: list[bytes | int] = [*e.block_hashes(tokens)]
    e.publish(BlockRemoved(block_hashes=gone, medium="GPU"))
    cpu_only = {
        "1": {"longest_matched": 3 * B, "gpu": 0, "dp": {"0": 0}, "cpu": 3 * B, "disk": 3 * B}
    }
    settle(lambda: answers(cpu_only, {}), "the CPU copy alone")

    local = [_i64(_local_hash(tokens[i * B : (i + 1) * B])) for i in range(3)]
    dyn, kv = pair.both("POST", "/query_by_hash", json={"block_hashes": local, "model_name": model})
    assert dyn.status == kv.status == 200 and dyn.body == kv.body
    assert dyn.body["instances"]["1"]["cpu"] == 3 * B
    dyn, kv = pair.both(
        "POST", "/query_by_hash", json={"block_hashes": local[1:], "model_name": model}
    )
    assert dyn.body == kv.body == {"scores": {}, "frequencies": [], "instances": {}}


def _fields(ev: Any) -> dict[str, Any]:
    return {f: getattr(ev, f) for f in ev.__struct_fields__}


def _local_hash(block: list[int]) -> int:
    """Dynamo's ``LocalBlockHash``: XXH3-64 of the tokens as u32 LE, seed 1337."""
    return xxhash.xxh3_64_intdigest(struct.pack(f"<{len(block)}I", *block), seed=1337)


def _i64(h: int) -> int:
    return h - 2**64 if h >= 2**63 else h


# -- where Dynamo is wrong -----------------------------------------------------------


def test_cache_salt_and_tenants(pair: Pair, engines: Callable[..., Engine]) -> None:
    """ "salt": vLLM mixes a request's cache_salt into its first block's hash, so only a
    request with that salt hits the blocks. Dynamo drops vLLM's salt (it reads only its
    own ``dynamo-cache-salt:`` form): an unsalted query counts the salted blocks (one
    tenant sees another's), a salted one never matches. "tenant": kvatlas hashes with
    the tenant's salt (``--tenants``); Dynamo ignores ``tenant_id``."""
    model = "salt"
    e = engines()
    join(pair, e, 1, model)
    salted, plain = prompt(3), prompt(2)
    e.serve(salted, salt=ACME.salt)
    e.serve(plain)
    t = {"salted": 3 * B, "plain": 2 * B}
    assert (e.hit(salted, salt=ACME.salt), e.hit(salted), e.hit(plain)) == (3 * B, 0, 2 * B)
    assert e.hit(plain, salt=ACME.salt) == 0

    cases = [  # query, prompt, vLLM's hit (= kvatlas), Dynamo's
        ({}, "salted", 0, t["salted"]),
        ({"cache_salt": ACME.salt}, "salted", t["salted"], 0),
        ({"tenant_id": "acme"}, "salted", t["salted"], t["salted"]),
        ({}, "plain", t["plain"], t["plain"]),
        ({"tenant_id": "acme"}, "plain", 0, t["plain"]),
        ({"cache_salt": ACME.salt}, "plain", 0, 0),
    ]
    tokens = {"salted": salted, "plain": plain}

    def check() -> list[str]:
        wrong = []
        for query, which, want_kv, want_dyn in cases:
            dyn, kv = pair.query(token_ids=tokens[which], model_name=model, **query)
            got = (gpu_tokens(dyn, 1), gpu_tokens(kv, 1))
            if got != (want_dyn, want_kv):
                wrong.append(f"{query} {which}: (dynamo, kvatlas) {got} != {(want_dyn, want_kv)}")
        return wrong

    settle(check, "salted and unsalted blocks")
    dyn, kv = pair.both(
        "POST", "/query", json={"token_ids": salted, "model_name": model, "tenant_id": "nobody"}
    )
    assert (dyn.status, kv.status) == (200, 404) and "unknown tenant_id" in kv.body["error"]
    body = {"block_hashes": [1], "model_name": model, "tenant_id": "acme"}
    dyn, kv = pair.both("POST", "/query_by_hash", json=body)
    assert (dyn.status, kv.status) == (200, 400) and "tenant_id" in kv.body["error"]
    body = {"block_hashes": [1], "model_name": model, "cache_salt": ACME.salt}
    dyn, kv = pair.both("POST", "/query_by_hash", json=body)
    assert dyn.status == kv.status == 400


def test_engine_restart(pair: Pair, engines: Callable[..., Engine]) -> None:
    """ "restart": a restarted engine's cache is empty and its seqs start again at 0.
    kvatlas drops the old blocks and applies the new stream; Dynamo keeps the old
    blocks (claiming hits vLLM no longer has) and skips the new stream's batches until
    its seqs pass the old last one."""
    model = "restart"
    e = engines()
    join(pair, e, 1, model)
    old = [prompt(2) for _ in range(6)]
    for p in old:
        e.serve(p)
    w = {(1, 0): e}
    settle(compare(pair, model, w, old), "before the restart")
    e.restart()
    new = [prompt(2) for _ in range(2)]
    for p in new:
        e.serve(p)

    def check() -> list[str]:
        wrong = []
        for label, prompts, vllm, dynamo in (("old", old, 0, 2 * B), ("new", new, 2 * B, 0)):
            for p in prompts:
                assert e.hit(p) == vllm
                dyn, kv = pair.query(token_ids=p, model_name=model)
                got = (gpu_tokens(dyn, 1), gpu_tokens(kv, 1))
                if got != (dynamo, vllm):
                    wrong.append(f"{label}: (dynamo, kvatlas) {got} != {(dynamo, vllm)}")
        return wrong

    settle(check, "after the restart")
    time.sleep(1.0)  # not synchronisation: Dynamo does not come round by itself in a second
    assert not check()


def test_late_join(pair: Pair, engines: Callable[..., Engine]) -> None:
    """ "late join": blocks an engine published before it was registered. kvatlas asks
    for a full replay when it subscribes; Dynamo only when the engine's next batch shows
    it a gap, so an idle engine's cache stays unknown to it."""
    model = "late"
    e = engines()
    early = [prompt(2) for _ in range(3)]
    for p in early:
        e.serve(p)
    pair.register(e.registration(1, model))

    def check(dynamo_want: int) -> list[str]:
        wrong = []
        for p in early:
            dyn, kv = pair.query(token_ids=p, model_name=model)
            got = (gpu_tokens(dyn, 1), gpu_tokens(kv, 1))
            if got != (dynamo_want, 2 * B):
                wrong.append(f"(dynamo, kvatlas) {got} != {(dynamo_want, 2 * B)}")
        return wrong

    settle(lambda: check(0), "kvatlas replays in full at once")
    time.sleep(1.0)  # not synchronisation: a second in which Dynamo could catch up
    assert not check(0), "Dynamo caught up without a batch"
    e.serve(prompt(2))
    settle(lambda: check(2 * B), "both, once the engine publishes again")


def test_hybrid_sliding_window(pair: Pair, engines: Callable[..., Engine]) -> None:
    """ "hybrid": a model with full attention and a sliding window of two blocks hits a
    prefix only where the window's last blocks are cached too (vLLM's hybrid
    coordinator). kvatlas counts what vLLM hits; Dynamo counts the full-attention
    group alone (it sets sliding-window events aside), claiming hits vLLM cannot make."""
    model = "hybrid"
    e = engines(num_blocks=48, window=2 * B)
    join(pair, e, 1, model)
    full: set[bytes | int] = set()

    def track(events: list[Any]) -> None:
        for ev in events:
            if getattr(ev, "group_idx", 0) not in (0, None):
                continue
            if isinstance(ev, BlockStored):
                full.update(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                full.difference_update(ev.block_hashes)
            else:
                full.clear()

    def fa_run(tokens: list[int]) -> int:
        n = 0
        for h in e.block_hashes(tokens):
            if h not in full:
                break
            n += 1
        return n * B

    rng = random.Random(7)
    stems = [prompt(6, seed=100 + s) for s in range(4)]

    def draw() -> list[int]:
        stem = rng.choice(stems)[: rng.randrange(1, 6 * B)]
        return full_blocks(stem + [rng.randrange(50_000) for _ in range(rng.randrange(B, 3 * B))])

    disagreed = 0
    for step in range(30):
        track(e.serve(draw()) or [])
        probes = [draw() for _ in range(3)]

        def check(probes: list[list[int]] = probes) -> list[str]:
            wrong = []
            for p in probes:
                dyn, kv = pair.query(token_ids=p, model_name=model)
                got = (gpu_tokens(dyn, 1), gpu_tokens(kv, 1))
                want = (fa_run(p), e.hit(p))
                if got != want:
                    wrong.append(f"(dynamo, kvatlas) {got} != {want}")
            return wrong

        settle(check, f"step {step}")
        disagreed += sum(fa_run(p) != e.hit(p) for p in probes)
    assert disagreed, "the workload never told the window's rule from full attention's"


def test_batch_rank(pair: Pair, engines: Callable[..., Engine]) -> None:
    """ "batch rank": a worker registered as dp_rank 2 whose engine stamps its batches
    with data_parallel_rank 0. kvatlas answers under the registered rank (one socket is
    one engine); Dynamo under the rank each batch carries."""
    model = "rank"
    e = engines()
    pair.register(e.registration(1, model, dp_rank=2))
    tokens = prompt(2)
    e.serve(tokens)

    def check() -> list[str]:
        dyn, kv = pair.query(token_ids=tokens, model_name=model)
        got = (dyn["scores"], kv["scores"])
        want = ({"1": {"0": 2 * B}}, {"1": {"2": 2 * B}})
        if got == want:
            return []
        e.tick()
        return [f"(dynamo, kvatlas) {got} != {want}"]

    settle(check, "the batch's rank against the registered one")


def test_dump(pair: Pair, engines: Callable[..., Engine]) -> None:
    """ "dump": two engines with different hash functions (each vLLM process has its own
    block hashes for the same tokens) cache one prompt. Both dumps hold the same blocks
    (local hashes) per worker and tier; kvatlas names each worker's own block hashes,
    Dynamo the first worker's for a block both hold, which the second never published."""
    model = "dump"
    a = engines()
    b = engines(hash_fn=lambda obj: hashlib.sha256(pickle.dumps(obj, protocol=5)).digest())
    join(pair, a, 1, model)
    join(pair, b, 2, model)
    tokens = prompt(3)
    a.serve(tokens)
    # Worker 1's blocks first, so that Dynamo's tree holds its hashes.
    settle(compare(pair, model, {(1, 0): a}, [tokens]), "worker 1's blocks")
    b.serve(tokens)
    own = {1: set(a.block_hashes(tokens)), 2: set(b.block_hashes(tokens))}
    assert not own[1] & own[2]

    def dumps() -> tuple[dict[Any, list[int]], ...]:
        out = []
        for side in pair.both("GET", "/dump"):
            assert side.status == 200, side
            part = side.body[f"{model}:default"]
            assert part["block_size"] == B
            by: dict[Any, list[int]] = {}
            for ev in part["events"]:
                key = (ev["worker_id"], ev["event"]["dp_rank"], ev["storage_tier"])
                for blk in ev["event"]["data"]["stored"]["blocks"]:
                    by.setdefault(key, []).append(blk["tokens_hash"])
                    by.setdefault((*key, "hash"), []).append(blk["block_hash"])
            out.append({k: sorted(v) for k, v in by.items()})
        return out[0], out[1]

    def check() -> list[str]:
        dyn, kv = dumps()
        locals_ = {k: v for k, v in dyn.items() if k[-1] != "hash"}
        if locals_ != {k: v for k, v in kv.items() if k[-1] != "hash"}:
            return [f"dynamo {dyn}", f"kvatlas {kv}"]
        if len(kv.get((2, 0, "device"), [])) < 4:  # warm-up's block and the prompt's 3
            return ["worker 2's blocks not all dumped yet"]
        return []

    settle(check, "both dumps hold the same blocks")
    dyn, kv = dumps()
    for iid in (1, 2):
        assert own[iid] <= set(kv[(iid, 0, "device", "hash")])
    assert own[1] <= set(dyn[(1, 0, "device", "hash")])
    assert not own[2] & set(dyn[(2, 0, "device", "hash")]), "Dynamo fixed its dump"
    assert own[1] <= set(dyn[(2, 0, "device", "hash")])


def test_registry_rules_and_refusals(pair: Pair) -> None:
    """The registry answers alike (codes and messages), and the listed differences:
    "unregister rank" (kvatlas honours dp_rank without routing_group; Dynamo drops every
    rank), "registration checks" (block_size 0, a wildcard host, port 0: kvatlas 400,
    Dynamo registers a worker that can never be read), "error bodies" (a body that does
    not parse or fit: the same codes, JSON reasons from kvatlas, plain text from
    Dynamo's framework), "auth" (kvatlas' routes need the coordinator's token)."""
    ep = "tcp://127.0.0.1:{}".format

    def reg(iid: int, port: int, **extra: Any) -> dict[str, Any]:
        return {
            "instance_id": iid,
            "endpoint": ep(port),
            "model_name": "reg",
            "block_size": B,
            **extra,
        }

    def same(method: str, path: str, body: Any, status: int) -> None:
        dyn, kv = pair.both(method, path, json=body)
        assert dyn.status == kv.status == status, (dyn, kv)
        assert dyn.body == kv.body, (dyn, kv)

    same("POST", "/register", reg(7, 1), 201)
    same("POST", "/register", reg(7, 2, dp_rank=1), 201)
    same("POST", "/register", reg(7, 3, dp_rank=2, routing_group="g"), 409)
    same("POST", "/register", reg(7, 3), 409)
    same("POST", "/register", {**reg(8, 4), "block_size": 32}, 409)
    same("POST", "/register", reg(8, 5, routing_group="g", tenant_id="acme"), 201)
    same("POST", "/register", reg(9, 6, model_name="other", replay_endpoint="bogus"), 400)
    same("POST", "/register", reg(9, 6, endpoint="http://x:1"), 400)
    same("POST", "/unregister", {"instance_id": 99, "model_name": "reg"}, 404)
    same("POST", "/unregister", {"instance_id": 7, "model_name": "other"}, 404)
    same("POST", "/unregister", {"instance_id": 7, "model_name": "reg", "routing_group": "g"}, 404)
    body = {"instance_id": 7, "model_name": "reg", "routing_group": "default", "dp_rank": 5}
    same("POST", "/unregister", body, 404)
    same("POST", "/query", {"token_ids": [1], "model_name": "nothing"}, 404)
    same("POST", "/query_by_hash", {"block_hashes": [1], "model_name": "nothing"}, 404)
    same("POST", "/query", {"token_ids": [], "model_name": "reg"}, 200)

    def workers(query: str = "") -> tuple[Any, Any]:
        dyn, kv = pair.both("GET", f"/workers{query}")
        assert dyn.status == kv.status == 200
        key = lambda w: w["instance_id"]  # noqa: E731
        return sorted(dyn.body, key=key), sorted(kv.body, key=key)

    for q in ("", "?model_name=reg", "?model_name=reg&routing_group=g", "?model_name=x"):
        dyn_w, kv_w = workers(q)
        assert dyn_w == kv_w, q
    assert [w["endpoints"] for w in workers("?routing_group=default")[1]] == [
        {"0": ep(1), "1": ep(2)}
    ]

    # "unregister rank": rank 1 of instance 7, no routing_group.
    body = {"instance_id": 7, "model_name": "reg", "dp_rank": 1}
    dyn, kv = pair.both("POST", "/unregister", json=body)
    assert dyn.status == kv.status == 200
    dyn_w, kv_w = workers("?routing_group=default")
    assert dyn_w == [] and [w["endpoints"] for w in kv_w] == [{"0": ep(1)}]
    same("POST", "/unregister", {"instance_id": 8, "model_name": "reg"}, 200)
    dyn, kv = pair.both("POST", "/unregister", json={"instance_id": 7, "model_name": "reg"})
    assert (dyn.status, kv.status) == (404, 200)

    # "registration checks"
    for bad in (
        {**reg(20, 7, model_name="zero"), "block_size": 0},
        reg(21, 8, endpoint="tcp://*:5557"),
        reg(22, 9, endpoint="tcp://127.0.0.1:0"),
    ):
        dyn, kv = pair.both("POST", "/register", json=bad)
        assert (dyn.status, kv.status) == (201, 400), (bad, dyn, kv)
        assert kv.body["error"]

    # "error bodies": the same codes; kvatlas' reasons are JSON.
    for path, content, status in (
        ("/register", b"{not json", 400),
        ("/register", b'{"instance_id": -1}', 422),
        ("/query", b'{"token_ids": [4294967296], "model_name": "reg"}', 422),
        ("/query", b'{"token_ids": [1.5], "model_name": "reg"}', 422),
        ("/query_by_hash", b'{"block_hashes": [9223372036854775808], "model_name": "r"}', 422),
        ("/unregister", b'{"instance_id": 1}', 422),
        ("/register", b"[]", 422),
    ):
        dyn, kv = pair.both(
            "POST", path, content=content, headers={"content-type": "application/json"}
        )
        assert dyn.status == kv.status == status, (path, content, dyn, kv)
        assert dyn.content_type.startswith("text/plain") and isinstance(kv.body, dict)
        assert kv.body["error"]
    dyn, kv = pair.both("POST", "/query", content=b'{"token_ids": [1], "model_name": "reg"}')
    assert dyn.status == kv.status == 415 and kv.body["error"]

    # "auth"
    plain = pair.kvatlas.get("/workers", headers={"Authorization": ""})
    assert plain.status_code == 401
    assert pair.dynamo.get("/workers").status_code == 200


def test_the_docs_list_exactly_the_differences_asserted_here() -> None:
    text = (ROOT / "docs" / "dynamo.md").read_text()
    section = text.split("## Intended differences", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^- \*\*([a-z ]+)\*\*", section, re.MULTILINE)
    assert len(listed) == len(set(listed))
    assert set(listed) == set(DIFFERENCES)
    for name, test in DIFFERENCES.items():
        assert test in globals(), f"{name}: {test} is not a test here"
