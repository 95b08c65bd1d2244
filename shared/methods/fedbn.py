"""FedBN (Li et al., 2021): BatchNorm parameters and running statistics stay local."""

from .base import Method


class FedBN(Method):
    name = "fedbn"
    dp_support = True  # cross-entropy only; parameter-only terms are post_backward
    private_rules = ("bn",)
