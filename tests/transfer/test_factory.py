"""make_transport, transport configs and the interface's shapes (no second process needed)."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from kvatlas.transfer.base import ArrayMemory, Endpoint, ReadOp
from kvatlas.transfer.config import MooncakeConfig, NixlConfig, TcpConfig
from kvatlas.transfer.errors import (
    BadReadRequest,
    EndpointMismatch,
    TransferConfigError,
    TransportUnavailable,
)
from kvatlas.transfer.factory import make_transport


def test_unknown_transport_names_the_accepted_ones() -> None:
    with pytest.raises(TransferConfigError, match="accepted transports: tcp, shm, mooncake, nixl"):
        make_transport("rdma")


def test_a_config_of_another_transport_is_refused() -> None:
    with pytest.raises(TransferConfigError, match="takes a TcpConfig"):
        make_transport("tcp", NixlConfig())


@pytest.mark.parametrize(
    ("module", "transport", "hint"),
    [
        ("mooncake.engine", "mooncake", "mooncake-transfer-engine-non-cuda"),
        ("nixl_cu12", "nixl", "pip install --no-deps nixl-cu12"),
    ],
)
def test_missing_package_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, module: str, transport: str, hint: str
) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # makes `import module` fail
    monkeypatch.setitem(sys.modules, "nixl._api", None)
    monkeypatch.delitem(sys.modules, f"kvatlas.transfer.{transport}", raising=False)
    monkeypatch.delattr(sys.modules["kvatlas.transfer"], transport, raising=False)
    with pytest.raises(TransportUnavailable, match=hint.replace("-", ".")):
        make_transport(transport)


def test_mooncake_config_from_env() -> None:
    assert MooncakeConfig.from_env({}) == MooncakeConfig(protocol="tcp", device="")
    rdma = MooncakeConfig.from_env({"MC_TE_PROTOCOL": "rdma", "MC_TE_DEVICE": "mlx5_0"})
    assert (rdma.protocol, rdma.device) == ("rdma", "mlx5_0")
    with pytest.raises(TransferConfigError, match="needs MC_TE_DEVICE"):
        MooncakeConfig.from_env({"MC_TE_PROTOCOL": "rdma"})
    with pytest.raises(TransferConfigError, match="set both for RDMA"):
        MooncakeConfig.from_env({"MC_TE_DEVICE": "mlx5_0"})
    with pytest.raises(TransferConfigError, match="tcp or rdma"):
        MooncakeConfig.from_env({"MC_TE_PROTOCOL": "efa"})
    with pytest.raises(TransferConfigError, match="whole seconds"):
        MooncakeConfig.from_env({"MC_TRANSFER_TIMEOUT": "soon"})


def test_endpoint_round_trips_through_builtins() -> None:
    endpoint = Endpoint(transport="nixl", url="nixl://a", region_size=4096, extra={"k": "v"})
    assert Endpoint.from_builtins(endpoint.to_builtins()) == endpoint
    with pytest.raises(EndpointMismatch, match="not 'tcp'"):
        make_transport("tcp").client(ArrayMemory(np.zeros(16, np.uint8)), "b").connect(endpoint)


def test_a_local_range_outside_the_region_is_a_caller_bug() -> None:
    client = make_transport("tcp", TcpConfig()).client(ArrayMemory(np.zeros(4096, np.uint8)), "b")
    peer = client.connect(Endpoint(transport="tcp", url="tcp://127.0.0.1:9", region_size=1 << 20))
    with pytest.raises(BadReadRequest, match="outside the local region"):
        peer.read([ReadOp(0, 4096, 1, "l", 0)], 1.0)
    client.close()


def test_shm_refuses_a_peer_on_another_host() -> None:
    client = make_transport("shm").client(ArrayMemory(np.zeros(16, np.uint8)), "b")
    other = Endpoint(transport="shm", url="shm://x", region_size=16, extra={"boot_id": "elsewhere"})
    with pytest.raises(EndpointMismatch, match="another host"):
        client.connect(other)
