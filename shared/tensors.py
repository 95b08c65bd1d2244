"""Tensor memory helpers shared by the wire codec and the methods' plumbing."""

from __future__ import annotations

from collections.abc import Iterable

import torch


def contiguous_run(tensors: Iterable[torch.Tensor]) -> torch.Tensor | None:
    """A 1-D view spanning ``tensors`` when they lie back to back, in this order, in one
    storage (one dtype, each contiguous); None otherwise. Such tensors are read or written
    as one (an edge keeps its shared parameters that way; a mean's tensors are views of
    one vector). About 1 us a tensor: four attribute reads each, no more."""
    first: torch.Tensor | None = None
    dtype = None
    end = 0
    for tensor in tensors:
        if dtype is None:
            dtype = tensor.dtype
        elif tensor.dtype is not dtype:
            return None
        nbytes = tensor.nbytes
        if not nbytes:
            continue
        if first is None:
            first, end = tensor, tensor.data_ptr()
        if tensor.data_ptr() != end or not tensor.is_contiguous():
            return None
        end += nbytes
    if first is None:
        return None
    storage = first.untyped_storage()
    # The chain must stay inside the first tensor's storage: it could otherwise run on
    # into a neighbouring allocation (another storage, or another device's memory).
    if end > storage.data_ptr() + storage.nbytes():
        return None
    return torch.empty(0, dtype=first.dtype, device=first.device).set_(
        storage, first.storage_offset(), ((end - first.data_ptr()) // first.element_size(),),
        (1,))
