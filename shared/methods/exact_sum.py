"""Exact, order-independent float64 sums of weighted tensors, in RAM or over spilled files.

``add_scaled`` keeps a sum and its TwoSum compensation, so the result does not depend on
the order the terms arrive in (a fixed seed gives the same global bit for bit);
``spilled_mean`` runs the same sum a slice of coordinates at a time over uploads a
streaming mean wrote to disk (``server.spill_sums``), so the server holds a slice's
buffers instead of a model-sized float64 pair through the round. Both are per-coordinate
operations in the same order: the same bits either way.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from ..schema import Kind
from .spill import UploadSpill

SectionKey = tuple[Kind, str]
# Where each spilled upload is: its file, its weight, and per section the byte offset in
# the file and the dtypes of its tensors (in the round's layout order).
Spilled = list[tuple[Path, float, dict[SectionKey, tuple[int, list[torch.dtype]]]]]

# Elements per step when a float32 (or other) vector is added into the float64 sum: a
# mixed-dtype add_ would first copy the whole operand to float64 (a model-sized buffer);
# in steps the copy is 2 MiB, and the sum runs faster than in one call.
SUM_STEP = 1 << 18
# Coordinates per slice when a spilled round's uploads are summed at its close: the
# float64 pair, the read buffer and add_scaled's scratch are ~11 MB at 2**19 (a quarter
# of ResNet-18), against ~8 ms of Python per slice and upload beyond the sums themselves.
SPILL_SLICE = 1 << 19


def add_scaled(total: torch.Tensor, values: torch.Tensor, weight: float,
               compensation: torch.Tensor | None = None) -> None:
    """``total += weight * values`` for a 1-D float64 ``total`` and any 1-D ``values`` of
    the same length, without a float64 copy of ``values``.

    With ``compensation`` (a float64 vector like ``total``) the sum is exact and so
    independent of the order of the additions: each product ``weight * value`` is rounded
    once (the same on every arrival order), then added by TwoSum (Knuth), which splits
    ``total + p`` into the rounded sum and its exact rounding error; the errors gather in
    ``compensation``. ``total + compensation`` is the exact sum of the products as long as
    the errors' own sum fits 53 bits: for one coordinate, the nonzero products of the
    round's edges within a factor of about 2**53 / edges**2 of each other (2**40 for 90
    edges; the test checks 1e-8..1e3 with weights up to 1e6). Beyond that the result can
    differ by one rounding of a 2**-106-relative error. ``finish_sum`` rounds the pair to
    the float64 nearest the exact sum."""
    if compensation is None:
        for start in range(0, values.numel(), SUM_STEP):
            total[start:start + SUM_STEP].add_(values[start:start + SUM_STEP], alpha=weight)
        return
    # Three step-sized scratch vectors, reused: fresh temporaries per step cost ~2.7x the
    # time (each a new allocation, page-faulted in) for the same bits.
    size = min(SUM_STEP, values.numel())
    p_buf, s_buf, b_buf = (torch.empty(size, dtype=torch.float64) for _ in range(3))
    for start in range(0, values.numel(), SUM_STEP):
        end = min(start + SUM_STEP, values.numel())
        hi, n = total[start:end], end - start
        p, s, b = p_buf[:n], s_buf[:n], b_buf[:n]
        p.copy_(values[start:end]).mul_(weight)  # the product, rounded once
        torch.add(hi, p, out=s)
        torch.sub(s, hi, out=b)                  # the part of p that reached s
        p.sub_(b)                                # p - b
        torch.sub(s, b, out=b)                   # s - b
        hi.sub_(b).add_(p)                       # (hi - (s - b)) + (p - b): the exact error
        compensation[start:end].add_(hi)
        hi.copy_(s)


def finish_sum(total: torch.Tensor, compensation: torch.Tensor | None) -> torch.Tensor:
    """The compensated pair as one float64 vector (in ``total``): IEEE addition rounds
    ``total + compensation`` correctly, so equal exact sums give equal bits."""
    if compensation is not None:
        total.add_(compensation)
    return total


def spilled_mean(spilled: Spilled, key: SectionKey,
                 layout: list[tuple[str, torch.dtype, tuple[int, ...]]],
                 total_weight: float) -> dict[str, torch.Tensor]:
    """The mean of section ``key`` over the spilled uploads: per slice of coordinates,
    each upload's values are read into one buffer and added (``add_scaled``, in arrival
    order) into a slice-sized float64 pair, whose mean goes into the new tensors (named
    and shaped by ``layout``). The same per-coordinate operations as the in-memory sum:
    the same bits."""
    sizes = [math.prod(shape) for _, _, shape in layout]
    size, dtypes = sum(sizes), {dtype for _, dtype, _ in layout}
    if len(dtypes) == 1:
        vector = torch.empty(size, dtype=dtypes.pop())
        outputs, tensors, start = [(0, vector)], {}, 0
        for (name, _, shape), n in zip(layout, sizes, strict=True):
            tensors[name] = vector[start : start + n].view(shape)
            start += n
    else:
        tensors = {name: torch.empty(shape, dtype=dtype) for name, dtype, shape in layout}
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        outputs = [(s, t.reshape(-1)) for s, t in zip(starts, tensors.values(), strict=True)]
    width = min(SPILL_SLICE, size)
    total, comp = torch.empty(width, dtype=torch.float64), torch.empty(width, dtype=torch.float64)
    raw = torch.empty(width * 8, dtype=torch.uint8)
    buffer = memoryview(raw.numpy())
    for begin in range(0, size, SPILL_SLICE):
        end = min(begin + SPILL_SLICE, size)
        hi, lo = total[: end - begin].zero_(), comp[: end - begin].zero_()
        for path, weight, sections in spilled:
            if key in sections:
                # Opened per read, not all at once: a round of thousands of uploads
                # would otherwise need as many descriptors (beyond a default 1024).
                fd = os.open(path, os.O_RDONLY)
                try:
                    _add_slice(fd, *sections[key], sizes, begin, end, weight,
                               (hi, lo, raw, buffer))
                finally:
                    os.close(fd)
        finish_sum(hi, lo).div_(total_weight)
        for start, out in outputs:
            a, b = max(begin, start), min(end, start + out.numel())
            if a < b:
                out[a - start : b - start].copy_(hi[a - begin : b - begin])
    return tensors


def _add_slice(fd: int, offset: int, dtypes: list[torch.dtype], sizes: list[int],
               begin: int, end: int, weight: float, scratch: tuple) -> None:
    """Adds coordinates [begin, end) of one spilled upload's section (at ``offset`` in
    ``fd``, its tensors of ``dtypes`` and ``sizes``) into the slice's pair: one read when
    the section is of one dtype, else one per tensor the slice overlaps."""
    hi, lo, raw, buffer = scratch
    if len(set(dtypes)) == 1:
        spans = [(0, sum(sizes), dtypes[0])]
    else:
        spans = [(sum(sizes[:i]), n, dtype)
                 for i, (n, dtype) in enumerate(zip(sizes, dtypes, strict=True))]
    at = offset
    for start, n, dtype in spans:
        width = torch.empty(0, dtype=dtype).element_size()
        a, b = max(begin, start), min(end, start + n)
        if a < b:
            nbytes = (b - a) * width
            UploadSpill.read_into(fd, at + (a - start) * width, buffer[:nbytes])
            add_scaled(hi[a - begin : b - begin], raw[:nbytes].view(dtype), weight,
                       lo[a - begin : b - begin])
        at += n * width


__all__ = ["SPILL_SLICE", "SUM_STEP", "add_scaled", "finish_sum", "spilled_mean"]
