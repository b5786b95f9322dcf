"""The engines of a no-engine fleet run: one CacheClient per node, driven request by request.

Owns what an engine on node k does for one request, and what it observed:

1. ask the coordinator's directory which peers hold the prompt's chunks (``POST
   /directory/lookup``; timed) — the fleet-wide reach of the prompt;
2. probe those hints at the named owners (a read lease through the owner's engine API, then
   release), so the directory's accuracy is measured whether or not P2P is on: a hint whose
   owner no longer has the chunk is stale (a dead owner has nothing);
3. ``lookup(tokens, acquire=True)`` at the local server (timed; with P2P the server reads
   missing chunks from peers), check every hit chunk's bytes against the expected KV of its
   hash (any wrong byte is counted), release the leases;
4. "compute" the chunks nobody gave it and store them.

A request whose node is down goes to the next live node (``rerouted``). Errors of one
request are recorded, never raised. Must not: start or stop processes (``fleet`` does).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvatlas.connector.client import CacheClient, EngineClientError
from kvatlas.core.types import ChunkHash
from kvatlas.evaluation.fleet import Fleet
from kvatlas.evaluation.workload import Request, expected_kv
from kvatlas.wire.directory_api import LookupRequest

log = logging.getLogger(__name__)

MODEL = "kvatlas-eval"
KV_DTYPE = "float16"
KV_LAYOUT = (4, 2, 16)
"""A made-up contract: the runner's chunks are opaque bytes of ``chunk_bytes`` each."""


@dataclass(slots=True)
class RequestRecord:
    """What one request saw; the report's numbers are sums over these."""

    index: int
    t: float
    """Seconds since the run started, when the request began."""
    kind: str
    node: int
    rerouted: bool
    tokens: int
    full_chunks: int
    dir_chunks: int = 0
    """Leading chunks the directory names a holder for (on any node, this one included)."""
    dir_ok: bool = True
    """The directory answered."""
    dir_lookup_s: float = 0.0
    hints: int = 0
    """(chunk, owner) hints probed at other nodes."""
    stale_hints: int = 0
    """Of those, the owner did not have the chunk (or was down)."""
    hit_chunks: int = 0
    peer_chunks: int = 0
    lookup_s: float = 0.0
    p2p_fallback: str = ""
    p2p_ms: dict[str, float] = field(default_factory=dict)
    """Where the server's lookup time went when it asked the directory or peers (its
    ``LookupResult.p2p_ms``); ``lock`` in it means a peer was asked."""
    wrong_kv: int = 0
    """Chunks read (local hit or hint probe) whose bytes were not the chunk's KV."""
    stored: int = 0
    existing: int = 0
    refused: int = 0
    error: str = ""

    @property
    def local_chunks(self) -> int:
        return self.hit_chunks - self.peer_chunks


class NodeDriver:
    """Runs requests against a fleet: one CacheClient per server, single-threaded."""

    def __init__(
        self,
        fleet: Fleet,
        *,
        chunk_bytes: int,
        probe_hints: bool = True,
        directory: bool = True,
        t0: float | None = None,
    ) -> None:
        """``directory``: ask the coordinator's directory before each request (steps 1
        and 2); without it a request measures only its own server. ``t0``: the monotonic
        time records count from (several drivers of one run share it)."""
        self.fleet = fleet
        self.chunk_bytes = chunk_bytes
        self.probe_hints = probe_hints and directory
        self.directory = directory
        self.clients: list[CacheClient | None] = [None] * len(fleet.servers)
        self.incarnations: list[int] = [0] * len(fleet.servers)
        self.t0 = time.monotonic() if t0 is None else t0
        self._kv_cache: dict[bytes, np.ndarray] = {}

    # ------------------------------------------------------------------ clients

    def connect(self, i: int) -> CacheClient:
        """(Re)connect to server ``i`` and register the evaluation's model contract."""
        old = self.clients[i]
        if old is not None:
            old.close()
            self.clients[i] = None
        s = self.fleet.servers[i]
        c = CacheClient(s.engine_url, timeout_s=5.0, engine_id=f"eval-{i}")
        try:
            info = c.register(MODEL, KV_DTYPE, KV_LAYOUT, chunk_size=self.fleet.cfg.chunk_size)
        except BaseException:
            c.close()
            raise
        self.incarnations[i] = info.incarnation
        self.clients[i] = c
        return c

    def connect_all(self) -> None:
        for i in range(len(self.clients)):
            self.connect(i)

    def disconnect(self, i: int) -> None:
        c = self.clients[i]
        self.clients[i] = None
        if c is not None:
            c.close()

    def close(self) -> None:
        for i in range(len(self.clients)):
            self.disconnect(i)

    def _live(self, i: int) -> bool:
        return self.clients[i] is not None and self.fleet.servers[i].alive()

    def _kv(self, h: bytes) -> np.ndarray:
        kv = self._kv_cache.get(h)
        if kv is None:
            if len(self._kv_cache) > 20000:
                self._kv_cache.clear()
            kv = self._kv_cache[h] = expected_kv(h, self.chunk_bytes)
        return kv

    # ------------------------------------------------------------------ one request

    def run(self, req: Request) -> RequestRecord:
        n = len(self.clients)
        node = req.node
        for step in range(n):
            if self._live((req.node + step) % n):
                node = (req.node + step) % n
                break
        else:
            return RequestRecord(
                req.index, self._now(), req.kind, req.node, True, len(req.tokens), 0,
                error="no live node",
            )  # fmt: skip
        client = self.clients[node]
        assert client is not None
        hashes = client.hashes(req.tokens)
        rec = RequestRecord(
            req.index, self._now(), req.kind, node, node != req.node, len(req.tokens), len(hashes)
        )
        try:
            placements = self._directory(req, rec) if self.directory else None
            if self.probe_hints and placements is not None:
                self._probe(node, hashes, placements, rec)
            self._lookup_verify(client, req, rec)
            self._compute_and_store(client, req, hashes, rec)
        except EngineClientError as exc:
            rec.error = f"{type(exc).__name__}: {exc}"
        return rec

    def _now(self) -> float:
        return time.monotonic() - self.t0

    def _directory(self, req: Request, rec: RequestRecord) -> list[list[tuple[str, int]]] | None:
        """Per leading chunk, the (instance, incarnation) L1 owners the directory names."""
        request = LookupRequest(
            tokens_b64=req.tokens.astype("<u4").tobytes(),  # base64 in JSON
            model_name=MODEL,
        )
        t = time.perf_counter()
        resp = self.fleet.lookup(request)
        rec.dir_lookup_s = time.perf_counter() - t
        if resp is None:
            rec.dir_ok = False
            return None
        out: list[list[tuple[str, int]]] = []
        for r in resp.results:
            owners = [(p.instance_id, p.incarnation) for p in r.placements if p.tier == "l1"]
            if not owners:
                break
            out.append(owners)
        rec.dir_chunks = len(out)
        return out

    def _probe(
        self,
        node: int,
        hashes: Sequence[ChunkHash],
        placements: list[list[tuple[str, int]]],
        rec: RequestRecord,
    ) -> None:
        """Check every hint naming another node: does that owner hold the chunk now?"""
        by_owner: dict[str, list[tuple[ChunkHash, int]]] = {}
        for h, owners in zip(hashes, placements, strict=False):
            for iid, inc in owners:
                by_owner.setdefault(iid, []).append((h, inc))
        index = {s.instance_id: i for i, s in enumerate(self.fleet.servers)}
        for iid, items in by_owner.items():
            j = index.get(iid)
            if j == node:
                continue
            rec.hints += len(items)
            if j is None or not self._live(j):
                rec.stale_hints += len(items)
                continue
            owner = self.clients[j]
            assert owner is not None
            # A hint for an older incarnation is stale whatever the new process holds.
            current = [(h, inc) for h, inc in items if inc == self.incarnations[j]]
            rec.stale_hints += len(items) - len(current)
            if not current:
                continue
            locs = owner.acquire([h for h, _ in current])
            try:
                for loc in locs:
                    if loc is None:
                        rec.stale_hints += 1
                    elif not self._bytes_ok(owner, loc.hash, loc.offset, loc.size):
                        rec.wrong_kv += 1
            finally:
                owner.release([loc.lease_id for loc in locs if loc is not None])

    def _bytes_ok(self, c: CacheClient, h: bytes, offset: int, size: int) -> bool:
        return size == self.chunk_bytes and bool(np.array_equal(c.view(offset, size), self._kv(h)))

    def _lookup_verify(self, client: CacheClient, req: Request, rec: RequestRecord) -> None:
        t = time.perf_counter()
        res = client.lookup(req.tokens, acquire=True)
        rec.lookup_s = time.perf_counter() - t
        try:
            rec.hit_chunks = res.hit_chunks
            rec.peer_chunks = res.peer_chunks
            rec.p2p_fallback = res.p2p_fallback
            rec.p2p_ms = dict(res.p2p_ms)
            for loc in res.chunks:
                if not self._bytes_ok(client, loc.hash, loc.offset, loc.size):
                    rec.wrong_kv += 1
        finally:
            client.release([loc.lease_id for loc in res.chunks])

    def _compute_and_store(
        self, client: CacheClient, req: Request, hashes: Sequence[bytes], rec: RequestRecord
    ) -> None:
        if rec.hit_chunks >= len(hashes):
            return
        arrays = [self._kv(h) for h in hashes]
        res = client.store_chunks(req.tokens[: len(hashes) * client.chunk_size], arrays)
        rec.stored, rec.existing, rec.refused = res.stored, res.existing, res.refused
