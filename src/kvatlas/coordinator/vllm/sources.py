"""``--vllm-kv-events``: the vLLM engines whose KV events the coordinator ingests.

Owns the flag value's grammar and its validation, each message naming the flag::

    ENGINE_ID=tcp://HOST:PORT[,replay=tcp://HOST:PORT][,topic=T][,dp_size=N]
              [,block_size=16][,hash=sha256][,seed=vllm-none-hash][,url=http://HOST:PORT]

``dp_size`` N > 1 stands for N data-parallel ranks whose ports are offset by the rank
(as vLLM's ``ZmqEventPublisher.offset_endpoint_port`` binds them), each its own engine
``ENGINE_ID/dpR``. ``block_size``, ``hash`` and ``seed`` are the engine's
``--block-size``, ``--prefix-caching-hash-algo`` and ``PYTHONHASHSEED``: lookups cut
prompts by the block size (until the engine's stores name theirs); the hash and seed
are only checked against what the engine publishes (lookups go by token ids). ``url``
is the engine's OpenAI URL, as ``kvatlas router`` knows it: lookups name it, so a router
maps the engine to its own (without it, a router maps the engine by its cache instance
id, ``--engine URL=ENGINE_ID``).

Must not: open sockets (that is `kvatlas.coordinator.vllm.ingest`).
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from kvatlas.core.device_blocks import EngineId
from kvatlas.core.errors import ConfigError
from kvatlas.core.vllm_hash import DEFAULT_SEED, HASH_ALGOS

FLAG = "--vllm-kv-events"
_OPTIONS = ("replay", "topic", "dp_size", "block_size", "hash", "seed", "url")


@dataclass(frozen=True)
class VllmSource:
    """One vLLM engine (one data-parallel rank) publishing KV events."""

    engine: EngineId
    """The engine's name in lookups and metrics."""
    endpoint: str
    """Its PUB socket, e.g. ``tcp://10.0.0.5:5557``."""
    replay: str | None = None
    """Its replay ROUTER socket; without one, gaps are counted lost."""
    topic: str = ""
    """The topic it publishes on (vLLM's ``topic``; empty: all)."""
    block_size: int = 16
    hash_algo: str = "sha256"
    seed: str = DEFAULT_SEED
    url: str | None = None
    """The engine's OpenAI URL (``url=``), named in lookups for routers."""


def _offset(endpoint: str, rank: int, what: str) -> str:
    if rank == 0:
        return endpoint
    host, _, port = endpoint.rpartition(":")
    if not port.isdigit() or not host:
        raise ConfigError(f"{FLAG}: {what} {endpoint!r} has no port to offset by dp rank")
    return f"{host}:{int(port) + rank}"


def _endpoint(value: str, what: str) -> str:
    if not value.startswith("tcp://") or ":" not in value[len("tcp://") :]:
        raise ConfigError(f"{FLAG}: {what} {value!r} must be tcp://HOST:PORT")
    return value


def parse_source(text: str) -> tuple[VllmSource, ...]:
    """One flag value as its sources (one per data-parallel rank)."""
    head, _, rest = text.partition(",")
    engine, eq, endpoint = head.partition("=")
    if not eq or not engine.strip():
        raise ConfigError(f"{FLAG}: {text!r} must start ENGINE_ID=tcp://HOST:PORT")
    opts: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = part.partition("=")
        if not eq:
            raise ConfigError(f"{FLAG}: option {part!r} must be KEY=VALUE")
        if key not in _OPTIONS:
            raise ConfigError(f"{FLAG}: unknown option {key!r} ({', '.join(_OPTIONS)})")
        opts[key] = value
    ints: dict[str, int] = {}
    for key, default in (("dp_size", 1), ("block_size", 16)):
        raw = opts.get(key, str(default))
        if not raw.isdigit() or int(raw) <= 0:
            raise ConfigError(f"{FLAG}: {key}={raw!r} must be a positive integer")
        ints[key] = int(raw)
    algo = opts.get("hash", "sha256")
    if algo not in HASH_ALGOS:
        raise ConfigError(f"{FLAG}: hash={algo!r} must be one of {', '.join(HASH_ALGOS)}")
    pub = _endpoint(endpoint.strip(), "endpoint")
    replay = _endpoint(opts["replay"], "replay") if "replay" in opts else None
    url = opts.get("url")
    if url is not None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ConfigError(f"{FLAG}: url={url!r} must be http(s)://HOST:PORT")
        url = url.rstrip("/")
    dp = ints["dp_size"]
    return tuple(
        VllmSource(
            EngineId(engine.strip() if dp == 1 else f"{engine.strip()}/dp{rank}"),
            _offset(pub, rank, "endpoint"),
            _offset(replay, rank, "replay") if replay else None,
            opts.get("topic", ""),
            ints["block_size"],
            algo,
            opts.get("seed", DEFAULT_SEED),
            url,
        )
        for rank in range(dp)
    )


def parse_sources(values: list[str] | None) -> tuple[VllmSource, ...]:
    """Every flag value's sources; engine names must be unique."""
    out = tuple(s for v in values or () for s in parse_source(v))
    seen: set[str] = set()
    for s in out:
        if s.engine in seen:
            raise ConfigError(f"{FLAG}: engine {s.engine!r} named twice")
        seen.add(s.engine)
    return out
