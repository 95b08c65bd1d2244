"""Readers for an edge's --data-dir."""

from .npz import DataError, EdgeData, load_edge_data

__all__ = ["DataError", "EdgeData", "load_edge_data"]
