"""Backbones by name. ``build_model(name, ...)`` is the only entry point the daemons use;
a name is a built-in or a reference (models/reference.py: timm:, torchvision:, an entry
point, module:callable)."""

from .reference import available_models
from .registry import (
    MODELS,
    ModelSpec,
    build_model,
    check_model_allowed,
    model_spec,
    own_model_allowance,
)

__all__ = ["MODELS", "ModelSpec", "available_models", "build_model", "check_model_allowed",
           "model_spec", "own_model_allowance"]
