"""Readers for an edge's --data-dir (formats and their detection order: ``readers.py``)."""

from .npz import DataError, EdgeData
from .readers import load_edge_data

__all__ = ["DataError", "EdgeData", "load_edge_data"]
