"""Transport constructors through one base: ``ConfiguredServer`` / ``ConfiguredClient``
take the uniform arguments and the transport's config (its default when None), and a
client readies its transport once, at construction (``_register_local``)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import numpy as np
import pytest

from kvatlas.transfer.base import (
    ArrayMemory,
    ConfiguredClient,
    ConfiguredServer,
    Endpoint,
    PeerConnection,
)
from kvatlas.transfer.config import NixlConfig
from kvatlas.transfer.factory import make_transport
from transfer.harness import importable


@dataclass(frozen=True)
class _Config:
    knob: int = 1


class _Server(ConfiguredServer[_Config]):
    transport = "test"

    @classmethod
    def default_config(cls) -> _Config:
        return _Config()

    def start(self) -> Endpoint:
        return Endpoint(transport=self.transport, url="test://", region_size=self._region.size)

    def stop(self) -> None:
        return None


class _Client(ConfiguredClient[_Config]):
    transport = "test"

    @classmethod
    def default_config(cls) -> _Config:
        return _Config()

    def _register_local(self) -> None:
        self.registered = (self.config, self.local.size)

    def connect(self, endpoint: Endpoint) -> PeerConnection:
        raise NotImplementedError


def _memory() -> ArrayMemory:
    return ArrayMemory(np.zeros(64, dtype=np.uint8))


def test_the_config_is_given_or_the_transports_default() -> None:
    assert _Server(_memory(), lambda *a: True).config == _Config()
    assert _Server(_memory(), lambda *a: True, config=_Config(7)).config == _Config(7)
    client = _Client(_memory(), "peer", token="t", config=_Config(3))
    assert client.registered == (_Config(3), 64)  # readied once, its config already set
    assert (client.peer_id, client.token) == ("peer", "t")
    assert _Client(_memory(), "peer").registered == (_Config(), 64)


@pytest.mark.parametrize(
    ("transport", "server", "client"),
    [("mooncake", "MooncakeServer", "MooncakeClient"), ("nixl", "NixlServer", "NixlClient")],
)
def test_mooncake_and_nixl_build_through_the_base(transport: str, server: str, client: str) -> None:
    missing = importable(transport)
    if missing is not None:
        pytest.skip(f"{transport} cannot be imported here: {missing}")
    module = importlib.import_module(f"kvatlas.transfer.{transport}")
    assert issubclass(getattr(module, server), ConfiguredServer)
    assert issubclass(getattr(module, client), ConfiguredClient)
    assert "__init__" not in vars(getattr(module, server))
    assert "__init__" not in vars(getattr(module, client))


def test_the_factory_hands_nixl_its_config() -> None:
    missing = importable("nixl")
    if missing is not None:
        pytest.skip(f"nixl cannot be imported here: {missing}")
    config = NixlConfig(poll_max_sleep_s=0.002)
    made = make_transport("nixl", config)
    server = made.server(_memory(), lambda *a: True)
    assert isinstance(server, ConfiguredServer) and server.config is config
    client = made.client(_memory(), "peer")
    try:
        assert isinstance(client, ConfiguredClient) and client.config is config
    finally:
        client.close()
