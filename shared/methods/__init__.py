"""Federated methods: one module per method, found through the ``fedattn.methods``
entry-point group so that a third party can add one as a plug-in."""

from ..schema import PhasePrivacy, SectionSpec, TensorSpec
from .aggregators import AggregatorKind
from .base import EdgeAlgorithm, LoopSchedule, Method, MethodContext, MethodSpec
from .registry import MODULE_SPEC, available_methods, check_method_allowed, load_method

__all__ = [
    "AggregatorKind", "EdgeAlgorithm", "LoopSchedule", "Method", "MethodContext", "MethodSpec",
    "PhasePrivacy", "SectionSpec", "TensorSpec",
    "MODULE_SPEC", "available_methods", "check_method_allowed", "load_method",
]
