"""The device's own memory limits in training: at most so many samples per forward and
backward pass, and halving that on an out-of-memory error instead of crashing.

Why: an edge that runs out of memory (CUDA, or a CPU allocator under a container's limit)
and exits is restarted by its supervisor into the same out-of-memory error, for ever. The
loop (``fl_edge.trainer``) instead splits a batch into micro-batches of at most ``limit``
samples; the gradient of their shares is the batch's mean gradient (plain steps: each
micro-batch's mean loss weighted by its share of the batch; DP-SGD: each sample's
gradient is clipped alone, so the clipped sum is the same however the batch is split). The
maths is the same, the float summation order is not: a split run matches the unsplit one to
rounding (and BatchNorm's batch statistics are per micro-batch), and matches bit for bit a
run that started with the same limit -- for models without BatchNorm running statistics or
dropout: a pass that fails half-way has already moved the running statistics of the layers
it got through, and its retry draws new dropout masks. The limit lives as long as the edge's run: a device
that learned it once does not run out again every round.
"""

from __future__ import annotations

import gc
import logging
import math

import torch

log = logging.getLogger("fl_edge.memory")

#: What the CPU allocator says when it cannot allocate (c10's DefaultCPUAllocator raises a
#: plain RuntimeError, not torch.OutOfMemoryError).
CPU_OOM_TEXT = ("can't allocate memory", "not enough memory")


class DeviceMemoryError(RuntimeError):
    """A single sample does not fit in the device's memory: backing off cannot help."""


def out_of_memory(err: BaseException) -> bool:
    """Whether ``err`` is an allocator's out-of-memory error (CUDA's or the CPU's)."""
    if isinstance(err, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(err, RuntimeError) and any(t in str(err) for t in CPU_OOM_TEXT)


def micro_batches(n: int, limit: int | None, start: int = 0) -> list[slice]:
    """Samples ``start..n`` in ceil(rest / limit) near-equal consecutive slices (numpy's
    ``array_split``, as Opacus splits its physical batches), or one slice without a limit."""
    rest = n - start
    if limit is None or rest <= limit:
        return [slice(start, n)]
    parts = math.ceil(rest / limit)
    size, extra = divmod(rest, parts)
    bounds = [start]
    for i in range(parts):
        bounds.append(bounds[-1] + size + (i < extra))
    return [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


class MemoryBackoff:
    """The samples one forward/backward pass may hold on this device: ``limit`` (None: a
    whole batch) from ``fl-edge --max-physical-batch``, halved on each out-of-memory error."""

    def __init__(self, limit: int | None = None):
        if limit is not None and limit < 1:
            raise ValueError(f"--max-physical-batch must be >= 1, got {limit}")
        self.limit = limit
        self.backoffs = 0

    def shrink(self, batch: int, device: torch.device) -> None:
        """After an out-of-memory error on a pass over ``batch`` samples: half of what was
        tried, or ``DeviceMemoryError`` when one sample was already too many. The
        allocator's cache is emptied so the retry finds the memory the failed pass held."""
        tried = min(self.limit or batch, batch)
        if tried <= 1:
            raise DeviceMemoryError(f"out of memory on {device} with one sample per pass: "
                                    "the model does not fit this device")
        self.limit = tried // 2
        self.backoffs += 1
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        log.warning("out of memory on %s with %d samples per pass: retrying the step with at "
                    "most %d (kept for the rest of the run)", device, tried, self.limit)
