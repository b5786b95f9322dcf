"""What the indexer API's differential suite (test_indexer_api_diff.py) runs: vLLM engines
whose caches are vLLM's own, and the two indexers they feed.

- `Engine`: vLLM's `KVCacheManager` (a full-attention group, or full attention beside
  a sliding window) behind vLLM's `ZmqEventPublisher` with its replay socket: a request
  served takes its blocks, its events (`take_events`, as the engine core publishes
  them, with vLLM's real block hashes, parents, token ids, LoRA names and extra keys)
  go out as one `KVEventBatch`. What vLLM would hit for a prompt (`hit`, from
  `get_computed_blocks`) is the oracle. `restart` is a new engine on the same ports,
  its seqs starting again at 0;
- `Pair`: Dynamo 1.6.1's ``python -m dynamo.indexer`` and a real ``kvatlas coordinator
  --kv-indexer-api`` process, each request sent to both as it is.

The publisher binds only wildcard endpoints (``_is_bind_endpoint``); the subclass here
makes it bind 127.0.0.1 as given, so nothing listens beyond loopback. vLLM's import
chain warns about its own deprecations and sets environment variables; both are kept
out of the session, as tests/vllm_events/conftest.py does.

Must not: judge the answers (the tests do), or start processes but through the
launchers (``support.launch``, the suite conftest's `DynamoIndexer`).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from kvatlas.launch.procs import free_port
from support.wait import wait_until

_env = dict(os.environ)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import torch
    from vllm.distributed.kv_events import (
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
        KVEventBatch,
    )
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )
    from vllm.v1.request import Request

    from support.vllm_publish import DroppingPub, LoopbackPublisher
for _name in set(os.environ) - set(_env):
    del os.environ[_name]
os.environ.update(_env)

__all__ = ["AllBlocksCleared", "BlockRemoved", "BlockStored", "DroppingPub", "Engine", "Pair"]

init_none_hash(sha256_cbor)
_ids = itertools.count()


def _free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _manager(block: int, num_blocks: int, window: int | None) -> KVCacheManager:
    spec: dict[str, Any] = {
        "block_size": block,
        "num_kv_heads": 1,
        "head_size": 8,
        "dtype": torch.float32,
    }
    groups = [KVCacheGroupSpec(["fa"], FullAttentionSpec(**spec))]
    if window is not None:
        groups.append(KVCacheGroupSpec(["sw"], SlidingWindowSpec(**spec, sliding_window=window)))
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
    return KVCacheManager(
        config,
        max_model_len=8192,
        scheduler_block_size=block,
        hash_block_size=block,
        enable_kv_cache_events=True,
    )


@dataclass
class Engine:
    """One vLLM engine (one data-parallel rank): its cache manager and its publisher."""

    block: int = 16
    num_blocks: int = 64
    window: int | None = None
    """A sliding-window group beside full attention, of this many tokens."""
    rank: int = 0
    replay: bool = True
    hash_fn: Any = sha256_cbor
    """The engine's ``--prefix-caching-hash-algo`` (its block hashes, not their content)."""

    def __post_init__(self) -> None:
        self.pub_port = free_port()
        self.replay_port = free_port() if self.replay else 0
        self.hasher = get_request_block_hasher(self.block, self.hash_fn)
        self._start()

    def _start(self) -> None:
        wait_until(
            lambda: _free(self.pub_port) and (not self.replay or _free(self.replay_port)),
            what="the engine's ports",
        )
        self.manager = _manager(self.block, self.num_blocks, self.window)
        self.published = 0
        """Batches published since the (re)start: the next batch's seq."""
        # vLLM offsets both ports by the rank; the ports chosen are the offset ones.
        self.publisher = LoopbackPublisher(
            self.rank,
            endpoint=f"tcp://127.0.0.1:{self.pub_port - self.rank}",
            replay_endpoint=(
                f"tcp://127.0.0.1:{self.replay_port - self.rank}" if self.replay else None
            ),
            topic="kv-events",
        )

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.pub_port}"

    @property
    def replay_endpoint(self) -> str | None:
        return f"tcp://127.0.0.1:{self.replay_port}" if self.replay else None

    def registration(self, instance_id: int, model: str, **extra: Any) -> dict[str, Any]:
        """The ``/register`` body of this engine as worker ``instance_id``."""
        body: dict[str, Any] = {
            "instance_id": instance_id,
            "endpoint": self.endpoint,
            "model_name": model,
            "block_size": self.block,
            "dp_rank": self.rank,
            **extra,
        }
        if self.replay:
            body["replay_endpoint"] = self.replay_endpoint
        return body

    def request(
        self, tokens: Sequence[int], lora: str | None = None, salt: str | None = None
    ) -> Any:
        lora_request = LoRARequest(lora, 1 + abs(hash(lora)) % 1000, f"/l/{lora}") if lora else None
        return Request(
            request_id=str(next(_ids)),
            prompt_token_ids=list(tokens),
            sampling_params=SamplingParams(max_tokens=1),
            pooling_params=None,
            lora_request=lora_request,
            cache_salt=salt,
            block_hasher=self.hasher,
        )

    def serve(
        self, tokens: Sequence[int], lora: str | None = None, salt: str | None = None
    ) -> list[Any] | None:
        """Prefill ``tokens`` (hitting what the cache holds), publish, free, publish;
        the events published. None when the pool had no room (nothing changed)."""
        r = self.request(tokens, lora, salt)
        blocks, hit, _ = self.manager.get_computed_blocks(r)
        n = len(r.prompt_token_ids)
        if self.manager.allocate_slots(r, n - hit, hit, blocks) is None:
            return None
        r.num_computed_tokens = n
        events = self.publish()
        self.manager.free(r)
        return events + self.publish()

    def hit(self, tokens: Sequence[int], lora: str | None = None, salt: str | None = None) -> int:
        """Tokens vLLM's prefix cache would hit for this prompt (the oracle)."""
        hit: int = self.manager.get_computed_blocks(self.request(tokens, lora, salt))[1]
        return hit

    def block_hashes(self, tokens: Sequence[int]) -> list[int]:
        """The prompt's full blocks' hashes as vLLM publishes them (64-bit ints)."""
        return [int.from_bytes(h, "big") & (2**64 - 1) for h in self.request(tokens).block_hashes]

    def publish(self, *events: Any) -> list[Any]:
        """The manager's pending events (or ``events``) as one batch, when any; they."""
        out: list[Any] = list(events) or self.manager.take_events()
        if out:
            self.publisher.publish(KVEventBatch(ts=time.time(), events=out))
            self.published += 1
        return out

    def tick(self) -> None:
        """An empty batch: a subscriber that missed earlier ones sees the gap."""
        self.publisher.publish(KVEventBatch(ts=time.time(), events=[]))
        self.published += 1

    def clear(self) -> None:
        """vLLM's ``reset_prefix_cache``: every block dropped (`AllBlocksCleared`)."""
        assert self.manager.reset_prefix_cache()
        self.publish()

    def restart(self) -> None:
        """The engine process restarts on the same ports: an empty cache, a new
        publisher whose seqs start again at 0."""
        self.publisher.shutdown()
        self._start()

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.publisher.shutdown()


@dataclass
class Answer:
    status: int
    body: Any
    content_type: str


class Pair:
    """Dynamo's indexer and kvatlas' coordinator, asked the same."""

    def __init__(self, dynamo_url: str, kvatlas_url: str, token: str = "") -> None:
        self.dynamo = httpx.Client(base_url=dynamo_url, timeout=10)
        auth = {"Authorization": f"Bearer {token}"} if token else {}
        self.kvatlas = httpx.Client(base_url=kvatlas_url, headers=auth, timeout=10)
        self.registered: list[dict[str, Any]] = []

    def both(self, method: str, path: str, **kwargs: Any) -> tuple[Answer, Answer]:
        out = []
        for client in (self.dynamo, self.kvatlas):
            r = client.request(method, path, **kwargs)
            kind = r.headers.get("content-type", "")
            body = r.json() if kind.startswith("application/json") else r.text
            out.append(Answer(r.status_code, body, kind))
        return out[0], out[1]

    def register(self, body: dict[str, Any]) -> None:
        dyn, kv = self.both("POST", "/register", json=body)
        assert (dyn.status, kv.status) == (201, 201), (dyn, kv)
        self.registered.append(body)

    def unregister_all(self) -> None:
        """Unregister from both whatever `register` registered (instance ids are
        global: a test's are free again for the next)."""
        for body in self.registered:
            self.both(
                "POST", "/unregister", json={k: body[k] for k in ("instance_id", "model_name")}
            )
        self.registered.clear()

    def query(self, **body: Any) -> tuple[Any, Any]:
        """``POST /query`` to both; both must answer 200."""
        dyn, kv = self.both("POST", "/query", json=body)
        assert (dyn.status, kv.status) == (200, 200), (dyn, kv)
        return dyn.body, kv.body

    def close(self) -> None:
        self.dynamo.close()
        self.kvatlas.close()


def gpu_tokens(answer: dict[str, Any], instance_id: int, rank: int = 0) -> int:
    """A ``/query`` answer's ``scores`` for one worker and rank (0 when absent)."""
    return int(answer["scores"].get(str(instance_id), {}).get(str(rank), 0))
