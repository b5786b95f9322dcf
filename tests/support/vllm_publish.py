"""vLLM's own KV-event publisher as the device-tier and Dynamo suites run it: bound to
loopback (`LoopbackPublisher`; vLLM binds only wildcard endpoints itself), and a PUB
socket that loses chosen seqs on the wire (`DroppingPub`, a forced gap). Import it only
where vLLM is installed, after the importer has silenced vLLM's import-time warnings and
kept its environment changes out (tests/vllm_events/conftest.py does both)."""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_events import ZmqEventPublisher


class LoopbackPublisher(ZmqEventPublisher):
    """vLLM's publisher, binding 127.0.0.1 (vLLM connects to non-wildcard hosts)."""

    @staticmethod
    def _is_bind_endpoint(endpoint: str) -> bool:
        return True


class DroppingPub:
    """The publisher's PUB socket, losing the seqs in ``drop`` on the wire (they stay in
    vLLM's replay buffer): a forced gap."""

    def __init__(self, inner: Any, drop: set[int]) -> None:
        self.inner = inner
        self.drop = drop

    def send_multipart(self, frames: Any, *args: Any, **kwargs: Any) -> None:
        if int.from_bytes(frames[1], "big") in self.drop:
            return
        self.inner.send_multipart(frames, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
