"""The run configuration: what a server tells every edge at join (``JoinReply.config_json``).

One typed value, serialised once on the server (``RunConfig.to_json``) and parsed once on
the edge (``RunConfig.from_json``), so the contract between the two is this file rather
than the dictionary keys each side happens to read. The edge reads the server's bytes as
hostile: ``from_json`` checks every key and type before anything of it is used, and a
garbled, truncated or adversarial config is one ``RunConfigError`` naming the key at fault
(never a KeyError or a RecursionError deep in training).

What it does not check is the edge's own policy (the method allowlist, its privacy limits,
``--refuse-eval-detail``): the edge holds the parsed value to those (``fl_edge.run``). The
method's parameters stay a mapping here: typing them needs the method's class, which the
edge may import only after its allowlist accepted the name.

Versions. ``version`` says which contract the bytes follow; an edge refuses a version it
does not know, by number, instead of misreading a later server's keys. Version 1 is the
contract as it stood before the field existed, so it is written without the key: the
bytes on the wire (and the configs stored in checkpoints and edge state dirs) stay what
they were, and a config without ``version`` is version 1. A later version writes
``"version": N``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from .compress.spec import CompressSpec
from .config import CLIP_WITH_DP, ConfigError, DPConfig, TrainConfig, apply_values, shown
from .privacy.secagg import SecAggPolicy

#: The contract this fedattn writes and the ones it reads.
RUN_CONFIG_VERSION = 1
KNOWN_VERSIONS = (1,)
#: The keys of a version-1 config; any other is refused by name.
KEYS = frozenset({"version", "method", "train", "params", "dp", "secagg", "compress", "mode",
                  "eval_detail"})
Mode = Literal["sync", "async"]


class RunConfigError(ValueError):
    """A run config this side cannot use. ``key`` is the top-level key at fault ("" for
    the document itself), so the edge can say which setting it refuses."""

    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key = key


@dataclass(frozen=True)
class RunConfig:
    """The server -> edge run contract (module doc)."""

    method: str                      # a registered method or a module:Class (the edge's allowlist decides)
    train: TrainConfig
    params: Mapping[str, Any] = field(default_factory=dict)  # the method's Params, as values
    dp: DPConfig | None = None       # DP-SGD's resolved [dp] section; None: no DP
    secagg: SecAggPolicy | None = None  # what every edge holds each SecAgg+ round to
    compress: CompressSpec = field(default_factory=CompressSpec)  # the codecs of each direction
    mode: Mode = "sync"              # async: training uploads carry the model's change
    eval_detail: bool = False        # evaluations carry per-class counts
    version: int = RUN_CONFIG_VERSION

    # ---- the server: serialised once -------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The JSON object; an optional key at its default is left out (as it was before
        it existed), so a plain run's config is what it always was."""
        out: dict[str, Any] = {"method": self.method, "train": dataclasses.asdict(self.train),
                               "params": dict(self.params)}
        if self.version != 1:
            out["version"] = self.version
        if self.dp is not None:
            out["dp"] = dataclasses.asdict(self.dp)
        if self.secagg is not None:
            out["secagg"] = self.secagg.to_config()
        if self.compress:
            out["compress"] = self.compress.text
        if self.mode != "sync":
            out["mode"] = self.mode
        if self.eval_detail:
            out["eval_detail"] = True
        return out

    def to_json(self) -> str:
        """The bytes the server sends (keys sorted: one config, one text)."""
        return json.dumps(self.to_dict(), sort_keys=True)

    # ---- the edge: parsed once -------------------------------------------------------
    @classmethod
    def from_json(cls, text: str | bytes, source: str = "server config") -> RunConfig:
        """The config a peer sent (or a state dir stored). RunConfigError names what is
        wrong; ``source`` names where it came from in the messages."""
        try:
            data = json.loads(text)
        except RecursionError:  # a document nested deeper than the parser's stack
            raise RunConfigError("", "not valid JSON: nested too deeply") from None
        except (ValueError, TypeError) as err:  # JSONDecodeError, undecodable bytes
            raise RunConfigError("", f"not valid JSON: {err}") from None
        return cls.from_dict(data, source)

    @classmethod
    def from_dict(cls, data: object, source: str = "server config") -> RunConfig:
        """``from_json`` on the decoded object."""
        if not isinstance(data, dict):
            raise RunConfigError("", f"expected a JSON object, got {type(data).__name__}")
        version = data.get("version", 1)
        if type(version) is not int:
            raise RunConfigError("version", f"version must be an integer, got {shown(version)}")
        if version not in KNOWN_VERSIONS:
            raise RunConfigError("version", f"run config version {shown(version)} is not one this "
                                 f"fedattn knows (it reads version "
                                 f"{', '.join(map(str, KNOWN_VERSIONS))}): the server runs another "
                                 "fedattn release; install the server's on this edge")
        unknown = sorted(set(data) - KEYS)
        if unknown:
            raise RunConfigError(unknown[0], f"unknown keys {shown(unknown, 120)} in a version "
                                 f"{version} run config")
        for key in ("method", "train"):
            if key not in data:
                raise RunConfigError(key, f"missing {key!r}")
        method = data["method"]
        if not isinstance(method, str):
            raise RunConfigError("method", f"method must be a string, got {type(method).__name__}")
        params = data.get("params", {})
        if not isinstance(params, dict):
            raise RunConfigError("params", f"params must be an object, got {type(params).__name__}")
        train = _section(TrainConfig(), "train", data["train"], source)
        dp = _section(DPConfig(), "dp", data["dp"], source) if data.get("dp") is not None else None
        if dp is not None and dp.enabled and train.clip_grad_norm:
            raise RunConfigError("dp", CLIP_WITH_DP)
        return cls(method=method, train=train, params=params, dp=dp,
                   secagg=_secagg(data["secagg"]) if "secagg" in data else None,
                   compress=_compress(data.get("compress", "")),
                   mode=_choice(data, "mode", ("sync", "async"), "sync"),
                   eval_detail=_choice(data, "eval_detail", (False, True), False),
                   version=version)


def _section(obj: Any, key: str, values: object, source: str) -> Any:
    """A [train] or [dp] section: known keys, their types, the section's own rules."""
    if not isinstance(values, dict):
        raise RunConfigError(key, f"{key} must be an object, got {type(values).__name__}")
    try:
        apply_values(obj, key, values, source)
        obj.validate()
    except ConfigError as err:
        raise RunConfigError(key, str(err)) from None
    return obj


def _secagg(values: object) -> SecAggPolicy:
    try:
        return SecAggPolicy.from_config(values)
    except (ValueError, TypeError) as err:  # TypeError: a key SecAggPolicy does not take
        raise RunConfigError("secagg", str(err)) from None


def _compress(text: object) -> CompressSpec:
    """The run's codecs; a codec not installed here is refused by name."""
    if not isinstance(text, str):
        raise RunConfigError("compress", f"compress must be a string, got {type(text).__name__}")
    try:
        return CompressSpec.parse(text)
    except ValueError as err:
        raise RunConfigError("compress", str(err)) from None


def _choice(data: dict, key: str, choices: tuple, default: Any) -> Any:
    value = data.get(key, default)
    if value not in choices or type(value) is not type(default):
        raise RunConfigError(key, f"{key} {shown(value)} is not one of "
                             f"{', '.join(json.dumps(c) for c in choices)}")
    return value
