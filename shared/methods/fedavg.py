"""FedAvg (McMahan et al., 2017): every shared tensor averaged with weights n_k."""

from .base import Method


class FedAvg(Method):
    name = "fedavg"
    dp_support = True  # cross-entropy only; parameter-only terms are post_backward
