"""Run ``kvatlas server`` as a node of the first release speaks on the wire (version 1).

``python tests/upgrade/v1_node.py <kvatlas server flags>``. Before the server's modules
are imported, this replaces in the process what the wire is made of with the frozen
copy (`support.frozen_wire_v1`), and what the first release did with versions with a
copy of that behaviour (below), so that today's server code runs the old wire:

- ``kvatlas.wire.p2p_proto`` and ``kvatlas.wire.engine_proto``: every name the frozen
  module defines (its Structs, its ``PROTOCOL_VERSION`` 1, its codec) replaces today's;
- the P2P channel's server and client and the engine API's server answer and ask as the
  first release did: version 1 only, any other refused with a bare ``version`` error,
  no moving between versions, no ``unknown_operation``;
- the tcp data plane advertises no versions (the first release's endpoint had none; its
  version 1 requests are the same bytes as the frozen ``tcp_frame``'s, which
  ``test_frozen_wire`` checks);
- event bodies go out in the frozen compact encoding (today's batches are read into the
  frozen shapes, so a field added since is not sent), Kafka records too.

This file is not frozen: it follows today's server internals (the shells' private
methods) and fails loudly, never silently, when they move. The frozen package is what
must never change.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: ``support``

from kvatlas.core.keys import Namespace
from support.frozen_wire_v1 import events as frozen_events
from support.frozen_wire_v1 import shapes


def _same_shape(a: type[msgspec.Struct], b: type[msgspec.Struct]) -> None:
    fa = [(f.name, f.default) for f in msgspec.structs.fields(a)]
    fb = [(f.name, f.default) for f in msgspec.structs.fields(b)]
    if fa != fb:
        raise SystemExit(f"{a.__qualname__} is no longer the frozen wire shape: {fa} != {fb}")


# The server uses core's Namespace as a dict key: the frozen protocols must carry that
# class, so check that it is still the frozen shape and lend it to them.
_same_shape(Namespace, shapes.Namespace)
setattr(shapes, "Namespace", Namespace)  # noqa: B010 (a module attribute, on purpose)

from kvatlas.wire import engine_proto, p2p_proto  # noqa: E402
from support.frozen_wire_v1 import engine_proto as frozen_engine  # noqa: E402
from support.frozen_wire_v1 import p2p_proto as frozen_p2p  # noqa: E402


def _overlay(module: ModuleType, frozen: ModuleType) -> None:
    for name, value in vars(frozen).items():
        if not name.startswith("__") and not isinstance(value, ModuleType):
            setattr(module, name, value)


_overlay(p2p_proto, frozen_p2p)
_overlay(engine_proto, frozen_engine)

from kvatlas.cli import server as cli  # noqa: E402
from kvatlas.runtime import coordinator_client  # noqa: E402
from kvatlas.server import engine_api, sinks  # noqa: E402
from kvatlas.server.p2p import channel  # noqa: E402
from kvatlas.transfer import tcp  # noqa: E402
from kvatlas.transfer.base import Endpoint  # noqa: E402
from kvatlas.wire.events_api import compact_batch  # noqa: E402
from upgrade import v1_behaviour  # noqa: E402

_to_frozen = msgspec.msgpack.Decoder(shapes.EventBatch)


def _frozen_batch(batch: Any) -> shapes.EventBatch:
    return _to_frozen.decode(msgspec.msgpack.encode(compact_batch(batch)))


def _events_body(batches: Sequence[Any]) -> bytes:
    return frozen_events.encode_events_msgpack([_frozen_batch(b) for b in batches])


def _record(batch: Any) -> bytes:
    return frozen_events.encode_batch_msgpack(_frozen_batch(batch))


# Where the sinks took today's encoders by name: they send the frozen encodings.
setattr(coordinator_client, "encode_events_msgpack", _events_body)  # noqa: B010
setattr(sinks, "encode_batch_msgpack", _record)  # noqa: B010


_tcp_start = tcp.TcpServer.start


def _tcp_start_v1(self: tcp.TcpServer) -> Endpoint:
    endpoint = _tcp_start(self)
    return Endpoint(
        transport=endpoint.transport, url=endpoint.url, region_size=endpoint.region_size
    )


setattr(channel.ChannelServer, "_answer", v1_behaviour.channel_answer)  # noqa: B010
setattr(channel.ChannelClient, "call", v1_behaviour.channel_call)  # noqa: B010
setattr(engine_api.EngineApi, "_answer", v1_behaviour.engine_answer)  # noqa: B010
setattr(tcp.TcpServer, "start", _tcp_start_v1)  # noqa: B010

if __name__ == "__main__":
    sys.exit(cli.main(sys.argv[1:]))
