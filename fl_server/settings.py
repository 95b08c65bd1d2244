"""The server's configuration with its spec strings resolved once, at start.

``ServerConfig`` (``fedattn_shared.config``) is what an operator writes: TOML keys and
flags, plain values, with no codec imported (a config is read before anything is built).
Some of its values are specs with a grammar of their own: ``compress``
(``up=int8,down=fp16``: codecs from the registry, plug-ins included) and
``staleness_weight`` (``poly:0.5``). ``resolve_settings`` turns them into typed values
once, when the server starts (``fl-server``'s ``resolve``, or a ``ServerApp`` built in
code), refusing a bad one as ``ConfigError`` (exit 2) before anything listens, and every
part of the server reads the typed value instead of parsing the string again.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from fedattn_shared.compress import CompressSpec
from fedattn_shared.config import ConfigError, ServerConfig, parse_staleness
from fedattn_shared.staleness import StalenessWeight


@dataclass
class ServerSettings(ServerConfig):
    """A ``ServerConfig`` whose specs are resolved (module doc): the server reads
    ``compression`` and ``staleness``, never ``compress`` and ``staleness_weight``."""

    compression: CompressSpec = field(default_factory=CompressSpec)  # server.compress
    staleness: StalenessWeight = field(default_factory=lambda: StalenessWeight("constant"))


def resolve_settings(cfg: ServerConfig) -> ServerSettings:
    """``cfg`` with its specs resolved (``cfg.validate()`` checks the rest; fl-server
    calls both); ConfigError names a bad spec, including a codec that cannot be masked
    under --secagg. Settings already resolved are returned as they are."""
    if isinstance(cfg, ServerSettings):
        return cfg
    values = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(ServerConfig)}
    return ServerSettings(**values, compression=_compression(cfg),
                          staleness=parse_staleness(cfg.staleness_weight))


def _compression(cfg: ServerConfig) -> CompressSpec:
    """``server.compress`` parsed against the installed codecs."""
    try:
        spec = CompressSpec.parse(cfg.compress)
    except ValueError as err:
        raise ConfigError(f"server.compress: {err}") from None
    up = spec.up
    if cfg.secagg and up is not None and up.codec.integer_bits is None:
        raise ConfigError(
            f"server.compress up={up.spec} does not combine with --secagg: SecAgg+ sums "
            "integers under its masks, so only an integer codec (up=int8, up=int4) is "
            "masked at its own width; fp16/bf16 values cannot be, and top-k would need an "
            "index set shared by every edge, which fedattn does not implement")
    return spec
