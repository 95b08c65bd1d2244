"""Backbones by name. ``build_model(name, ...)`` is the only entry point the daemons use."""

from .registry import MODELS, ModelSpec, build_model, model_spec

__all__ = ["MODELS", "ModelSpec", "build_model", "model_spec"]
