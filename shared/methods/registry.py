"""Methods are looked up by name through the ``fedattn.methods`` entry-point group."""

from __future__ import annotations

import importlib
from collections.abc import Collection
from importlib.metadata import entry_points

from ..allowlist import MODULE_SPEC, check_module_spec_allowed, shown
from .base import Method

GROUP = "fedattn.methods"
__all__ = ["GROUP", "MODULE_SPEC", "available_methods", "check_method_allowed", "load_method"]


def available_methods() -> list[str]:
    return sorted(ep.name for ep in entry_points(group=GROUP))


def check_method_allowed(name: str, allowed_specs: Collection[str] = ()) -> None:
    """Refuse (ValueError, naming the way in) a method that a party which did not choose
    it (an edge, told by its server) has not opted into, before anything is imported: a
    registered name (the ``fedattn.methods`` entry points installed here; listing them
    imports nothing), or a ``module:Class`` spec listed in ``allowed_specs``. Importing a
    module a server names would run that server's choice of code on the device."""
    check_module_spec_allowed("method", name, allowed_specs, "--allow-method", available_methods)
    if ":" not in name and name not in available_methods():
        raise ValueError(f"method {shown(name)} is not installed on this edge (installed: "
                         f"{', '.join(available_methods()) or '(none)'})")


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
