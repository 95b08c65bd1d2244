"""A method outside fedattn's entry points, named by a server as
``tests.marker_method:MarkedAvg``. Importing this module appends the importing process's
id to the file ``$FEDATTN_IMPORT_MARKER`` names, so a test can tell whether an edge
imported a module that its server named (the server, started without the variable,
leaves no trace)."""

from __future__ import annotations

import os

from fedattn_shared.methods.fedavg import FedAvg

_marker = os.environ.get("FEDATTN_IMPORT_MARKER")
if _marker:
    with open(_marker, "a", encoding="utf-8") as handle:
        handle.write(f"{os.getpid()}\n")


class MarkedAvg(FedAvg):
    """FedAvg under another name: what it does is beside the point, being imported is."""

    name = "marked-avg"
