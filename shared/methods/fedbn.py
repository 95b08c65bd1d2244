"""FedBN (Li et al., 2021): BatchNorm parameters and running statistics stay local."""

from .base import Method


class FedBN(Method):
    name = "fedbn"
    private_rules = ("bn",)
