"""The workers registered through the indexer API's ``/register`` (Dynamo 1.6.1's rules
and messages: an instance lives in one partition ``(model_name, routing_group)``, a rank
registers once, a partition has one block size) and the file that keeps them across a
restart (``<--snapshot-path>.indexer``).

Owns the registry and its file's reading. Must not: subscribe or answer HTTP
(`kvatlas.coordinator.indexer.api`).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import msgspec

from kvatlas.coordinator.http.app import HttpError
from kvatlas.coordinator.snapshot import unframe
from kvatlas.coordinator.vllm.sources import VllmSource
from kvatlas.core.device_blocks import EngineId
from kvatlas.core.errors import ConfigError, SnapshotError

BOOK_SUFFIX = ".indexer"
"""The registrations' file, beside the snapshot."""


class Worker(msgspec.Struct, frozen=True):
    """One registered (instance, rank): what the registrations' file keeps."""

    instance_id: int
    dp_rank: int
    model_name: str
    routing_group: str
    block_size: int
    endpoint: str
    replay_endpoint: str | None = None

    @property
    def engine(self) -> EngineId:
        return EngineId(f"{self.instance_id}:{self.dp_rank}")

    @property
    def partition(self) -> tuple[str, str]:
        return self.model_name, self.routing_group

    def source(self) -> VllmSource:
        """The device tier's source: every topic, as Dynamo subscribes."""
        return VllmSource(
            self.engine, self.endpoint, self.replay_endpoint, "", block_size=self.block_size
        )


_book_decoder = msgspec.msgpack.Decoder(list[Worker])


class WorkerRegistry:
    """The registered workers by partition, with Dynamo 1.6.1's rules and messages: an
    instance lives in one partition, a rank registers once, a partition has one block
    size. Single-threaded (`IndexerApi` holds the lock); checks change nothing."""

    def __init__(self) -> None:
        self._parts: dict[tuple[str, str], dict[tuple[int, int], Worker]] = {}
        self._home: dict[int, tuple[str, str]] = {}

    def check_register(self, w: Worker) -> None:
        """HttpError 409 when ``w`` may not join."""
        home = self._home.get(w.instance_id)
        if home is not None and home != w.partition:
            raise HttpError(
                409,
                f"instance {w.instance_id} is already registered for"
                f" model={home[0]} routing_group={home[1]}",
            )
        part = self._parts.get(w.partition, {})
        if (w.instance_id, w.dp_rank) in part:
            raise HttpError(409, f"instance {w.instance_id} dp_rank {w.dp_rank} already registered")
        existing = next(iter(part.values()), None)
        if existing is not None and existing.block_size != w.block_size:
            raise HttpError(
                409,
                f"block_size mismatch for model={w.model_name} routing_group={w.routing_group}:"
                f" existing={existing.block_size}, requested={w.block_size}",
            )

    def add(self, w: Worker) -> None:
        self._parts.setdefault(w.partition, {})[(w.instance_id, w.dp_rank)] = w
        self._home[w.instance_id] = w.partition

    def leaving(
        self, instance_id: int, model_name: str, routing_group: str | None, dp_rank: int | None
    ) -> list[Worker]:
        """The workers an unregistration removes; HttpError 404 when none matches."""
        home = self._home.get(instance_id)
        if home is None:
            raise HttpError(404, f"instance {instance_id} not found")
        if home[0] != model_name or routing_group not in (None, home[1]):
            raise HttpError(
                404,
                f"instance {instance_id} is registered for model={home[0]} routing_group={home[1]}",
            )
        ranks = [w for (i, _), w in self._parts[home].items() if i == instance_id]
        if dp_rank is None:
            return ranks
        found = [w for w in ranks if w.dp_rank == dp_rank]
        if not found:
            raise HttpError(404, f"instance {instance_id} dp_rank {dp_rank} not found")
        return found

    def remove(self, workers: Iterable[Worker]) -> None:
        for w in workers:
            part = self._parts[w.partition]
            del part[(w.instance_id, w.dp_rank)]
            if not any(i == w.instance_id for i, _ in part):
                del self._home[w.instance_id]
            if not part:
                del self._parts[w.partition]

    def partition(self, model_name: str, routing_group: str) -> list[Worker]:
        """The partition's workers; HttpError 404 (Dynamo's words) when it has none."""
        part = self._parts.get((model_name, routing_group))
        if not part:
            raise HttpError(404, f"no indexer for model={model_name} routing_group={routing_group}")
        return list(part.values())

    def partitions(self) -> list[tuple[tuple[str, str], list[Worker]]]:
        return [(key, list(part.values())) for key, part in sorted(self._parts.items())]

    def workers(self) -> list[Worker]:
        return [w for _, ws in self.partitions() for w in ws]


def book_path(snapshot_path: str) -> Path | None:
    """Where registrations are kept (None without ``--snapshot-path``)."""
    return Path(snapshot_path + BOOK_SUFFIX) if snapshot_path else None


def load_book(path: Path | None) -> list[Worker]:
    """The registrations kept in ``path`` ([] when there is none); ConfigError naming
    the file when it cannot be read."""
    if path is None or not path.exists():
        return []
    try:
        return _book_decoder.decode(unframe(path.read_bytes(), path))
    except (OSError, SnapshotError, msgspec.DecodeError) as exc:
        raise ConfigError(
            f"--snapshot-path: {path} cannot be restored ({exc}); move the file away to"
            " start without the registered workers"
        ) from exc


def endpoint_error(endpoint: str) -> str | None:
    """Why a subscriber cannot connect to ``endpoint`` (None: it can): ``tcp://HOST:PORT``
    or ``ipc://PATH``, as Dynamo takes them, but no wildcard host or port 0."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep or not scheme:
        return "missing scheme"
    if scheme == "ipc":
        return None if rest else "missing path"
    if scheme != "tcp":
        return f"unsupported scheme `{scheme}`"
    host, colon, port = rest.rpartition(":")
    if not colon:
        return "missing TCP port"
    if not port.isdigit() or not 0 < int(port) < 65536:
        return f"invalid TCP port `{port}` (1-65535)"
    if not host:
        return "missing host"
    if host == "*":
        return "`*` is a bind address; a subscriber connects to one host"
    return None
