"""Methods are looked up by name through the ``fedattn.methods`` entry-point group."""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points

from .base import Method

GROUP = "fedattn.methods"


def available_methods() -> list[str]:
    return sorted(ep.name for ep in entry_points(group=GROUP))


def load_method(name: str) -> type[Method]:
    """A registered name, or ``package.module:Class`` for a method not (yet) registered."""
    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            cls = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as err:
            raise ValueError(f"cannot load method {name!r}: {err}") from None
        if not (isinstance(cls, type) and issubclass(cls, Method)):
            raise ValueError(f"{name!r} is not a fedattn Method")
        return cls
    matches = [ep for ep in entry_points(group=GROUP) if ep.name == name]
    if not matches:
        known = ", ".join(available_methods()) or "(none installed)"
        raise ValueError(f"unknown method {name!r} (known: {known})")
    cls = matches[0].load()
    if not (isinstance(cls, type) and issubclass(cls, Method)):
        raise ValueError(f"entry point {name!r} ({matches[0].value}) is not a fedattn Method")
    return cls
