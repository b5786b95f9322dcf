"""Transport configuration: data only, read from the environment in one place
(``from_env``) and validated there with messages an operator understands.

Must not import a transport's library: the factory reads the config before it knows
whether the transport's package is installed.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from kvatlas.transfer.errors import TransferConfigError


@dataclass(frozen=True)
class TcpConfig:
    host: str = "127.0.0.1"
    """Address the owner listens on (loopback in tests)."""
    port: int = 0
    """Port the owner listens on; 0 picks a free one."""
    advertise_host: str | None = None
    """Host to put in the endpoint url when it differs from ``host`` (e.g. 0.0.0.0)."""
    connect_timeout_s: float = 2.0
    """Upper bound of a connect, below the read's deadline."""
    max_connections: int = 256
    """Connections the owner holds at once, served or waiting for their first request;
    one more is closed as soon as it is accepted."""
    first_request_s: float = 5.0
    """Time a new connection has to send its first request, which must carry the token,
    before it gets a thread; a slower or unauthenticated one is closed."""
    idle_timeout_s: float = 60.0
    """A served connection without a request for this long is closed (a requester's
    pooled connection closed while idle is retried once on a fresh one)."""


@dataclass(frozen=True)
class ShmConfig:
    """The shm transport has no settings; the type keeps the factory uniform."""


@dataclass(frozen=True)
class MooncakeConfig:
    host: str = "127.0.0.1"
    """Host name this transport gives Mooncake; the session id peers use is host:rpc_port.
    Mooncake listens on 0.0.0.0 whatever this says (keep it in a private netns in tests)."""
    protocol: str = "tcp"
    """Mooncake transport: tcp, or rdma (from ``MC_TE_PROTOCOL``)."""
    device: str = ""
    """RDMA device names, comma separated (from ``MC_TE_DEVICE``); needed for rdma."""
    transfer_timeout_s: int = 5
    """Mooncake's own bound of a blocking transfer (``MC_TRANSFER_TIMEOUT``, at least 5):
    how long a timed-out read can keep writing into the local slot after its deadline."""

    def __post_init__(self) -> None:
        if self.protocol not in ("tcp", "rdma"):
            raise TransferConfigError(f"MC_TE_PROTOCOL must be tcp or rdma, got {self.protocol!r}")
        if self.protocol == "rdma" and not self.device:
            raise TransferConfigError(
                "MC_TE_PROTOCOL=rdma needs MC_TE_DEVICE (the RDMA device names, e.g. mlx5_0)"
            )
        if self.protocol == "tcp" and self.device:
            raise TransferConfigError(
                "MC_TE_DEVICE is set but MC_TE_PROTOCOL is not rdma: set both for RDMA,"
                " neither for TCP"
            )

    @classmethod
    def from_env(
        cls, env: Mapping[str, str] | None = None, host: str = "127.0.0.1"
    ) -> MooncakeConfig:
        env = os.environ if env is None else env
        protocol = env.get("MC_TE_PROTOCOL", "").strip() or "tcp"
        device = env.get("MC_TE_DEVICE", "").strip()
        raw = env.get("MC_TRANSFER_TIMEOUT", "").strip() or "5"
        if not raw.isdigit():
            raise TransferConfigError(f"MC_TRANSFER_TIMEOUT must be whole seconds, got {raw!r}")
        return cls(host=host, protocol=protocol, device=device, transfer_timeout_s=int(raw))


@dataclass(frozen=True)
class NixlConfig:
    ucx_tls: str = "tcp,cma,self"
    """UCX_TLS when the environment does not set it (``sm``/``shm`` alone fail here)."""
    ucx_net_devices: str = "lo"
    """UCX_NET_DEVICES when the environment does not set it (keeps sockets on loopback)."""
    progress_interval_s: float = 0.01
    """How often the owner drives its agent's progress (connection setup from new peers).
    NIXL's own progress thread spins a core when idle; this costs a small fraction of one."""
    poll_max_sleep_s: float = 0.001
    """Longest sleep between two status polls of an in-flight read (backoff from 20 us)."""

    def __post_init__(self) -> None:
        if self.progress_interval_s <= 0 or self.poll_max_sleep_s <= 0:
            raise TransferConfigError("NIXL progress and poll intervals must be positive")
