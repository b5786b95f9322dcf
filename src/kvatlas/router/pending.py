"""Prefixes the router has just sent to an engine, before its cache server reports them.

Owns a short-lived index from each full-chunk prefix of a routed prompt to the engines it
went to. The coordinator learns a prefix only once the engine has prefilled it and its
server's events arrived; under load that is seconds after the next request with the
same prefix (a chat's next turn, another question about the same document) has to be
placed. Counting the prefix as the chosen engine's for ``ttl_s`` lets that request
follow it (Dynamo's and SGLang's routers do the same with their own trees). Only the
engine that will hold the prefix benefits: a prefix in flight cannot be read by P2P yet.
The router notes a prompt when it sends it, not when the engine answers: a request that
arrives while the first is still queued or prefilling is the one that would otherwise
compute the prefix a second time (a non-streamed answer's status line comes only with
its last token); an attempt that fails is forgotten.

Prefixes are keyed by the hash of their ``cache_salt`` and little-endian uint32 bytes
(per process; a
collision costs one misplaced request, never wrong KV: the engine's own lookup decides
what it loads). Single-threaded (the router's loop); time is a parameter. Must not: do
I/O.
"""

from __future__ import annotations

from collections import OrderedDict


class PendingPrefixes:
    """Full-chunk prefix -> {engine: expiry} (see the module doc)."""

    def __init__(self, chunk_size: int, ttl_s: float, max_prefixes: int = 200_000) -> None:
        self.chunk_size = chunk_size
        self.ttl_s = ttl_s
        self.max_prefixes = max_prefixes
        self._index: OrderedDict[int, dict[str, float]] = OrderedDict()

    def _keys(self, blob: bytes, salt: str) -> list[int]:
        step = self.chunk_size * 4
        return [hash((salt, blob[:end])) for end in range(step, len(blob) + 1, step)]

    def note(self, blob: bytes, engine: str, now: float, salt: str = "") -> None:
        """``blob`` (the prompt as LE uint32) of ``salt`` was sent to ``engine``."""
        expiry = now + self.ttl_s
        for key in self._keys(blob, salt):
            engines = self._index.get(key)
            if engines is None:
                self._index[key] = engines = {}
            else:
                self._index.move_to_end(key)
            engines[engine] = expiry
        while len(self._index) > self.max_prefixes:
            self._index.popitem(last=False)

    def forget(self, blob: bytes, engine: str, salt: str = "") -> None:
        """``engine`` did not take ``blob`` after all (the attempt failed before its first
        byte): its claims on the prompt's prefixes go; other engines' stay."""
        for key in self._keys(blob, salt):
            engines = self._index.get(key)
            if engines is not None and engines.pop(engine, None) is not None and not engines:
                del self._index[key]

    def leading(self, blob: bytes, now: float, salt: str = "") -> dict[str, int]:
        """Per engine, the leading tokens of ``blob`` of ``salt`` it was sent within
        ``ttl_s`` (a prompt sent under another salt counts for nothing: its KV is not
        this request's to use)."""
        out: dict[str, int] = {}
        for k, key in enumerate(self._keys(blob, salt), start=1):
            engines = self._index.get(key)
            live = [e for e, exp in engines.items() if exp > now] if engines else []
            if not live:
                break
            for e in live:
                out[e] = k * self.chunk_size
        return out

    def __len__(self) -> int:
        return len(self._index)
