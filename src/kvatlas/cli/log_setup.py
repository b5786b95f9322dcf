"""``--log-level`` for every service command: one format, one refusal of a bad level.

Must not: configure anything but the root logger.
"""

from __future__ import annotations

import logging
import sys

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(prog: str, level_name: str) -> bool:
    """Log at ``level_name`` (any case) in the services' format; False (after saying so
    on stderr, naming the flag) when it is not a level."""
    level = logging.getLevelName(str(level_name).upper())
    if not isinstance(level, int):
        print(f"{prog}: --log-level {level_name!r} is not a log level", file=sys.stderr)
        return False
    logging.basicConfig(level=level, format=FORMAT)
    return True
