"""Exact, order-independent float64 sums of weighted tensors, in RAM or over spilled files.

``add_scaled`` keeps a sum and its TwoSum compensation, so the result does not depend on
the order the terms arrive in (a fixed seed gives the same global bit for bit);
``spilled_mean`` runs the same sum a slice of coordinates at a time over uploads a
streaming mean wrote to disk (``server.spill_sums``), so the server holds a slice's
buffers instead of a model-sized float64 pair through the round. Both run ``two_sum``,
per coordinate in arrival order: the same bits either way (a slice's first upload goes
through ``first_term``, ``two_sum`` from a zero pair in one pass instead of eight). The
close is on the round's critical path (the edges wait for the next task), so its slices,
independent of each other, are summed on several threads. On model-sized vectors, with
numba installed, ``two_sum``'s eight passes run as one compiled loop
(``kernels``/``_compiled.pair_add``): the same operations, the same bits, ~4x less CPU.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from ..kernels import compiled
from ..schema import Kind
from .spill import UploadSpill

SectionKey = tuple[Kind, str]
# Dtypes ``two_sum`` reads through NumPy; others (bfloat16) are cast by torch first.
_NUMPY_NATIVE = frozenset({torch.float64, torch.float32, torch.float16, torch.int64,
                           torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool})
# Dtypes the compiled ``pair_add`` reads itself (cast to float64 exactly); others become
# float64 products first (``first_term``), which it adds with weight 1 (exactly).
_COMPILED_NATIVE = frozenset({torch.float32, torch.float64})
# Where each spilled upload is: its file, its weight, and per section the byte offset in
# the file and the dtypes of its tensors (in the round's layout order).
Spilled = list[tuple[Path, float, dict[SectionKey, tuple[int, list[torch.dtype]]]]]

# Elements per step when a float32 (or other) vector is added into the float64 sum: a
# mixed-dtype add_ would first copy the whole operand to float64 (a model-sized buffer);
# in steps the copy is 2 MiB, and the sum runs faster than in one call.
SUM_STEP = 1 << 18
# Coordinates per slice when a spilled round's uploads are summed at its close: a
# worker's five float64 vectors and read buffer are 6 MiB at 2**17, and its passes over
# them run from the core's cache; at 2**19 (24 MiB) they ran from memory and the close
# took ~1.4x the CPU; below 2**17 the Python per slice and upload (~15 torch calls)
# costs more than the cache saves.
SPILL_SLICE = 1 << 17
# At most this many threads sum a spilled close's slices, each with its own buffers.
MAX_SUM_WORKERS = 4


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
    loops = compiled(values.numel())
    if loops is not None and values.dtype in _COMPILED_NATIVE:  # one pass, no scratch
        loops.pair_add(total.numpy(), compensation.numpy(), values.detach().numpy(), weight)
        return
    # Three step-sized scratch vectors, reused: fresh temporaries per step cost ~2.7x the
    # time (each a new allocation, page-faulted in) for the same bits.
    size = min(SUM_STEP, values.numel())
    p_buf, s_buf, b_buf = (torch.empty(size, dtype=torch.float64) for _ in range(3))
    for start in range(0, values.numel(), SUM_STEP):
        end = min(start + SUM_STEP, values.numel())
        hi, n = total[start:end], end - start
        two_sum(hi, values[start:end], weight, compensation[start:end], s_buf[:n], p_buf[:n],
                b_buf[:n])
        hi.copy_(s_buf[:n])


def two_sum(hi: torch.Tensor, values: torch.Tensor, weight: float, lo: torch.Tensor,
            s: torch.Tensor, p: torch.Tensor, b: torch.Tensor) -> None:
    """One compensated addition of ``weight * values`` into the pair (``hi``, ``lo``),
    element by element: the rounded sum goes into ``s``, its exact error into ``lo``, and
    ``hi`` is left as scratch (the caller copies ``s`` back, or takes ``s`` as the next
    ``hi``). ``p`` and ``b`` are scratch; all float64 CPU vectors of ``values``' length.
    The one definition of the sum's arithmetic: every exact sum here runs these
    operations, so they give the same bits.

    NumPy's ufuncs, not torch's: the same IEEE operations (no fused multiply-add), at
    about a microsecond per call instead of several, and the product's float64 cast is
    done by the multiply in cache-sized blocks instead of as a pass of its own: the
    whole addition costs ~0.65x the torch calls' CPU (bench/exact_sum.py)."""
    hi_, lo_, s_, p_, b_ = hi.numpy(), lo.numpy(), s.numpy(), p.numpy(), b.numpy()
    first_term(p, values, weight)          # the product, rounded once
    np.add(hi_, p_, out=s_)
    np.subtract(s_, hi_, out=b_)           # the part of p that reached s
    np.subtract(p_, b_, out=p_)            # p - b
    np.subtract(s_, b_, out=b_)            # s - b
    np.subtract(hi_, b_, out=hi_)
    np.add(hi_, p_, out=hi_)               # (hi - (s - b)) + (p - b): the exact error
    np.add(lo_, hi_, out=lo_)


def first_term(out: torch.Tensor, values: torch.Tensor, weight: float) -> None:
    """``two_sum`` of ``weight * values`` into a pair that is still (+0, +0), in one pass
    instead of eight, to the same final bits: the sum is the product ``p`` (``two_sum``
    has ``0 + p``, which differs only as -0.0 against +0.0; the finish's ``hi + lo``, with
    ``lo`` +0.0 or nonzero, never -0.0, makes both the same), and the error, so ``lo``,
    stays +0.0 for every finite product (an upload's finite value times a weight is:
    float32's largest times 1e6 is far inside float64). Writes the sum into ``out``. The
    one definition of the product: ``two_sum`` takes its ``p`` from here."""
    if values.dtype in _NUMPY_NATIVE:
        np.multiply(values.detach().numpy(), weight, out=out.numpy(), dtype=np.float64)
    else:  # bfloat16 has no NumPy type: torch casts it
        out.copy_(values)
        np.multiply(out.numpy(), weight, out=out.numpy())


def finish_sum(total: torch.Tensor, compensation: torch.Tensor | None) -> torch.Tensor:
    """The compensated pair as one float64 vector (in ``total``): IEEE addition rounds
    ``total + compensation`` correctly, so equal exact sums give equal bits."""
    if compensation is not None:
        total.add_(compensation)
    return total


def sum_workers() -> int:
    """Threads a spilled close sums its slices on: the cores this process may run on, at
    most ``MAX_SUM_WORKERS``. The slices are independent and torch's kernels release the
    GIL, so the close (on the round's critical path: the edges wait for the next task)
    takes the cores the waiting edges leave idle."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    return max(1, min(MAX_SUM_WORKERS, cores))


class _SliceSum:
    """One worker's buffers for summing a slice of coordinates over the spilled uploads:
    the compensated pair, a second ``hi`` the sum alternates with (``two_sum`` writes the
    new sum there, so no copy back), the read buffer and ``two_sum``'s scratch."""

    def __init__(self, width: int, size: int):
        """``width``: the widest slice; ``size``: the coordinates of the whole sum, which
        decide whether the compiled loop runs (``kernels.compiled``)."""
        self.hi, self.spare, self.lo, self.p, self.b = (
            torch.empty(width, dtype=torch.float64) for _ in range(5))
        self.raw = torch.empty(width * 8, dtype=torch.uint8)
        self.buffer = memoryview(self.raw.numpy())
        self.loops = compiled(size)

    def run(self, spilled: Spilled, key: SectionKey, sizes: list[int], begin: int, end: int
            ) -> torch.Tensor:
        """The exact sum of coordinates [begin, end) over the uploads, in arrival order,
        as one float64 vector (a view of this worker's buffers, valid until its next
        slice)."""
        n = end - begin
        hi, spare, lo = self.hi[:n], self.spare[:n], self.lo[:n].zero_()
        first = True  # the first upload's runs go into the zero pair (``first_term``)
        for path, weight, sections in spilled:
            if key not in sections:
                continue
            offset, dtypes = sections[key]
            # Opened per read, not all at once: a round of thousands of uploads would
            # otherwise need as many descriptors (beyond a default 1024).
            fd = os.open(path, os.O_RDONLY)
            try:
                for a, b, values in self._read(fd, offset, dtypes, sizes, begin, end):
                    if first:  # every coordinate of the slice, once: hi is written whole
                        first_term(hi[a:b], values, weight)
                        continue
                    if self.loops is not None:  # in place: hi stays the sum
                        self._add_compiled(hi[a:b], lo[a:b], values, weight)
                        continue
                    two_sum(hi[a:b], values, weight, lo[a:b], spare[a:b], self.p[: b - a],
                            self.b[: b - a])
                    if (a, b) == (0, n):
                        hi, spare = spare, hi
                    else:  # part of the slice: the rest of ``hi`` is still the sum
                        hi[a:b].copy_(spare[a:b])
            finally:
                os.close(fd)
            first = False
        if first:  # no upload holds the section
            hi.zero_()
        return finish_sum(hi, lo)

    def _add_compiled(self, hi: torch.Tensor, lo: torch.Tensor, values: torch.Tensor,
                      weight: float) -> None:
        """``two_sum`` as the compiled loop, in place. Dtypes it does not read itself
        (bfloat16, float16, integers) become float64 products first (``first_term``, the
        same rounding), added with weight 1 (exactly)."""
        if values.dtype not in _COMPILED_NATIVE:
            first_term(self.p[: values.numel()], values, weight)
            values, weight = self.p[: values.numel()], 1.0
        self.loops.pair_add(hi.numpy(), lo.numpy(), values.numpy(), weight)

    def _read(self, fd: int, offset: int, dtypes: list[torch.dtype], sizes: list[int],
              begin: int, end: int) -> Iterator[tuple[int, int, torch.Tensor]]:
        """Coordinates [begin, end) of one spilled upload's section (at ``offset`` in
        ``fd``, its tensors of ``dtypes`` and ``sizes``) as (start, end within the slice,
        values) runs, each read into the read buffer when the one before is spent: one
        read when the section is of one dtype, else one per tensor the slice overlaps."""
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
                UploadSpill.read_into(fd, at + (a - start) * width, self.buffer[:nbytes])
                yield a - begin, b - begin, self.raw[:nbytes].view(dtype)
            at += n * width


def spilled_mean(spilled: Spilled, key: SectionKey,
                 layout: list[tuple[str, torch.dtype, tuple[int, ...]]],
                 total_weight: float, workers: int | None = None) -> dict[str, torch.Tensor]:
    """The mean of section ``key`` over the spilled uploads: per slice of coordinates,
    each upload's values are read into one buffer and added (``two_sum``, in arrival
    order) into a slice-sized float64 pair, whose mean goes into the new tensors (named
    and shaped by ``layout``). The same per-coordinate operations as the in-memory sum:
    the same bits. Slices are independent: ``workers`` threads (``sum_workers()`` when
    None) take every ``workers``-th slice each, with their own buffers."""
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
    begins = list(range(0, size, SPILL_SLICE))
    count = max(1, min(workers or sum_workers(), len(begins)))

    def work(first: int) -> None:
        worker = _SliceSum(min(SPILL_SLICE, size), size)
        for begin in begins[first::count]:
            end = min(begin + SPILL_SLICE, size)
            mean = worker.run(spilled, key, sizes, begin, end).div_(total_weight)
            for start, out in outputs:  # each worker writes its own coordinates
                a, b = max(begin, start), min(end, start + out.numel())
                if a < b:
                    out[a - start : b - start].copy_(mean[a - begin : b - begin])

    if count == 1 or size == 0:
        work(0)
    else:
        with ThreadPoolExecutor(count, thread_name_prefix="spilled-sum") as pool:
            for done in [pool.submit(work, i) for i in range(count)]:
                done.result()  # a worker's failure (a short file) fails the close
    return tensors


__all__ = ["MAX_SUM_WORKERS", "SPILL_SLICE", "SUM_STEP", "add_scaled", "finish_sum", "first_term",
           "spilled_mean", "sum_workers", "two_sum"]
