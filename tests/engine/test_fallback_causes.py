"""The connector's fallback causes: one ``p2p_<reason>`` per reason the server gives."""

from __future__ import annotations

from kvatlas.connector.kv_connector import Fallback
from kvatlas.wire.engine_proto import PeerFallback


def test_every_server_reason_has_its_p2p_cause() -> None:
    for reason in PeerFallback:
        assert Fallback.from_peer(reason.value) == "p2p_" + reason.value


def test_a_reason_the_connector_does_not_know_is_p2p_other() -> None:
    assert Fallback.from_peer("quota exceeded") is Fallback.P2P_OTHER
