"""FedPer (Arivazhagan et al., 2019): the classifier head stays local."""

from .base import Method


class FedPer(Method):
    name = "fedper"
    private_rules = ("head",)
