"""A model outside fedattn, named by a server as ``tests.marker_model:build``. Importing this
module appends the importing process's id to the file ``$FEDATTN_IMPORT_MARKER`` names, so
a test can tell whether an edge imported a model module that its server named (the server,
started without the variable, leaves no trace). The model itself is beside the point."""

from __future__ import annotations

import os

from torch import nn

from fedattn_shared.models.lenet import LeNetBN

_marker = os.environ.get("FEDATTN_IMPORT_MARKER")
if _marker:
    with open(_marker, "a", encoding="utf-8") as handle:
        handle.write(f"{os.getpid()}\n")


def build(num_classes: int, in_channels: int, image_size: int) -> nn.Module:
    """pFedLA's LeNet-BN under another name (its head found by inspection)."""
    return LeNetBN(num_classes, in_channels, image_size)
