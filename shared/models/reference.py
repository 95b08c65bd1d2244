"""Models by reference: any timm or torchvision model by name, a ``fedattn.models`` entry
point, or a ``package.module:callable`` of the user's, wherever a built-in name is taken.

    timm:NAME              timm.create_model(NAME, pretrained=False, num_classes, in_chans)
    torchvision:NAME       torchvision.models.get_model(NAME, weights=None, num_classes)
    NAME                   a ``fedattn.models`` entry point installed here (as methods are)
    package.module:attr    the user's builder; imported only where its operator allows it

Each form takes the run's (num_classes, in_channels, image_size) and, like the built-ins,
builds with random initialisation: nothing is downloaded, ever. What the registry knows of a
built-in model (its head, attention sites, token reader) is found for a referenced one by
inspection where that is sound (timm's ``pretrained_cfg['classifier']`` and
``forward_features``; else the last Linear whose outputs are the classes) and otherwise
declared by the plug-in: a ``ModelSpec`` instead of a bare callable, or attributes on the
callable (``build.head``, ``build.attention_sites``, ``build.tokens``,
``build.se_reduction``). A method that needs what a model lacks refuses at start naming
what to declare (``DECLARE``).

``parse_reference`` is the one parse of a model name and ``check_model_allowed`` the edge's
one check of it (``fedattn_shared.allowlist``, shared with methods): both read the string
only, so a module an edge did not allow is never imported.
"""

from __future__ import annotations

import functools
import importlib
import re
from collections.abc import Callable, Collection
from dataclasses import dataclass
from importlib.metadata import entry_points

import torch
from torch import nn

from ..allowlist import MODULE_SPEC, check_module_spec_allowed, shown

GROUP = "fedattn.models"
LIBRARIES = ("timm", "torchvision")
# A library's model name: identifiers, with timm's ``.tag`` (a pretrained tag: with
# pretrained=False it names the same architecture).
LIBRARY_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)?", re.ASCII)
# The probe a referenced model is inspected on (meta device: shapes and types only): a
# class count no layer but the head is likely to have, so that the head is the Linear
# whose outputs are the classes.
PROBE_CLASSES, PROBE_CHANNELS, PROBE_SIZE = 11, 3, 32
# What a plug-in declares, for the refusals of methods that need it.
DECLARE = ("declare them with a ModelSpec(..., {what}) as the model's entry point or "
           "module:attr, or as build.{what} on its builder (docs/your-model-and-data.md)")


@dataclass(frozen=True)
class ModelReference:
    """A model name as parsed: ``kind`` is "builtin", "timm", "torchvision", "entry" (a
    ``fedattn.models`` entry point) or "module"; ``target`` what that kind looks up."""

    kind: str
    target: str

    @property
    def is_reference(self) -> bool:
        return self.kind != "builtin"


def parse_reference(name: object, builtins: Collection[str]) -> ModelReference:
    """The one parse of a model name (without its ``+gn`` suffix), from the string alone:
    ValueError, naming the forms, for anything else."""
    if not isinstance(name, str):
        raise ValueError(f"model must be a string, got {type(name).__name__}")
    library, colon, rest = name.partition(":")
    if colon and library in LIBRARIES:
        if not LIBRARY_NAME.fullmatch(rest):
            raise ValueError(f"model {shown(name)}: {library}:NAME takes a {library} model "
                             "name (letters, digits, _)")
        return ModelReference(library, rest)
    if colon:
        if not MODULE_SPEC.fullmatch(name):
            raise ValueError(f"model {shown(name)}: expected a built-in name, timm:NAME, "
                             "torchvision:NAME, an installed fedattn.models name or "
                             "package.module:callable")
        return ModelReference("module", name)
    if name in builtins:
        return ModelReference("builtin", name)
    return ModelReference("entry", name)


def available_models() -> list[str]:
    """The ``fedattn.models`` entry points installed here (reading metadata imports nothing)."""
    return sorted(ep.name for ep in entry_points(group=GROUP))


def check_model_allowed(name: str, builtins: Collection[str],
                        allowed_specs: Collection[str] = ()) -> None:
    """The edge's rule for a model its server names, before anything is imported: a
    built-in, a timm or torchvision name, an installed ``fedattn.models`` entry point, or a
    ``module:callable`` listed in ``allowed_specs`` (``--allow-model``). ValueError names
    the way in."""
    ref = parse_reference(name, builtins)
    if ref.kind == "module":
        check_module_spec_allowed("model", name, allowed_specs, "--allow-model", available_models,
                                  attr="callable")
    elif ref.kind == "entry" and name not in available_models():
        known = sorted(builtins) + available_models()
        raise ValueError(f"unknown model {shown(name)} (known: {', '.join(known)}; timm:NAME, "
                         "torchvision:NAME; package.module:callable)")


# ---- resolution ------------------------------------------------------------------------
def timm_builder(name: str) -> Callable[[int, int, int], nn.Module]:
    def build(num_classes: int, in_channels: int, image_size: int) -> nn.Module:
        import timm  # imported lazily: heavy, and only these models need it

        return timm.create_model(name, pretrained=False, num_classes=num_classes,
                                 in_chans=in_channels)

    return build


def torchvision_builder(name: str) -> Callable[[int, int, int], nn.Module]:
    def build(num_classes: int, in_channels: int, image_size: int) -> nn.Module:
        from torchvision import models

        model = models.get_model(name, weights=None, num_classes=num_classes)
        if in_channels != 3:
            first_conv(model, name, in_channels)
        return model

    return build


def first_conv(model: nn.Module, name: str, in_channels: int) -> None:
    """Replace the model's first 3-channel Conv2d by one of ``in_channels`` (same shape
    otherwise): torchvision's classifiers take RGB only."""
    for path, module in model.named_modules():
        if isinstance(module, nn.Conv2d) and module.in_channels == 3:
            parent, _, leaf = path.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, leaf, nn.Conv2d(
                in_channels, module.out_channels, module.kernel_size, module.stride,
                module.padding, module.dilation, module.groups, module.bias is not None))
            return
    raise ValueError(f"model 'torchvision:{name}': no 3-channel Conv2d to take "
                     f"{in_channels} input channels")


def resolve_reference(name: str, ref: ModelReference, spec_type: type):
    """The ModelSpec of a referenced model (its build, head, sites, tokens). The caller has
    checked the name (``check_model_allowed``) wherever the choice was not its own."""
    if ref.kind == "timm":
        return _timm_spec(name, ref.target, spec_type)
    if ref.kind == "torchvision":
        return _torchvision_spec(name, ref.target, spec_type)
    return _plugin_spec(name, _load_plugin(name, ref), spec_type)


@functools.lru_cache(maxsize=64)  # a pure function of the installed libraries
def _timm_spec(name: str, target: str, spec_type: type):
    try:
        import timm
    except ImportError:
        raise ValueError(f"model {name!r}: timm is not installed here "
                         "(pip install timm)") from None
    if not timm.is_model(target):
        raise ValueError(f"model {name!r}: timm has no model {target!r} (timm.list_models())")
    build = timm_builder(target)
    with torch.device("meta"):
        probe = build(PROBE_CLASSES, PROBE_CHANNELS, PROBE_SIZE)
    classifier = probe.pretrained_cfg.get("classifier") or last_linear(probe, PROBE_CLASSES)
    if isinstance(classifier, (tuple, list)):  # distilled heads: the first is the class head
        classifier = classifier[0]
    tokens = timm_tokens if _reads_tokens(probe, classifier) else None
    return spec_type(name, build, classifier, f"timm {target} (random init)", tokens=tokens)


@functools.lru_cache(maxsize=64)
def _torchvision_spec(name: str, target: str, spec_type: type):
    from torchvision import models

    if target not in models.list_models(module=models):
        raise ValueError(f"model {name!r}: torchvision has no classification model {target!r} "
                         "(torchvision.models.list_models(module=torchvision.models))")
    build = torchvision_builder(target)
    with torch.device("meta"):
        probe = build(PROBE_CLASSES, PROBE_CHANNELS, PROBE_SIZE)
    return spec_type(name, build, last_linear(probe, PROBE_CLASSES),
                     f"torchvision {target} (weights=None)")


def _load_plugin(name: str, ref: ModelReference) -> object:
    if ref.kind == "module":
        module_name, _, attr = name.partition(":")
        try:
            return getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as err:
            raise ValueError(f"cannot load model {name!r}: {err}") from None
    matches = [ep for ep in entry_points(group=GROUP) if ep.name == name]
    if not matches:
        raise ValueError(f"unknown model {shown(name)}: no built-in or installed fedattn.models "
                         f"entry point of that name (fl-server --help lists the built-ins; "
                         f"installed: {', '.join(available_models()) or '(none)'}; or timm:NAME, "
                         "torchvision:NAME, package.module:callable)")
    return matches[0].load()


def _plugin_spec(name: str, found: object, spec_type: type):
    """A plug-in's declarations: a ModelSpec as it stands (an empty head is inspected), or
    a bare builder with optional ``head``/``attention_sites``/``tokens``/``se_reduction``."""
    if isinstance(found, spec_type):
        build, declared = found.build, {"head": found.head, "attention_sites": found.attention_sites,
                                        "tokens": found.tokens, "se_reduction": found.se_reduction}
        description = found.description
    elif callable(found):
        build = found
        declared = {key: getattr(found, key) for key in ("head", "attention_sites", "tokens",
                                                          "se_reduction") if hasattr(found, key)}
        description = (getattr(found, "__doc__", None) or name).strip().splitlines()[0]
    else:
        raise ValueError(f"model {name!r} is a {type(found).__name__}, not a ModelSpec or a "
                         "callable (num_classes, in_channels, image_size) -> nn.Module")
    if not declared.get("head"):
        with torch.device("meta"):
            probe = build(PROBE_CLASSES, PROBE_CHANNELS, PROBE_SIZE)
        if not isinstance(probe, nn.Module):
            raise ValueError(f"model {name!r}: its builder returned a {type(probe).__name__}, "
                             "not an nn.Module")
        declared["head"] = last_linear(probe, PROBE_CLASSES)
    declared = {k: v for k, v in declared.items() if v is not None}
    return spec_type(name, build, description=description, **declared)


def last_linear(model: nn.Module, num_classes: int) -> str:
    """The state-dict prefix of the last Linear whose outputs are the classes, "" if none
    (the rules and methods that need a head then refuse naming what to declare)."""
    heads = [path for path, m in model.named_modules()
             if isinstance(m, nn.Linear) and m.out_features == num_classes]
    return heads[-1] if heads else ""


def _reads_tokens(model: nn.Module, head: str) -> bool:
    """Whether ``timm_tokens`` fits: the model has ``forward_features`` and its head is a
    Linear (pFedKA applies it to the tokens' mean)."""
    try:
        return hasattr(model, "forward_features") and isinstance(model.get_submodule(head), nn.Linear)
    except AttributeError:
        return False


def timm_tokens(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """(B, N, d) tokens of a timm model: ``forward_features``, a feature map's positions
    as tokens (B, C, H, W) -> (B, H*W, C), a transformer's sequence as it is."""
    features = model.forward_features(x)
    return features.flatten(2).transpose(1, 2) if features.dim() == 4 else features
