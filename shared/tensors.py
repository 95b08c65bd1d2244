"""Tensor memory helpers shared by the wire serializer and the methods' plumbing."""

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


def pack(tensors: list[torch.Tensor]) -> bool:
    """Moves ``tensors`` (parameters and buffers of one dtype on one device) into one
    storage, back to back in this order; each keeps its identity (its ``.data`` becomes a
    view), so optimizers and modules see no change. A download is then loaded, and an
    upload read, as one vector instead of hundreds of tensors. Tied tensors (one object
    under two names) are left as they are. Returns whether it packed them."""
    if (len(tensors) < 2 or len({id(t) for t in tensors}) != len(tensors)
            or len({(t.dtype, t.device) for t in tensors}) != 1):
        return False
    flat = torch.empty(sum(t.numel() for t in tensors), dtype=tensors[0].dtype,
                       device=tensors[0].device)
    offset = 0
    with torch.no_grad():
        for tensor in tensors:
            piece = flat[offset : offset + tensor.numel()].view(tensor.shape)
            piece.copy_(tensor)
            tensor.data = piece
            offset += tensor.numel()
    return True


class PackedTensors:
    """Named live tensors of a model (an edge's shared parameters and buffers), packed
    into one storage when they can be (``pack``), so that a whole download of them is
    loaded with one copy. The wire-performance plumbing of a method's edge half lives
    here; the method keeps only its math (as ``torch.optim.Optimizer`` owns its parameter
    groups and state and a subclass its ``step``)."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors
        live = list(tensors.values())
        # Names and shapes of the tensors when pack laid them out as one vector.
        self.layout = ((tuple(tensors), tuple(tuple(t.shape) for t in live))
                       if pack(live) else None)

    def load_vector(self, names: tuple[str, ...], shapes: tuple[tuple[int, ...], ...],
                    flat: torch.Tensor) -> bool:
        """Copy ``flat`` (the tensors ``names`` of ``shapes``, back to back) in one go when
        it is exactly these tensors in the order pack laid them out and they still lie
        that way; False (nothing copied) otherwise."""
        if self.layout != (names, shapes):
            return False
        run = contiguous_run(self.tensors.values())
        if run is None or run.numel() != flat.numel():
            return False
        with torch.no_grad():
            run.copy_(flat)
        return True

    def views(self) -> dict[str, torch.Tensor]:
        """The live tensors, detached (an upload that streams them as they are)."""
        return {name: tensor.detach() for name, tensor in self.tensors.items()}

    def clone(self) -> dict[str, torch.Tensor]:
        """A copy of their current values."""
        return {name: tensor.detach().clone() for name, tensor in self.tensors.items()}
