"""FedPer (Arivazhagan et al., 2019): the classifier head stays local."""

from .base import Method


class FedPer(Method):
    name = "fedper"
    dp_support = True  # cross-entropy only; parameter-only terms are post_backward
    private_rules = ("head",)
