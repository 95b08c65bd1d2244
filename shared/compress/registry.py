"""Codecs by name: the built-in ones (``BUILTIN``), and any a package registers under the
``fedattn.codecs`` entry-point group, so a user can add a codec without touching fedattn.
Only registered names: a codec is never imported from a module a peer names."""

from __future__ import annotations

import importlib
import re
from importlib.metadata import entry_points

from .codec import Codec, CodecChoice

GROUP = "fedattn.codecs"
#: ``name``, ``name:arg``, either with ``+ef``: the argument is digits, dots, letters.
CODEC_SPEC = re.compile(r"(?P<name>[a-z][a-z0-9_]*)(?::(?P<arg>[A-Za-z0-9_.]+))?(?P<ef>\+ef)?",
                        re.ASCII)


#: The codecs fedattn ships: name -> ``module:Class``.
BUILTIN = {
    "fp16": "fedattn_shared.compress.fp16:Float16",
    "bf16": "fedattn_shared.compress.bf16:BFloat16",
    "int8": "fedattn_shared.compress.int8:Int8",
    "int4": "fedattn_shared.compress.int4:Int4",
    "topk": "fedattn_shared.compress.topk:TopK",
}


def _registered() -> dict[str, str]:
    """Name -> ``module:Class``; a plug-in cannot replace a built-in codec."""
    found = {ep.name: ep.value for ep in entry_points(group=GROUP)}
    return {**found, **BUILTIN}


def available_codecs() -> list[str]:
    return sorted(_registered())


def load_codec(spec: str) -> CodecChoice:
    """``int8``, ``int8:128``, ``topk:0.01+ef`` -> the codec and its error feedback.
    ValueError names what is wrong (an unknown name lists the installed ones)."""
    if not isinstance(spec, str):
        raise ValueError(f"codec must be a string, got {type(spec).__name__}")
    match = CODEC_SPEC.fullmatch(spec)
    if match is None:
        shown = repr(spec) if len(spec) <= 60 else repr(spec[:60]) + "..."
        raise ValueError(f"codec {shown} is not NAME[:ARG][+ef] (e.g. int8, topk:0.01+ef)")
    name = match["name"]
    target = _registered().get(name)
    if target is None:
        raise ValueError(f"unknown codec {name!r} (installed: {', '.join(available_codecs())})")
    module_name, _, attr = target.partition(":")
    cls = getattr(importlib.import_module(module_name), attr, None)
    if not (isinstance(cls, type) and issubclass(cls, Codec)):
        raise ValueError(f"codec {name!r} ({target}) is not a fedattn Codec")
    codec = cls(match["arg"])
    return CodecChoice(codec, feedback=match["ef"] is not None)
