"""What an edge is started with (``EdgeOptions``) and how it stops (``EdgeExit``).

Apart from the daemon because every part of the edge reads the options (the session its
server and TLS name, the run its policy and allowlist, the task runner its batch sizes)
and may end the edge with a status and a reason; ``fl_edge.daemon`` re-exports both, the
names tools and tests import.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from fedattn_shared.privacy.dp import PrivacyPolicy


class EdgeExit(Exception):
    """The edge stops with ``code`` and ``message``. ``tell_server``: a reason the edge
    sends the server as it leaves (for refusals of the server's own settings; never local
    paths or data)."""

    def __init__(self, code: int, message: str, tell_server: str = ""):
        super().__init__(message)
        self.code = code
        self.tell_server = tell_server


@dataclass
class EdgeOptions:
    """The edge's command line as one value: the CLI, fl-sim and the tests build it."""

    server: str
    data_dir: Path
    state_dir: Path
    join_token: str = ""
    name: str | None = None
    device: str = "auto"
    metrics_port: int = -1
    progress: bool | None = None
    log_every: float = 10.0  # without progress bars: a progress line every this many seconds
    max_backoff: float = 30.0
    retry_for: float = 0.0  # seconds without reaching the server before giving up; 0: forever
    eval_batch_size: int = 256
    batch_size: int | None = None  # overrides the server's train.batch_size on this device
    amp: bool = False
    # Keep the data splits in the device's memory (CUDA): batches are gathered there, not
    # copied from the host every step. Nothing changes on a CPU device.
    data_on_device: bool = False
    grad_accum: int = 1
    tls_dir: Path | None = None   # mutual TLS; its certificate names the edge id
    tls_server_name: str = ""
    # The edge's privacy limits (--dp-max-epsilon, --require-dp): a weaker server is refused.
    privacy: PrivacyPolicy = field(default_factory=PrivacyPolicy)
    # Refuse a server that asks for per-class evaluation counts (--refuse-eval-detail).
    refuse_eval_detail: bool = False
    # module:Class method specs this edge imports when a server names them (--allow-method);
    # any other method must be installed under the fedattn.methods entry points.
    allow_methods: tuple[str, ...] = ()
    # module:callable model specs likewise (--allow-model); any other model must be a
    # built-in, timm:/torchvision: or a fedattn.models entry point installed here.
    allow_models: tuple[str, ...] = ()
    # The most model state (MiB over all of the method's models, as built) this edge builds
    # for a server (--max-model-mb): measured on the meta device before anything is allocated.
    max_model_mb: float = 1024.0
    # Simulated heterogeneity, for tests and benches (fl_edge.heterogeneity): --throttle
    # FACTOR (1: full speed) and --disconnect P:SECONDS with its --disconnect-seed.
    throttle: float = 1.0
    disconnect: float = 0.0  # probability per task of losing the connection
    offline_seconds: float = 10.0
    disconnect_seed: int = 0
    # The device's own limits and speed (fl-edge's "device limits" options, one block):
    # samples per forward/backward pass (DP-SGD: the physical batch; the stricter of this
    # and the server's wins), the share of the GPU's memory this process may take, CUDA
    # determinism that warns instead of failing, channels-last inputs on a GPU, and the
    # seconds without progress after which /healthz answers 503 while a task runs.
    max_physical_batch: int | None = None
    gpu_memory_fraction: float | None = None
    cuda_nondeterministic_ok: bool = False
    channels_last: bool = True
    health_stall_seconds: float = 1800.0
    # The device's link (fl_edge.caps): bytes/s each direction (0: no cap), and data
    # budgets per UTC day and month (0: none), kept in the state dir.
    max_rate: float = 0.0
    max_bytes_per_day: int = 0
    max_bytes_per_month: int = 0
    # fl-sim --batch-edges only (no CLI flag): the process's ``fl_tools.sim_batch.EdgeBatcher``
    # slot of this edge, whose ``train`` replaces ``train_local`` (same arguments), so
    # that edges hosted together train as one batched computation where they can.
    batcher: object | None = None

    @property
    def budgets(self) -> dict[str, int]:
        """The data budgets set, by period."""
        return {period: limit for period, limit in (("day", self.max_bytes_per_day),
                                                    ("month", self.max_bytes_per_month))
                if limit}

    @property
    def device_is_cuda(self) -> bool:
        """Whether this edge trains on CUDA (``--device`` cuda, or auto with a GPU)."""
        import torch

        return self.device == "cuda" or (self.device == "auto" and torch.cuda.is_available())
