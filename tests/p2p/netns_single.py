"""``python -m p2p.netns_single TRANSPORT TMPDIR``: the single-machine P2P test, run as one
script (coordinator, two servers and their engines) inside a private network namespace
that has only loopback, for transports that listen on 0.0.0.0 whatever they are told
(mooncake). ``test_single_machine`` starts it under ``unshare -rn``."""

from __future__ import annotations

import sys
from pathlib import Path

from p2p.test_single_machine import single_machine

if __name__ == "__main__":
    single_machine(Path(sys.argv[2]), sys.argv[1])
    print("NETNS-SINGLE-MACHINE-OK")
