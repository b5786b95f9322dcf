"""CacheClient: an engine's connection to its local cache server.

Owns the engine side of the engine API: a ZeroMQ DEALER with timeouts, the mapping of the
server's shared L1 region, and the copies into and out of it. Control messages
(``kvatlas.wire.engine_proto``) go over the socket; KV bytes go only through the region.

Exceptions (all derive from KvatlasError)::

    EngineClientError
     +-- ServerUnavailable   no answer within the timeout (server down or overloaded)
     +-- RequestRefused      the server answered with an error; ``code`` says which
          +-- ContractRefused    register: the contract contradicts the server's or fleet's
          +-- ModelNotRegistered a request for a model not registered first
          +-- ServerOverloaded   the server held too many requests; this one was not served
     +-- ChecksumMismatch    bytes read from the region do not match the chunk's checksum

Versions: requests go in ``PROTOCOL_VERSION`` until the server answers ``version``; the
client then moves to the highest version both speak (`wire.versions`; a first-release
server names no range and speaks 1), asks again once, and keeps that version.

Not thread-safe: use one client per thread (a lock guards the socket anyway).
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import Self, TypeVar

import numpy as np
import numpy.typing as npt
import zmq

from kvatlas.core.checksum import copy_and_checksum
from kvatlas.core.errors import KvatlasError
from kvatlas.core.keys import Namespace, as_token_array, chunk_hashes, default_kv_rank, salted
from kvatlas.core.types import ChunkHash
from kvatlas.runtime.region import L1Region
from kvatlas.wire.engine_proto import (
    ENGINE_VERSIONS,
    PROTOCOL_VERSION,
    Abort,
    AbortResult,
    AcquireRead,
    AcquireResult,
    ChunkLoc,
    Commit,
    CommitItem,
    CommitResult,
    EngineRegistered,
    ErrorReply,
    GetStats,
    Lookup,
    LookupResult,
    RegisterEngine,
    Release,
    ReleaseResult,
    Request,
    RequestBody,
    Reserve,
    ReserveResult,
    ResponseBody,
    SlotGrant,
    StatsResult,
    decode_response,
    encode,
)
from kvatlas.wire.versions import highest_common, peer_range


class EngineClientError(KvatlasError):
    """Base of the client's errors."""


class ServerUnavailable(EngineClientError):
    """The cache server did not answer in time."""


class RequestRefused(EngineClientError):
    """The server refused a request; ``code`` is the protocol's error code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


class ContractRefused(RequestRefused):
    """The engine's hash contract contradicts the server's or the fleet's."""


class ModelNotRegistered(RequestRefused):
    """The model was not registered with ``register`` first."""


class ServerOverloaded(RequestRefused):
    """The server held as many engine requests as it may and did not serve this one (it
    changed nothing): recompute, or retry later."""


class Unauthorized(RequestRefused):
    """The server requires an auth token and the client's is missing or wrong."""


class ChecksumMismatch(EngineClientError):
    """Bytes read from the region do not match the chunk's checksum."""


_T = TypeVar("_T")

_REFUSALS: dict[str, type[RequestRefused]] = {
    "contract_mismatch": ContractRefused,
    "not_registered": ModelNotRegistered,
    "unauthorized": Unauthorized,
    "overloaded": ServerOverloaded,
}

ArrayLike = npt.NDArray[np.generic]


@dataclass(frozen=True, slots=True)
class StoreResult:
    """What ``store_chunks`` did, per full chunk of the tokens."""

    stored: int
    existing: int
    refused: int
    """Chunks the server had no room for (or that another writer holds)."""


class CacheClient:
    """Talk to one cache server; ``register`` before anything else."""

    def __init__(
        self,
        url: str = "tcp://127.0.0.1:6555",
        *,
        timeout_s: float = 5.0,
        engine_id: str = "",
        auth_token: str | None = None,
    ) -> None:
        self.url = url
        self._token = auth_token or ""
        self.timeout_s = timeout_s
        self.engine_id = engine_id or f"engine-{os.getpid()}"
        self._ctx = zmq.Context()
        self._sock = self._new_socket()
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._region: L1Region | None = None
        self._array: npt.NDArray[np.uint8] | None = None
        self.info: EngineRegistered | None = None
        self.ns: Namespace | None = None
        self.version = PROTOCOL_VERSION
        """The engine protocol version requests go in (the server's, once it refused ours)."""

    def _new_socket(self) -> zmq.Socket[bytes]:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.url)
        return sock

    # ------------------------------------------------------------------ transport

    def call(self, body: RequestBody, timeout_s: float | None = None) -> ResponseBody:
        """Send one request and wait for its answer; raise on timeout or error replies.
        A ``version`` answer moves the client to the server's version and asks again."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        with self._lock:
            version = self.version
            answer = self._call(body, version, timeout)
            if isinstance(answer, ErrorReply) and answer.code == "version":
                theirs = peer_range(answer.min_v, answer.max_v)
                common = highest_common(ENGINE_VERSIONS, theirs)
                if common is not None and common != version:
                    self.version = common
                    answer = self._call(body, common, timeout)
        if isinstance(answer, ErrorReply):
            cls = _REFUSALS.get(answer.code, RequestRefused)
            raise cls(answer.code, answer.message)
        return answer

    def _call(self, body: RequestBody, version: int, timeout: float) -> ResponseBody:
        """One request in ``version`` and its answer (an ErrorReply too); under the lock."""
        rid = next(self._ids)
        self._sock.send_multipart([b"", encode(Request(version, rid, body, self._token))])
        deadline_ms = int(timeout * 1000)
        while True:
            if not self._sock.poll(deadline_ms, zmq.POLLIN):
                # a late answer would confuse the next call: start a fresh socket
                self._sock.close(0)
                self._sock = self._new_socket()
                raise ServerUnavailable(
                    f"cache server {self.url} did not answer {type(body).__name__}"
                    f" within {timeout:.1f}s"
                )
            frames = self._sock.recv_multipart(copy=True)
            resp = decode_response(frames[-1])
            if resp.id == rid:
                return resp.body  # older ids are answers to requests that timed out

    def _expect(self, body: RequestBody, kind: type[_T]) -> _T:
        resp = self.call(body)
        if not isinstance(resp, kind):
            raise EngineClientError(f"unexpected answer {type(resp).__name__} to {body!r}")
        return resp

    # ------------------------------------------------------------------ operations

    def register(
        self,
        model_name: str,
        kv_dtype: str,
        kv_layout: tuple[int, int, int],
        *,
        chunk_size: int = 256,
        world_size: int = 1,
        kv_rank: int | None = None,
        cache_salt: str = "",
        object_group_id: int = 0,
        openai_url: str = "",
    ) -> EngineRegistered:
        """Declare the model's contract and map the server's L1 region (read-write);
        ``openai_url``: where the engine answers, for the server to advertise."""
        info = self._expect(
            RegisterEngine(
                self.engine_id,
                model_name,
                kv_dtype,
                kv_layout,
                chunk_size,
                world_size,
                openai_url=openai_url,
            ),
            EngineRegistered,
        )
        if self._region is None or self._region.name != info.region_name:
            self._close_region()
            self._region = L1Region.attach(info.region_name, info.region_size, readonly=False)
            self._array = self._region.array
        self.info = info
        rank = default_kv_rank(world_size) if kv_rank is None else kv_rank
        self.ns = Namespace(model_name, rank, object_group_id, cache_salt)
        return info

    def _ns(self, cache_salt: str | None = None) -> Namespace:
        """The registered namespace, under ``cache_salt`` when one is given (a request's
        own: None keeps the one given to ``register``)."""
        if self.ns is None:
            raise EngineClientError("call register() first")
        return self.ns if cache_salt is None else salted(self.ns, cache_salt)

    @property
    def chunk_size(self) -> int:
        if self.info is None:
            raise EngineClientError("call register() first")
        return self.info.chunk_size

    def hashes(self, tokens: Sequence[int] | npt.NDArray[np.integer]) -> list[ChunkHash]:
        """The chunk hashes of the full chunks of ``tokens`` (the server's chunk size)."""
        return chunk_hashes(tokens, self.chunk_size)

    def lookup(
        self,
        tokens: Sequence[int] | npt.NDArray[np.integer] | None = None,
        *,
        hashes: Sequence[ChunkHash] | None = None,
        acquire: bool = False,
        lease_s: float = 0.0,
        recompute_s: float = 0.0,
        prefill_s_per_token: float = 0.0,
        cache_salt: str | None = None,
    ) -> LookupResult:
        """How many leading tokens the server has (L2 hits are promoted into L1).
        ``recompute_s`` (the time recomputing them would take) and
        ``prefill_s_per_token`` (this engine's measured rate) bound the server's wait on
        peers; 0: unknown, the server uses the rate it learned, else its flags."""
        token_bytes = None
        if tokens is not None:
            token_bytes = as_token_array(tokens).astype("<u4", copy=False).tobytes()
        req = Lookup(
            self._ns(cache_salt),
            token_ids=token_bytes,
            hashes=list(hashes) if hashes is not None else None,
            acquire=acquire,
            lease_s=lease_s,
            recompute_s=recompute_s,
            prefill_s_per_token=prefill_s_per_token,
            engine_id=self.engine_id,
        )
        return self._expect(req, LookupResult)

    def reserve(
        self,
        hashes: Sequence[ChunkHash],
        sizes: Sequence[int],
        lease_s: float = 0.0,
        cache_salt: str | None = None,
    ) -> list[SlotGrant]:
        return self._expect(
            Reserve(self._ns(cache_salt), list(hashes), list(sizes), lease_s), ReserveResult
        ).slots

    def commit(self, items: Sequence[CommitItem], cache_salt: str | None = None) -> list[bool]:
        return self._expect(Commit(self._ns(cache_salt), list(items)), CommitResult).committed

    def abort(self, hashes: Sequence[ChunkHash], cache_salt: str | None = None) -> int:
        return self._expect(Abort(self._ns(cache_salt), list(hashes)), AbortResult).aborted

    def acquire(
        self, hashes: Sequence[ChunkHash], lease_s: float = 0.0, cache_salt: str | None = None
    ) -> list[ChunkLoc | None]:
        return self._expect(
            AcquireRead(self._ns(cache_salt), list(hashes), lease_s), AcquireResult
        ).chunks

    def release(self, lease_ids: Sequence[int]) -> int:
        ids = [i for i in lease_ids if i]
        if not ids:
            return 0
        return self._expect(Release(ids), ReleaseResult).released

    def stats(self) -> dict[str, int]:
        return self._expect(GetStats(), StatsResult).values

    @contextmanager
    def read_leases(
        self, hashes: Sequence[ChunkHash], lease_s: float = 0.0
    ) -> Iterator[list[ChunkLoc | None]]:
        """Read-lock ``hashes`` for the block; released on exit, also on error."""
        locs = self.acquire(hashes, lease_s)
        try:
            yield locs
        finally:
            self.release([loc.lease_id for loc in locs if loc is not None])

    # ------------------------------------------------------------------ region access

    def view(self, offset: int, size: int) -> npt.NDArray[np.uint8]:
        """``size`` bytes of the region at ``offset`` as a uint8 array (no copy)."""
        if self._array is None:
            raise EngineClientError("call register() first")
        return self._array[offset : offset + size]

    def read_into(self, loc: ChunkLoc, out: ArrayLike, *, verify: bool = True) -> None:
        """Copy a leased chunk into ``out`` (contiguous, ``loc.size`` bytes)."""
        dst = _bytes_of(out)
        if dst.size != loc.size:
            raise EngineClientError(f"destination has {dst.size} bytes, chunk has {loc.size}")
        src = self.view(loc.offset, loc.size)
        if not verify:
            np.copyto(dst, src)
        elif copy_and_checksum(src, dst) != loc.checksum:
            raise ChecksumMismatch(f"chunk {loc.hash.hex()[:16]} read with a wrong checksum")

    # ------------------------------------------------------------------ helpers

    def store_chunks(
        self,
        tokens: Sequence[int] | npt.NDArray[np.integer],
        arrays: Sequence[ArrayLike],
        lease_s: float = 0.0,
        first_chunk: int = 0,
        cache_salt: str | None = None,
    ) -> StoreResult:
        """Store one array per full chunk of ``tokens`` from chunk ``first_chunk`` on
        (arrays beyond the last full chunk are an error), under ``cache_salt`` (None: the
        registered namespace's).

        Reserve all, copy into the granted slots with the checksum fused, commit all; a
        failure in the middle aborts the slots still held.
        """
        hashes = self.hashes(tokens)[first_chunk:]
        if first_chunk < 0 or len(arrays) > len(hashes):
            raise EngineClientError(
                f"{len(arrays)} arrays from chunk {first_chunk} do not fit the"
                f" {len(hashes) + max(first_chunk, 0)} full chunks of {self.chunk_size} tokens"
            )
        hashes = hashes[: len(arrays)]
        sources = [_bytes_of(a) for a in arrays]
        grants = self.reserve(hashes, [s.size for s in sources], lease_s, cache_salt)
        items: list[CommitItem] = []
        # The server grants one slot per hash, in order: our hashes name them.
        try:
            for h, grant, src in zip(hashes, grants, sources, strict=True):
                if grant.status != "reserved":
                    continue
                dst = self.view(grant.offset, grant.size)
                items.append(CommitItem(h, grant.lease_id, copy_and_checksum(src, dst)))
        except BaseException:
            reserved = [h for h, g in zip(hashes, grants, strict=True) if g.status == "reserved"]
            self.abort(reserved, cache_salt)
            raise
        done = self.commit(items, cache_salt) if items else []
        existing = sum(1 for g in grants if g.status == "exists")
        stored = sum(done)
        return StoreResult(stored, existing, len(grants) - existing - stored)

    def retrieve_prefix(
        self,
        tokens: Sequence[int] | npt.NDArray[np.integer],
        out: Sequence[ArrayLike] | None = None,
        *,
        verify: bool = True,
        cache_salt: str | None = None,
    ) -> list[ArrayLike]:
        """Copy the longest cached prefix of ``tokens`` out of the region.

        With ``out`` (one array per chunk), fills its leading arrays and returns them; else
        returns fresh uint8 arrays. The length of the result is the number of hit chunks.
        """
        res = self.lookup(tokens, acquire=True, cache_salt=cache_salt)
        try:
            result: list[ArrayLike] = []
            for i, loc in enumerate(res.chunks):
                dst = out[i] if out is not None and i < len(out) else np.empty(loc.size, np.uint8)
                self.read_into(loc, dst, verify=verify)
                result.append(dst)
            return result
        finally:
            self.release([loc.lease_id for loc in res.chunks])

    # ------------------------------------------------------------------ lifecycle

    def _close_region(self) -> None:
        self._array = None
        if self._region is not None:
            self._region.close()
            self._region = None

    def close(self) -> None:
        self._close_region()
        self._sock.close(0)
        self._ctx.term()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _bytes_of(a: ArrayLike) -> npt.NDArray[np.uint8]:
    """A contiguous array viewed as flat bytes (no copy)."""
    if not a.flags.c_contiguous:
        raise EngineClientError("arrays must be C-contiguous")
    return a.reshape(-1).view(np.uint8)
