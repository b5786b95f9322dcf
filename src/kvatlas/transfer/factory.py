"""``make_transport``: the one way to get a transport by name (``--p2p-transfer-engine``).

Imports mooncake and nixl only when asked for, so that their packages stay optional
extras; a missing package becomes TransportUnavailable naming what to install.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from types import ModuleType
from typing import Final, Protocol

from kvatlas.transfer import shm, tcp
from kvatlas.transfer.base import (
    Authorizer,
    FaultPlan,
    LocalMemory,
    TransferClient,
    TransferServer,
)
from kvatlas.transfer.config import MooncakeConfig, NixlConfig, ShmConfig, TcpConfig
from kvatlas.transfer.errors import TransferConfigError, TransportUnavailable

TRANSPORTS: Final = ("tcp", "shm", "mooncake", "nixl")
TransportConfig = TcpConfig | ShmConfig | MooncakeConfig | NixlConfig

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
class Transport:
    """A configured transport: builds owner-side servers and requester-side clients."""

    name: str
    config: TransportConfig
    server: ServerFactory
    client: ClientFactory
    enforces_leases: bool
    """True when the owner checks every read against its lease table and the token
    (tcp); False for one-sided transports, where the control plane and checksums do."""


def default_config(name: str) -> TransportConfig:
    """The transport's config with defaults, from the environment where it reads any."""
    if name == "tcp":
        return TcpConfig()
    if name == "shm":
        return ShmConfig()
    if name == "mooncake":
        return MooncakeConfig.from_env()
    if name == "nixl":
        return NixlConfig()
    raise TransferConfigError(
        f"unknown transport {name!r}; accepted transports: {', '.join(TRANSPORTS)}"
    )


def make_transport(name: str, config: TransportConfig | None = None) -> Transport:
    """The transport called ``name`` (tcp, shm, mooncake, nixl) with ``config`` (the transport's
    own config type; defaults and environment when None)."""
    cfg = config if config is not None else default_config(name)
    expected = type(default_config(name)) if name != "mooncake" else MooncakeConfig
    if not isinstance(cfg, expected):
        raise TransferConfigError(
            f"transport {name!r} takes a {expected.__name__}, got {type(cfg).__name__}"
        )
    if isinstance(cfg, TcpConfig):
        return _configured(name, cfg, tcp.TcpServer, tcp.TcpClient)
    if isinstance(cfg, ShmConfig):
        return Transport(name, cfg, shm.ShmServer, shm.ShmClient, shm.ShmServer.enforces_leases)
    if isinstance(cfg, MooncakeConfig):
        mooncake = _optional("mooncake")
        return _configured(name, cfg, mooncake.MooncakeServer, mooncake.MooncakeClient)
    nixl = _optional("nixl")
    return _configured(name, cfg, nixl.NixlServer, nixl.NixlClient)


def _configured(
    name: str,
    cfg: TransportConfig,
    server: type[TransferServer],
    client: type[TransferClient],
) -> Transport:
    """A transport whose classes take their ``config=`` besides the uniform arguments."""
    # As plain callables: the base classes' signatures do not list ``config``.
    make_server: Callable[..., TransferServer] = server
    make_client: Callable[..., TransferClient] = client
    return Transport(
        name,
        cfg,
        partial(make_server, config=cfg),
        partial(make_client, config=cfg),
        server.enforces_leases,
    )


def _optional(name: str) -> ModuleType:
    """A transport module whose package is an optional extra; TransportUnavailable naming
    what to install when it is missing."""
    try:
        return importlib.import_module(f"kvatlas.transfer.{name}")
    except ImportError as exc:
        raise TransportUnavailable(
            f"the {name} transport cannot be imported ({exc}); install it: {INSTALL_HINTS[name]}"
        ) from exc
