"""Local-only training: everything private, nothing uploaded but the training report."""

from .base import Method


class LocalOnly(Method):
    name = "local"
    dp_support = True  # cross-entropy only; parameter-only terms are post_backward
    private_rules = ("all",)
