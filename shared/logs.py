"""Log lines for daemons: one line per event, UTC timestamps, key=value friendly."""

from __future__ import annotations

import logging
import time


def setup_logging(level: str = "INFO") -> None:
    handler = logging.StreamHandler()
    # Milliseconds: a round on loopback takes well under a second.
    formatter = logging.Formatter("%(asctime)s.%(msecs)03dZ %(levelname)s %(name)s %(message)s",
                                  "%Y-%m-%dT%H:%M:%S")
    formatter.converter = time.gmtime
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
