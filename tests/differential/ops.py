"""The operations the differential suite sends, in LMCache 0.5.6's request shapes (and
0.5.7's ``chunk_size`` and ``dropped_events`` where a scenario adds them).

A `Run` is one sequence of requests (one hand-written scenario or one hypothesis
example): fresh instance ids, model and salts, so runs never see each other's keys; it
keeps what it created (instances and their stream seqs, stored keys, quotas, pins) and
`close` undoes it at both coordinators, so every global answer (listings, stats,
usage) starts the next run from the same state. Each method sends one request through
`Pair.send` (both coordinators, judged) and returns the exchange.

Must not: judge answers (``compare.py`` does) or start processes.
"""

from __future__ import annotations

import json
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from coordinator.lmcache_shapes import lmcache_batch
from support.wait import WaitTimeout, wait_until

from .compare import Exchange, compare
from .differences import Call
from .harness import Pair, Target, body

INCARNATION = 1760000000
"""LMCache servers send their process start time (seconds) as the incarnation."""
WORLD = 1
CHUNK = 256


def tokens(first: int, chunks: int, extra: int = 1) -> list[int]:
    """``chunks`` full chunks of distinct tokens from ``first``, plus ``extra`` more."""
    return list(range(first, first + chunks * CHUNK + extra))


@dataclass
class Stream:
    incarnation: int = INCARNATION
    seq: int = 0


@dataclass
class Run:
    pair: Pair
    target: Target | None = None
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    streams: dict[str, Stream] = field(default_factory=dict)
    registered: set[str] = field(default_factory=set)
    departed: set[str] = field(default_factory=set)
    """Ids deregistered after LMCache's gate took a batch of theirs (it has a cursor), not
    registered again since: LMCache 0.5.7's gate refuses their L1 batches as stale."""
    attempted: set[str] = field(default_factory=set)
    """Every id a registration named, refused or not: undone too (where one coordinator
    took a registration the other refused, both forget it)."""
    placed: dict[tuple[str, str, str, bool, str], set[str]] = field(default_factory=dict)
    """(instance, tier, backend, shared, salt) -> hashes of this run's placements there."""
    salts: set[str] = field(default_factory=set)
    unnamed: list[tuple[str, str]] = field(default_factory=list)
    pins: Counter[tuple[tuple[int, ...], str]] = field(default_factory=Counter)
    quota_config_set: bool = False

    @property
    def model(self) -> str:
        return f"m-{self.tag}"

    def iid(self, n: int) -> str:
        return f"{self.tag}-{n}"

    def salt(self, n: int) -> str:
        return f"s{n}-{self.tag}"

    def send(
        self, method: str, path: str, obj: Any = None, kind: str = "valid", **kw: Any
    ) -> Exchange:
        raw = obj if isinstance(obj, bytes) else (None if obj is None else body(obj))
        if (
            (method, path) == ("POST", "/instances")
            and isinstance(obj, dict)
            and obj.get("instance_id")
        ):
            self.attempted.add(str(obj["instance_id"]))
        return self.pair.send(Call(method, path, raw, kind, **kw))

    # -- membership ---------------------------------------------------------------

    def register(self, n: int, port: int = 8080, kind: str = "valid", **extra: Any) -> Exchange:
        iid = self.iid(n)
        ex = self.send(
            "POST",
            "/instances",
            {"instance_id": iid, "ip": "127.0.0.1", "http_port": port, "metadata": {}, **extra},
            kind,
        )
        if ex.lm_status == 200:
            self.registered.add(iid)
            self.departed.discard(iid)
            self.streams.setdefault(iid, Stream())
        return ex

    def register_unnamed(self) -> Exchange:
        """A registration with no instance id: each coordinator names it (``mp-`` and
        32 hex digits); each side's own name is deregistered by `close`."""
        ex = self.send(
            "POST",
            "/instances",
            {"instance_id": "", "ip": "127.0.0.1", "http_port": 8080},
            kind="generated-id",
        )
        lm, kv = ex.lm_json(), ex.kv_json()
        if isinstance(lm, dict) and isinstance(kv, dict):
            self.unnamed.append((str(lm.get("instance_id")), str(kv.get("instance_id"))))
        return ex

    def heartbeat(self, n: int) -> Exchange:
        return self.send("PUT", f"/instances/{self.iid(n)}/heartbeat")

    def deregister(self, n: int) -> Exchange:
        self.registered.discard(self.iid(n))
        s = self.streams.get(self.iid(n))
        if s is not None and s.seq:
            self.departed.add(self.iid(n))
        return self.send("DELETE", f"/instances/{self.iid(n)}")

    # -- events -------------------------------------------------------------------

    def key(self, h: str, salt: str = "", rank: int = 16777472) -> dict[str, Any]:
        return {
            "chunk_hash_hex": h,
            "model_name": self.model,
            "kv_rank": rank,
            "object_group_id": 0,
            "cache_salt": salt,
        }

    def batch(
        self, n: int, event_type: str, *, seq: int | None = None, **fields: Any
    ) -> dict[str, Any]:
        iid = self.iid(n)
        s = self.streams.setdefault(iid, Stream())
        if seq is None:
            seq = s.seq + 1
        out = lmcache_batch(iid, seq, event_type, s.incarnation)
        out.update(fields)  # a scenario may override any field, incarnation and seq too
        return out

    def logged(self, n: int, event_type: str, **fields: Any) -> dict[str, Any]:
        """The next batch of instance ``n``'s stream for a transport that answers nothing
        (Kafka): its seq is taken at once."""
        b = self.batch(n, event_type, **fields)
        self.streams[self.iid(n)].seq = b["seq"]
        return b

    def events(self, *batches: dict[str, Any], kind: str = "valid") -> Exchange:
        """One body of batches; where LMCache's gate took it (200), each stream's next
        seq follows the highest seq of its incarnation it saw."""
        ex = self.send("POST", "/events", {"batches": list(batches)}, kind)
        if ex.lm_status == 200:
            for b in batches:
                s = self.streams.get(str(b.get("instance_id")))
                current = s is not None and b.get("incarnation") == s.incarnation
                if s is not None and current and isinstance(b.get("seq"), int):
                    s.seq = max(s.seq, b["seq"])
        return ex

    def config(
        self, n: int, tier: str, backend: str, capacity: int, revision: int, shared: bool = False
    ) -> Exchange:
        return self.events(
            self.batch(
                n,
                "config",
                tier=tier,
                backend=backend,
                shared=shared,
                capacity_bytes=capacity,
                capacity_revision=revision,
            )
        )

    def place(
        self,
        n: int,
        event_type: str,
        hashes: list[str],
        *,
        tier: str = "l1",
        backend: str = "dram",
        shared: bool = False,
        size: int = 4096,
        token_ids: list[list[int]] | None = None,
        salt: str = "",
        kind: str = "valid",
    ) -> Exchange:
        """One store, access or delete batch of this run's keys (access: backend "")."""
        entries = [
            {
                "key": self.key(h, salt),
                "size_bytes": size if event_type == "store" else 0,
                "token_ids": (token_ids[i] if token_ids else []),
                "token_offset": i * CHUNK if token_ids else -1,
            }
            for i, h in enumerate(hashes)
        ]
        b = self.batch(
            n,
            event_type,
            tier=tier,
            backend="" if event_type == "access" else backend,
            shared=shared,
            entries=entries,
        )
        ex = self.events(b, kind=kind)
        if ex.lm_status == 200 and event_type in ("store", "delete"):
            spot = self.placed.setdefault((self.iid(n), tier, backend, shared, salt), set())
            if event_type == "store":
                spot.update(hashes)
            else:
                spot.difference_update(hashes)
        return ex

    def chain(self, toks: list[int], salt: str = "") -> list[str]:
        """The chunk hashes LMCache's coordinator resolves ``toks`` to (its token
        hasher, blake3 prefix chain): asked of it directly, not compared."""
        r = self.pair.lm.http.post(
            "/directory/lookup",
            json={"token_ids": toks, "model_name": self.model, "cache_salt": salt},
        )
        r.raise_for_status()
        return [res["key"]["chunk_hash_hex"] for res in r.json()["results"]]

    # -- reads --------------------------------------------------------------------

    def get(self, path: str, kind: str = "valid") -> Exchange:
        return self.send("GET", path, kind=kind)

    def lookup_keys(self, hashes: list[str], salt: str = "", kind: str = "valid") -> Exchange:
        return self.send(
            "POST", "/directory/lookup", {"keys": [self.key(h, salt) for h in hashes]}, kind
        )

    def lookup_tokens(
        self, toks: list[int], salt: str = "", model: str | None = None, kind: str = "valid"
    ) -> Exchange:
        return self.send(
            "POST",
            "/directory/lookup",
            {
                "token_ids": toks,
                "cache_salt": salt,
                "model_name": self.model if model is None else model,
            },
            kind,
        )

    # -- quotas and pins ----------------------------------------------------------

    def quota_config(self, gb: float | None, kind: str = "valid", **extra: Any) -> Exchange:
        self.quota_config_set = True
        return self.send("PUT", "/quota/config", {"default_limit_gb": gb, **extra}, kind)

    def set_quota(self, salt: str, gb: Any, kind: str = "valid", **extra: Any) -> Exchange:
        self.salts.add(salt)
        return self.send("PUT", f"/quota/{salt}", {"limit_gb": gb, **extra}, kind)

    def delete_quota(self, salt: str, query: str = "") -> Exchange:
        return self.send("DELETE", f"/quota/{salt}{query}")

    def pin(
        self,
        toks: list[int],
        salt: str = "",
        unpin: bool = False,
        model: str | None = None,
        kind: str = "valid",
    ) -> Exchange:
        ex = self.send(
            "DELETE" if unpin else "POST",
            "/cache/pins",
            {
                "model_name": self.model if model is None else model,
                "world_size": WORLD,
                "token_ids": toks,
                "cache_salt": salt,
            },
            kind,
        )
        if ex.lm_status == 200 and model is None:
            self.pins[(tuple(toks), salt)] += -1 if unpin else 1
        return ex

    # -- forwarded to an MP server --------------------------------------------------

    def prefetch(
        self,
        n: int,
        toks: list[int],
        model: str | None = None,
        kind: str = "valid",
    ) -> tuple[Exchange, str, str]:
        """Submit through both; each answers its own request id (LMCache's, kvatlas')."""
        ex = self.send(
            "POST",
            "/cache/prefetches",
            {
                "instance_id": self.iid(n),
                "model_name": model or Target.MODEL,
                "world_size": WORLD,
                "token_ids": toks,
                "cache_salt": "",
            },
            kind,
        )
        lm, kv = ex.lm_json(), ex.kv_json()
        return ex, _rid(lm), _rid(kv)

    def poll(self, n: int, lm_rid: str, kv_rid: str, settle_s: float = 20.0) -> Exchange:
        """Poll each side until its job is no longer pending (how long a job stays
        pending is the server's timing, not an answer to compare), then judge the two
        final answers. The first poll that sees a job completed drops it, so each side
        is polled only until then."""
        lm_path = f"/cache/prefetches/{self.iid(n)}/{lm_rid}"
        kv_path = f"/cache/prefetches/{self.iid(n)}/{kv_rid}"
        final: dict[str, tuple[int, bytes]] = {}
        last: dict[str, tuple[int, bytes]] = {}

        def settled() -> int:
            for side, client, path in (
                ("lm", self.pair.lm.http, lm_path),
                ("kv", self.pair.kv.http, kv_path),
            ):
                if side not in final:
                    r = client.get(path)
                    last[side] = (r.status_code, r.content)
                    if not (r.status_code == 200 and _status(r.content) == "pending"):
                        final[side] = last[side]
            return len(final)

        try:
            wait_until(
                settled,
                lambda done: done == 2,
                what="both jobs settled",
                timeout=settle_s,
                every=0.02,
            )
        except WaitTimeout:  # still pending: that answer is the one judged
            final = {**last, **final}
        ex = Exchange(
            Call("GET", lm_path, kv_path=kv_path), *final["lm"], *final["kv"], self.pair.version
        )
        self.pair.verdicts.append(compare(ex))
        return ex

    def delete(
        self, n: int, toks: list[int], tier: str = "l1", force: bool = False, kind: str = "valid"
    ) -> Exchange:
        return self.send(
            "POST",
            "/cache/delete",
            {
                "instance_id": self.iid(n),
                "model_name": Target.MODEL,
                "world_size": WORLD,
                "token_ids": toks,
                "cache_salt": "",
                "tier": tier,
                "force": force,
            },
            kind,
        )

    # -- undo -----------------------------------------------------------------------

    def close(self) -> None:
        """Undo this run at both coordinators (sent raw: not judged)."""
        for (iid, tier, backend, shared, salt), hashes in self.placed.items():
            if hashes:
                s = self.streams[iid]
                s.seq += 1
                entries = [
                    {"key": self.key(h, salt), "size_bytes": 0, "token_ids": [], "token_offset": -1}
                    for h in sorted(hashes)
                ]
                b = {
                    "instance_id": iid,
                    "incarnation": s.incarnation,
                    "seq": s.seq,
                    "event_type": "delete",
                    "tier": tier,
                    "backend": backend,
                    "entries": entries,
                    "shared": shared,
                    "ts": 0.0,
                    "capacity_bytes": 0,
                    "capacity_revision": 0,
                }
                self.pair.raw(Call("POST", "/events", body({"batches": [b]})))
        for (toks, salt), count in self.pins.items():
            for _ in range(max(count, 0)):
                self.pair.raw(
                    Call(
                        "DELETE",
                        "/cache/pins",
                        body(
                            {
                                "model_name": self.model,
                                "world_size": WORLD,
                                "token_ids": list(toks),
                                "cache_salt": salt,
                            }
                        ),
                    )
                )
        for salt in self.salts:
            self.pair.raw(Call("DELETE", f"/quota/{salt}"))
        if self.quota_config_set:
            self.pair.raw(Call("PUT", "/quota/config", body({"default_limit_gb": None})))
        for lm_id, kv_id in self.unnamed:
            self.pair.raw(Call("DELETE", f"/instances/{lm_id}", kv_path=f"/instances/{kv_id}"))
        for iid in sorted(set(self.streams) | self.registered | self.attempted):
            self.pair.raw(Call("DELETE", f"/instances/{iid}"))


def _rid(answer: Any) -> str:
    return str(answer.get("request_id", "")) if isinstance(answer, dict) else ""


def _status(content: bytes) -> Any:
    try:
        return json.loads(content).get("status")
    except (ValueError, AttributeError):
        return None
