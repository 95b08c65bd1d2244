"""ANFR (Siomos et al.): an architecture, not an aggregation rule. ``--method anfr`` is
FedAvg over an ANFR model (the whole model shared, weights n_k / N,
as in the paper's FedAvg runs); every
other aggregator runs ANFR by naming the model (``--method scaffold --model anfr-se-50``).

Its default model is ``anfr-se-compact`` (CPU-sized: compact depth and width); the paper's
networks are ``anfr-se-50``, ``anfr-eca-50`` and ``anfr-cbam-50``. A model that is not an
ANFR network (weight-standardised convolutions plus channel attention) is refused: run it
under ``fedavg`` instead.
"""

from __future__ import annotations

from .base import Method, MethodContext
from .split import attention_types


def is_anfr(model) -> bool:
    """Weight-standardised convolutions (timm's StdConv2d family) and channel attention."""
    from timm.layers import ScaledStdConv2d, StdConv2d

    modules = list(model.modules())
    return (any(isinstance(m, (ScaledStdConv2d, StdConv2d)) for m in modules)
            and any(isinstance(m, attention_types()) for m in modules))


class ANFR(Method):
    name = "anfr"
    dp_support = True  # cross-entropy only; parameter-only terms are post_backward
    default_model = "anfr-se-compact"

    def __init__(self, context: MethodContext):
        super().__init__(context)
        if not is_anfr(self.probe_model()):
            raise ValueError(f"anfr: model {self.train.model!r} is not an ANFR network "
                             "(weight-standardised convolutions with channel attention: "
                             "anfr-se-*, anfr-eca-*, anfr-cbam-*); use --method fedavg for it")
