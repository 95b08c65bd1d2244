"""Local-only training: everything private, nothing uploaded but the training report."""

from .base import Method


class LocalOnly(Method):
    name = "local"
    private_rules = ("all",)
