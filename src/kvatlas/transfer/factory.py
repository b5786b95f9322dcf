"""``make_engine``: the one way to get a transfer engine by name (``--p2p-transfer-engine``).

Imports mooncake and nixl only when asked for, so that their packages stay optional
extras; a missing package becomes EngineUnavailable naming what to install.
"""

from __future__ import annotations

from dataclasses import dataclass
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

        tcp_cfg = cfg
        return Engine(
            name,
            cfg,
            lambda region, authorize, *, token=None, faults=None: tcp.TcpServer(
                region, authorize, token=token, faults=faults, config=tcp_cfg
            ),
            lambda local, peer_id, *, token=None, faults=None: tcp.TcpClient(
                local, peer_id, token=token, faults=faults, config=tcp_cfg
            ),
            tcp.TcpServer.enforces_leases,
        )
    if isinstance(cfg, ShmConfig):
        from kvatlas.transfer import shm

        return Engine(name, cfg, shm.ShmServer, shm.ShmClient, shm.ShmServer.enforces_leases)
    if isinstance(cfg, MooncakeConfig):
        try:
            from kvatlas.transfer import mooncake
        except ImportError as exc:
            raise EngineUnavailable(
                f"the mooncake transfer engine cannot be imported ({exc});"
                f" install it: {INSTALL_HINTS['mooncake']}"
            ) from exc
        mc_cfg = cfg
        return Engine(
            name,
            cfg,
            lambda region, authorize, *, token=None, faults=None: mooncake.MooncakeServer(
                region, authorize, token=token, faults=faults, config=mc_cfg
            ),
            lambda local, peer_id, *, token=None, faults=None: mooncake.MooncakeClient(
                local, peer_id, token=token, faults=faults, config=mc_cfg
            ),
            mooncake.MooncakeServer.enforces_leases,
        )
    try:
        from kvatlas.transfer import nixl
    except ImportError as exc:
        raise EngineUnavailable(
            f"the nixl transfer engine cannot be imported ({exc});"
            f" install it: {INSTALL_HINTS['nixl']}"
        ) from exc
    nixl_cfg = cfg
    return Engine(
        name,
        cfg,
        lambda region, authorize, *, token=None, faults=None: nixl.NixlServer(
            region, authorize, token=token, faults=faults, config=nixl_cfg
        ),
        lambda local, peer_id, *, token=None, faults=None: nixl.NixlClient(
            local, peer_id, token=token, faults=faults, config=nixl_cfg
        ),
        nixl.NixlServer.enforces_leases,
    )
