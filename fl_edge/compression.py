"""Update compression on the edge (``server.compress``, issue #26): one middleware.

Outside SecAgg and DP (``edge_middleware``): DP noises first, and compressing what DP
released is post-processing, so the guarantee holds; a masked upload reaches this layer as
SECAGG sections, which it sends as they are (SecAgg codes at the codec's width itself).

Downlink: the layer holds the reference R the server codes its deltas against
(``EdgeReference``): a whole common downlink replaces it, a delta moves it, a cached id
returns it, and the inner layers and the handler see R, never a delta. The global kept on
disk for export and predict is R.

Uplink: after the handler, each upload section is coded by the method's rule for its
kind (``Method.compression``), the model sections as their change against R; the
randomness (stochastic rounding) comes from the task's seed, so a seeded run is
bit-identical. With error feedback (``+ef``) the residual of every (phase, kind, section)
is private state, written behind the upload with the rest (``feedback.safetensors``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import torch

from fedattn_shared.compress.apply import EdgeReference, UplinkCompression
from fedattn_shared.state import StateError
from fedattn_shared.wire.payload import WireError
from fedattn_shared.wire.serialize import encode

from .options import EdgeExit
from .run import EdgeRun
from .secagg import is_secagg_phase
from .store import PrivateStore
from .tasks import Handler, Result, Task
from .writer import StateWriter

log = logging.getLogger("fl_edge")


class Compression:
    """The run's codecs around every task (see the module doc); with no ``compress`` it
    only refuses a downlink delta (which a server of such a run never sends)."""

    def __init__(self, run: EdgeRun, store: PrivateStore, writer: StateWriter):
        spec = run.compress
        self.store, self.writer, self.fingerprint = store, writer, run.fingerprint
        self.up = (UplinkCompression(run.method, run.algo.models, spec.up,
                                     changes=run.asynchronous)
                   if spec.up is not None else None)
        self.down = EdgeReference(spec.down) if spec.down is not None else None
        self.feedback = spec.up is not None and spec.up.feedback
        try:
            self.residuals: dict[str, torch.Tensor] = (
                store.load_feedback(run.fingerprint) if self.feedback else {})
        except StateError as err:
            raise EdgeExit(2, str(err)) from None

    def __call__(self, task: Task, next: Handler) -> Result:
        # CPU time of this thread (the edge's torch runs --threads 1 by default): what
        # coding costs the device, reported as ``compress_seconds`` with the result.
        started = time.thread_time()
        task = self._downlink(task)
        spent = time.thread_time() - started
        result = next(task)
        if self.up is None or is_secagg_phase(task.phase) or not result.upload.sections:
            return self._timed(result, spent) if self.down is not None else result
        started = time.thread_time()
        generator = torch.Generator().manual_seed(task.seed)
        upload, coded = self.up.encode(task.phase, result.upload, task.common, generator,
                                       self.residuals if self.feedback else None)
        result = self._timed(result, spent + time.thread_time() - started)
        saves = list(result.saves)
        if self.feedback:
            # A snapshot: each residual is a new tensor per round, never written into.
            saves.append((self.store.save_feedback, dict(self.residuals), self.fingerprint,
                          task.round))
        return replace(result, upload=upload, coded=coded, saves=saves)

    @staticmethod
    def _timed(result: Result, seconds: float) -> Result:
        """The result with ``compress_seconds`` (a figure of the work, not of the data: it
        may leave under DP and SecAgg, which run inside this layer)."""
        return replace(result, metrics={**result.metrics, "compress_seconds": seconds})

    def _downlink(self, task: Task) -> Task:
        """The task with R as its common downlink (a delta applied)."""
        header = task.header
        if self.down is None:
            if header.common_base_id:
                raise WireError("a compressed downlink delta in a run without down= "
                                "compression")
            return task
        reference, moved = self.down.receive(header.common_id, header.common_base_id,
                                             task.common)
        if moved:
            # What arrived was D: the global kept for export and predict is R.
            encoded = encode(reference)
            data = bytearray(b"".join(view for views in encoded.section_views for view in views))
            self.writer.write_behind(self.store.save_global, encoded.manifest, data)
        return replace(task, common=reference)
