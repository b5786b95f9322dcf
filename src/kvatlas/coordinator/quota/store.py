"""Files of the quota controller's state, beside the snapshot (`--snapshot-path`).

- ``<snapshot>.operator``: the operator state (quotas, default quota, pins, and the log
  positions of the ops applied from Kafka), rewritten after every operator write: it is
  operator intent, which nothing else can rebuild (LMCache's metadata document);
- ``<snapshot>.l2usage``: the L2 usage book, written by the snapshot writer with each
  snapshot, captured in the same lock hold as the fleet state, so a restart (and a
  Kafka replay from the snapshot's positions) rebuilds it exactly.

Both use the snapshot's frame (magic, version, length, blake3) and atomic replacement.
A missing file is an empty state; a corrupt one refuses the start, naming the file.
Must not change any state.
"""

from __future__ import annotations

import logging
from pathlib import Path

import msgspec

from kvatlas.coordinator.snapshot import USAGE_SUFFIX, frame, unframe, write_atomic
from kvatlas.core.coordinator.quotas import OperatorCapture, OperatorState
from kvatlas.core.coordinator.salt_usage import SaltUsage, UsageCapture
from kvatlas.core.errors import ConfigError, SnapshotError

log = logging.getLogger(__name__)

OPERATOR_SUFFIX = ".operator"

_operator_decoder = msgspec.msgpack.Decoder(OperatorCapture)
_usage_decoder = msgspec.msgpack.Decoder(UsageCapture)


def operator_path(snapshot_path: str) -> Path | None:
    return Path(snapshot_path + OPERATOR_SUFFIX) if snapshot_path else None


def write_operator(path: Path, capture: OperatorCapture) -> None:
    write_atomic(path, frame(msgspec.msgpack.encode(capture)))


def load(snapshot_path: str) -> tuple[OperatorState | None, SaltUsage | None]:
    """The operator state and the usage book kept beside ``snapshot_path`` (None for a
    file that is not there). ConfigError naming the file when one cannot be read."""
    if not snapshot_path:
        return None, None
    operator = None
    usage = None
    op_path = Path(snapshot_path + OPERATOR_SUFFIX)
    usage_path = Path(snapshot_path + USAGE_SUFFIX)
    try:
        if op_path.exists():
            operator = OperatorState.restore(
                _operator_decoder.decode(unframe(op_path.read_bytes(), op_path))
            )
            log.info(
                "Restored operator state %s: %d quotas, default %s, %d pinned keys",
                op_path,
                len(operator.limits),
                operator.default_limit_bytes,
                operator.pinned_keys,
            )
        if usage_path.exists():
            usage = SaltUsage.restore(
                _usage_decoder.decode(unframe(usage_path.read_bytes(), usage_path))
            )
            log.info("Restored the L2 usage book %s: %d keys", usage_path, len(usage))
    except (OSError, SnapshotError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ConfigError(
            f"--snapshot-path {snapshot_path}: {op_path.name} or {usage_path.name} cannot be"
            f" restored ({exc}); move the file away to start without it"
        ) from exc
    return operator, usage
