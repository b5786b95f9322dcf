"""``make_engine``: the one way to get a transfer engine by name (``--p2p-transfer-engine``).

Imports mooncake and nixl only when asked for, so that their packages stay optional
extras; a missing package becomes EngineUnavailable naming what to install.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from types import ModuleType
from typing import Final, Protocol

from kvatlas.transfer.base import (
    Authorizer,
    FaultPlan,
    LocalMemory,
    TransferClient,
    TransferServer,
)
from kvatlas.transfer.config import MooncakeConfig, NixlConfig, ShmConfig, TcpConfig
from kvatlas.transfer.errors import EngineUnavailable, TransferConfigError

ENGINES: Final = ("tcp", "shm", "mooncake", "nixl")
EngineConfig = TcpConfig | ShmConfig | MooncakeConfig | NixlConfig

INSTALL_HINTS: Final = {
    "mooncake": "pip install 'kvatlas[mooncake]' (mooncake-transfer-engine-non-cuda)"
    " and apt-get install libibverbs1",
    "nixl": "pip install --no-deps nixl-cu12 (its dependencies pull a CUDA torch)",
}


class ServerFactory(Protocol):
    def __call__(
        self,
        region: LocalMemory,
        authorize: Authorizer,
        *,
        token: str | None = None,
        faults: FaultPlan | None = None,
    ) -> TransferServer: ...


class ClientFactory(Protocol):
    def __call__(
        self,
        local: LocalMemory,
        peer_id: str,
        *,
        token: str | None = None,
        faults: FaultPlan | None = None,
    ) -> TransferClient: ...


@dataclass(frozen=True)
class Engine:
    """A configured engine: builds owner-side servers and requester-side clients."""

    name: str
    config: EngineConfig
    server: ServerFactory
    client: ClientFactory
    enforces_leases: bool
    """True when the owner checks every read against its lease table and the token
    (tcp); False for one-sided engines, where the control plane and checksums do."""


def default_config(name: str) -> EngineConfig:
    """The engine's config with defaults, from the environment where it reads any."""
    if name == "tcp":
        return TcpConfig()
    if name == "shm":
        return ShmConfig()
    if name == "mooncake":
        return MooncakeConfig.from_env()
    if name == "nixl":
        return NixlConfig()
    raise TransferConfigError(
        f"unknown transfer engine {name!r}; accepted engines: {', '.join(ENGINES)}"
    )


def make_engine(name: str, config: EngineConfig | None = None) -> Engine:
    """The engine called ``name`` (tcp, shm, mooncake, nixl) with ``config`` (the engine's
    own config type; defaults and environment when None)."""
    cfg = config if config is not None else default_config(name)
    expected = type(default_config(name)) if name != "mooncake" else MooncakeConfig
    if not isinstance(cfg, expected):
        raise TransferConfigError(
            f"transfer engine {name!r} takes a {expected.__name__}, got {type(cfg).__name__}"
        )
    if isinstance(cfg, TcpConfig):
        from kvatlas.transfer import tcp

        return _configured(name, cfg, tcp.TcpServer, tcp.TcpClient)
    if isinstance(cfg, ShmConfig):
        from kvatlas.transfer import shm

        return Engine(name, cfg, shm.ShmServer, shm.ShmClient, shm.ShmServer.enforces_leases)
    if isinstance(cfg, MooncakeConfig):
        mooncake = _optional("mooncake")
        return _configured(name, cfg, mooncake.MooncakeServer, mooncake.MooncakeClient)
    nixl = _optional("nixl")
    return _configured(name, cfg, nixl.NixlServer, nixl.NixlClient)


def _configured(
    name: str,
    cfg: EngineConfig,
    server: type[TransferServer],
    client: type[TransferClient],
) -> Engine:
    """An engine whose classes take their ``config=`` besides the uniform arguments."""
    # As plain callables: the base classes' signatures do not list ``config``.
    make_server: Callable[..., TransferServer] = server
    make_client: Callable[..., TransferClient] = client
    return Engine(
        name,
        cfg,
        partial(make_server, config=cfg),
        partial(make_client, config=cfg),
        server.enforces_leases,
    )


def _optional(name: str) -> ModuleType:
    """An engine module whose package is an optional extra; EngineUnavailable naming
    what to install when it is missing."""
    try:
        return importlib.import_module(f"kvatlas.transfer.{name}")
    except ImportError as exc:
        raise EngineUnavailable(
            f"the {name} transfer engine cannot be imported ({exc});"
            f" install it: {INSTALL_HINTS[name]}"
        ) from exc
