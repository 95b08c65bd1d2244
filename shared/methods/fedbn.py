"""FedBN (Li et al., 2021): BatchNorm parameters and running statistics stay local."""

from .base import Method


class FedBN(Method):
    name = "fedbn"
    private_rules = ("bn",)

    def dp_refusal(self) -> str:
        """FedBN is its BatchNorm layers kept local, and DP-SGD needs every BatchNorm gone
        (batch statistics mix samples): after ``--dp-fix-model`` or on a GroupNorm model
        FedBN's rule selects nothing, so the two never combine."""
        return ("method 'fedbn' keeps BatchNorm layers private, and DP-SGD needs every "
                "BatchNorm replaced by GroupNorm, after which FedBN is FedAvg: use fedavg "
                "(or another method) under --dp")
