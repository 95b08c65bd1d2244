"""Log lines for daemons: one line per event, UTC timestamps, key=value friendly."""

from __future__ import annotations

import logging
import re
import time

# Characters that end or rewrite a terminal line (C0/C1 controls, DEL, Unicode line and
# paragraph separators). An edge id, a join's info or a refusal reason comes from the
# network: with a newline in it, a message could print a line that reads as the server's.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def escape_controls(text: str) -> str:
    """``text`` with every control character written as its escape (``\\n``, ``\\x1b``)."""
    return _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


class OneLineFormatter(logging.Formatter):
    """Every message is exactly one line: control characters in it are escaped, whoever
    formatted it (a traceback, added after the message, keeps its own lines)."""

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 - logging's name
        record.message = escape_controls(record.message)
        return super().formatMessage(record)


def setup_logging(level: str = "INFO") -> None:
    handler = logging.StreamHandler()
    # Milliseconds: a round on loopback takes well under a second.
    formatter = OneLineFormatter("%(asctime)s.%(msecs)03dZ %(levelname)s %(name)s %(message)s",
                                 "%Y-%m-%dT%H:%M:%S")
    formatter.converter = time.gmtime
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
