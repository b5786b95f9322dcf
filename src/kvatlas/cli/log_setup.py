"""``--log-level`` for every service command: one format, one refusal of a bad level.

Must not: configure anything but the root logger and the levels of the libraries
whose own request logs would repeat ours (httpx logs every request at INFO).
"""

from __future__ import annotations

import logging
import sys

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_CHATTY = ("httpx",)


def configure_logging(prog: str, level_name: str) -> bool:
    """Log at ``level_name`` (any case) in the services' format; False (after saying so
    on stderr, naming the flag) when it is not a level."""
    level = logging.getLevelName(str(level_name).upper())
    if not isinstance(level, int):
        print(f"{prog}: --log-level {level_name!r} is not a log level", file=sys.stderr)
        return False
    logging.basicConfig(level=level, format=FORMAT)
    # httpx's "HTTP Request: ..." line for every call the router and the services make:
    # a second INFO line per routed request. Kept at DEBUG, where it helps.
    for name in _CHATTY:
        logging.getLogger(name).setLevel(
            logging.DEBUG if level <= logging.DEBUG else logging.WARNING
        )
    return True
