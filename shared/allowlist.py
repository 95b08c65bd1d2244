"""What code a party that did not choose it may import: the one check for every name a
server sends an edge that could mean "import this module" (a method, a model).

A server names its run's method and model; to an edge both are input from the network. An
installed name (an entry point of this environment, a built-in) runs code the device's
owner installed. A ``package.module:attr`` spec would run the server's choice of code on
the device, so the edge takes one only if its operator listed that exact spec
(``--allow-method``, ``--allow-model``). The check reads strings only: it imports nothing,
so a refused module is never imported (tests/marker_method.py, tests/plugins/marker_model.py
prove it)."""

from __future__ import annotations

import re
from collections.abc import Callable, Collection

# ``package.module:attr``: dotted identifiers, a colon, one identifier.
MODULE_SPEC = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*", re.ASCII)

# How much of a refused name a message repeats (a server may send megabytes).
SHOWN = 120


def shown(name: str) -> str:
    """``name`` as a refusal quotes it: repr'd, cut at SHOWN characters."""
    return repr(name) if len(name) <= SHOWN else repr(name[:SHOWN]) + "..."


def check_module_spec_allowed(kind: str, name: object, allowed_specs: Collection[str],
                              flag: str, installed: Callable[[], list[str]],
                              attr: str = "Class") -> str:
    """Refuse (ValueError naming the way in) a ``module:attr`` ``name`` of ``kind``
    ("method", "model") not listed in ``allowed_specs``, before anything is imported;
    return the name for the caller's own check of non-module names. ``installed`` lists
    what the edge would take instead (read from entry-point metadata: it imports nothing)."""
    if not isinstance(name, str):
        raise ValueError(f"{kind} must be a string, got {type(name).__name__}")
    if ":" in name and name not in allowed_specs:
        raise ValueError(f"{kind} {shown(name)}: a module:{attr} outside the installed {kind}s; "
                         f"this edge imports no module a server names unless started with "
                         f"{flag} {shown(name)} (installed: {', '.join(installed()) or '(none)'})")
    return name
