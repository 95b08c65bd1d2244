"""One typed configuration: defaults < TOML file < command-line flags < --set overrides.

The TOML file has a section per concern (``[server]``, ``[train]``) and one per method
(``[fedprox] mu = 0.01``). ``--set section.key=value`` overrides any single value; the
value is parsed as a TOML value (``--set fedprox.mu=0.1``, ``--set train.private=["bn"]``).
The server resolves everything and sends ``[train]`` and the method's section to edges.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from fedattn_shared.augment import Augment, InputRange
from fedattn_shared.staleness import StalenessWeight

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 (JetPack 6)
    import tomli as tomllib


#: The suffix of the BN-recalibrated evaluation splits (``train.bn_recalibrated_eval``):
#: ``test_bnrecal``, ``global_test_bnrecal``.
BN_RECALIBRATED = "_bnrecal"


class ConfigError(ValueError):
    """Bad configuration: the message names the file, section and key."""


@dataclass
class TrainConfig:
    """What every edge trains with (the server sends it at join). Its defaults are the one
    place training defaults live: fl-server, fl-demo and fl-sim all start from them, a
    method declares what its math needs instead (``Method.train_settings``), and fl-demo
    prints what it sets on top."""

    # A registered model (fl-server --help lists them); a method may declare its own default.
    model: str = "lenet-bn"
    num_classes: int = 10            # classes of the task; every edge maps labels 0..n-1
    # Image-folder data: class i is the folder named class_names[i] on every edge.
    class_names: list[str] = field(default_factory=list)
    # Table data (a datasets folder, Parquet, CSV: fedattn_shared.data.tables): the columns
    # holding each sample's image and its label.
    image_column: str = "image"
    label_column: str = "label"
    in_channels: int = 1             # image channels (1: grey, 3: colour)
    image_size: int = 28             # side of the input images in pixels
    local_epochs: int = 1           # 0: no local steps (measures the transport alone)
    batch_size: int = 32             # local training batch (fl-edge --batch-size overrides it per device)
    optimizer: Literal["sgd", "adam"] = "sgd"  # the edges' local optimizer
    # The local learning rate (the first round's, under a schedule). A default that learns:
    # plain SGD at 0.05 takes the README's deployment (4 edges on the bundled MNIST) to
    # 0.94 mean accuracy in 5 rounds, where 0.01 stopped at 0.81
    # (tests/test_defaults_learn.py). With --optimizer adam set it too (Adam wants ~0.001).
    lr: float = 0.05
    lr_schedule: Literal["constant", "cosine", "step"] = "constant"  # over rounds
    lr_min: float = 0.0             # cosine: the last round's learning rate
    lr_step_rounds: int = 10        # step: decay every this many rounds
    lr_gamma: float = 0.1           # step: decay factor
    momentum: float = 0.0            # SGD momentum
    weight_decay: float = 0.0        # L2 weight decay of the local optimizer
    # The local optimizer's state (SGD momentum buffers, Adam's moments) at the start of a
    # round: "reset" starts every round from a fresh optimizer, as the papers and their
    # reference code do (a new torch.optim.SGD each round); "carry" keeps the previous
    # round's buffers (saved in the edge's private state), the behaviour before 2026-11-27.
    # A method whose math wants carried state declares it in ``Method.train_settings``.
    optimizer_state: Literal["reset", "carry"] = "reset"
    seed: int = 0                    # the run seed: models, selection, every edge's data order
    # A fixed seed gives bit-identical runs on CPU: deterministic algorithms, every random
    # draw of an edge's round seeded from (seed, round, edge). Off: torch's defaults.
    deterministic: bool = True
    threads: int = 0                # > 0: torch.set_num_threads on every edge; 0: its own
    test_fraction: float = 0.2       # an edge without a test split holds this share of its data out
    # Split rules kept on the edge on top of the method's own: bn, head, se-e, attention, ...
    private: list[str] = field(default_factory=list)
    # The papers' recipe pieces (fedattn_shared.augment, fl_edge.trainer):
    clip_grad_norm: float = 0.0     # > 0: clip the stepped gradient's L2 norm to this; 0: off
    augment: Augment = "none"       # none | crop-flip | crop-flip-reflect | resized-crop, training only
    # What the model sees, training and evaluation alike: symmetric, uint8 pixels in [-1, 1];
    # unit, in [0, 1] (v / 255, torchvision's ToTensor); imagenet, [0, 1] standardised by
    # ImageNet's per-channel mean and std (what torchvision's and timm's weights expect).
    input_range: InputRange = "symmetric"
    input_size: int = 0             # > 0: resize inputs to this and build models for it; 0: off
    # A diagnostic for shared BatchNorm: every evaluation also scores the model after the edge
    # recomputes its BN running statistics on its own train split (no weight changes; the
    # edge's state is restored bit for bit), as the extra splits test_bnrecal and
    # global_test_bnrecal. Absent for models without BatchNorm.
    bn_recalibrated_eval: bool = False

    def validate(self) -> None:
        check_choices(self, "train")
        if self.num_classes < 2:
            raise ConfigError(f"train.num_classes must be >= 2, got {self.num_classes}")
        if self.class_names and len(self.class_names) != self.num_classes:
            raise ConfigError(f"train.class_names has {len(self.class_names)} names for "
                              f"{self.num_classes} classes")
        if self.local_epochs < 0:
            raise ConfigError(f"train.local_epochs must be >= 0, got {self.local_epochs}")
        if self.input_range == "imagenet" and self.in_channels != 3:
            raise ConfigError(f"train.input_range imagenet standardises 3 RGB channels; the "
                              f"run has train.in_channels {self.in_channels}")
        for name in ("batch_size", "in_channels", "image_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ConfigError(f"train.lr must be > 0, got {self.lr}")
        if self.lr_step_rounds < 1 or not 0 < self.lr_gamma <= 1 or not 0 <= self.lr_min <= self.lr:
            raise ConfigError("train.lr_step_rounds must be >= 1, train.lr_gamma in (0, 1], "
                              "train.lr_min in [0, lr]")
        if self.momentum < 0 or self.weight_decay < 0:
            raise ConfigError("train.momentum and train.weight_decay must be >= 0")
        if self.threads < 0:
            raise ConfigError(f"train.threads must be >= 0, got {self.threads}")
        if not 0 < self.test_fraction < 1:
            raise ConfigError(f"train.test_fraction must be in (0, 1), got {self.test_fraction}")
        if not 0 <= self.clip_grad_norm < math.inf:
            raise ConfigError(f"train.clip_grad_norm must be >= 0 and finite (0: off), got "
                              f"{self.clip_grad_norm}")
        if self.input_size < 0:
            raise ConfigError(f"train.input_size must be >= 0 (0: the data's own size), got "
                              f"{self.input_size}")

    @property
    def evaluation_splits(self) -> tuple[str, ...]:
        """The split names an evaluation result may carry under this config (the server
        refuses any other)."""
        splits = ("test", "global_test")
        if self.bn_recalibrated_eval:
            splits += tuple(name + BN_RECALIBRATED for name in splits)
        return splits

    @property
    def model_size(self) -> int:
        """The side the models are built for and see: ``input_size`` when set (the edge
        resizes its data to it), else the data's stored ``image_size``."""
        return self.input_size or self.image_size

    def lr_at(self, round_number: int, rounds: int) -> float:
        """The learning rate of a round (1-based) under the schedule: a pure function of the
        round, so every edge and a restarted edge agree without shared state."""
        if self.lr_schedule == "cosine":
            progress = (round_number - 1) / max(rounds - 1, 1)
            return self.lr_min + 0.5 * (self.lr - self.lr_min) * (1 + math.cos(math.pi * progress))
        if self.lr_schedule == "step":
            return self.lr * self.lr_gamma ** ((round_number - 1) // self.lr_step_rounds)
        return self.lr

    @property
    def classes(self) -> list[str]:
        return self.class_names or [str(i) for i in range(self.num_classes)]


@dataclass
class ServerConfig:
    method: str = "fedavg"     # a registered method, or module:Class
    rounds: int = 10           # rounds in the run
    min_edges: int = 2         # connected edges every round waits for before it starts
    quorum: int = 0            # results that close a training phase; 0 = every selected edge
    fraction: float = 1.0      # share of connected edges selected for training each round
    round_timeout: float = 600.0  # seconds a phase waits for its quorum before dropping the rest
    eval_every: int = 1        # evaluate every this many rounds and after the last; 0: never
    host: str = "0.0.0.0"      # address the gRPC server listens on
    port: int = 50051          # gRPC port (0: any free port)
    metrics_port: int = -1     # -1: no Prometheus endpoint; 0: any free port
    checkpoint_dir: str = "./server-state"  # history.json and one checkpoint per round
    resume: bool = False       # continue the run in checkpoint_dir from its last checkpoint
    insecure: bool = False     # plaintext gRPC (a closed lab network only); else mutual TLS
    tls_dir: str = ""          # mutual TLS: the folder `fl-server certs init` made
    join_token: str = ""       # a shared secret every join must carry (plaintext runs)
    chunk_bytes: int = 1 << 20  # bytes per data chunk on the wire
    max_concurrent_uploads: int = 2  # uploads received or aggregated at once: memory vs. slow links
    # Bytes concurrent uploads may hold (receive buffers and gRPC stream windows); fewer
    # slots than max_concurrent_uploads when it holds fewer uploads. 0: a quarter of the
    # memory available when the server starts.
    max_upload_memory: int = 0
    # Bytes of task messages the downloads under way may hold at once (each holds the
    # message it is sending until the edge takes it; a data chunk's frame is built for
    # its send and counts twice, beside gRPC's copy), in whole chunks; a download
    # waits for room, first come first served. 0: 32 MiB shared and 128 KiB of each
    # downloading edge's own, chunks cut to a fair share of it; no download waits.
    max_download_memory: int = 0
    # Collect-then-learn methods (fedmedian, fedproto, fedstar): keep the round's uploads
    # memory-mapped on disk in checkpoint_dir/uploads instead of in RAM.
    spill_uploads: bool = True
    # Streaming-mean methods (fedavg, fedadam, ...): each upload goes to checkpoint_dir/
    # uploads as it arrives and the round's close sums them a slice at a time (the same
    # bits), instead of a float64 sum and compensation in RAM (4 float32 models' worth).
    spill_sums: bool = True
    max_spill_bytes: int = 0   # disk the spilled uploads may take; 0: half the free disk
    keep_checkpoints: int = 2  # round checkpoints kept on disk (the newest)
    init_weights: str = ""     # safetensors file with pretrained weights for the models
    init_skip_head: bool = False  # keep the fresh classifier head, ignore the file's
    poll_timeout: float = 20.0  # seconds a NextTask long poll waits before an empty answer
    # Behind an L7 proxy or NAT (docs/operations.md, "Behind a proxy or NAT"): a proxy such
    # as nginx cuts a stream that carries nothing for its idle timeout (grpc_read_timeout,
    # 60 s), HTTP/2 PINGs or not, and some cut any stream past a maximum age.
    presence_interval: float = 10.0  # seconds between presence heartbeats (under the idle timeout)
    keepalive_interval: float = 30.0  # seconds between the server's HTTP/2 pings on each
    #                                   connection: nginx counts them as a call's activity
    #                                   once its headers went out (under the idle timeout)
    presence_lifetime: float = 0.0  # a presence stream ends after this long (at a heartbeat
    #                                 without a transfer of the edge's open) and the edge opens
    #                                 it again at once (0: never; set under a proxy's max age)
    presence_grace: float = 0.0  # an edge whose presence stream broke stays present this long
    #                              for it to reopen before its task is dropped (0: at once;
    #                              a stream the lifetime ended has at least presence_interval)
    # Bounds on what one edge (or a stranger) can make the server hold.
    max_edges: int = 10_000           # ids that may ever register (each is a record and series)
    upload_idle_timeout: float = 30.0  # an upload that sends nothing for this long is cut off
    upload_min_rate: float = 32768.0   # bytes/s: an upload's total deadline is
    #                                    idle timeout + its size / this rate
    # A result upload cut short (the link broke, the edge restarted) is held, its bytes in
    # its spool file, for this many seconds after the cut: the edge resumes from there
    # (UploadOffset) and its task stands meanwhile; so does the task of an edge that went
    # in the middle of its task download (this long after its last byte).
    # 0: a cut transfer costs its task.
    transfer_resume_expiry: float = 120.0
    download_idle_timeout: float = 30.0  # a task download the edge takes nothing of for
    #                                      this long is cut off (it holds a frame in gRPC)
    download_min_rate: float = 32768.0   # bytes/s: a download's total deadline is
    #                                      idle timeout + its size / this rate
    # A task download goes out in NextTask calls of at most this many data bytes (whole
    # chunks), each under a deadline the edge must set and the server bounds (2 x
    # download_idle_timeout + window / download_min_rate): the longest a download the edge
    # stops taking can hold its frame in gRPC before the call ends on the wire.
    download_window: int = 4 << 20
    max_task_deliveries: int = 3      # a task's bytes may be sent this many times over (per edge
    #                                   and phase, across rejoins; a broken download retries)
    # Secure aggregation (SecAgg+): the server learns only the weighted sum.
    secagg: bool = False
    secagg_graph: Literal["sparse", "full"] = "sparse"  # sparse: k-regular, k = secagg_degree; full: everyone
    secagg_degree: int = 0            # 0: the smallest even k >= 3 log2(n) [reconstructed]
    secagg_threshold: float = 0.5     # t = floor(fraction * holders) + 1
    secagg_clip: float = 16.0         # |value| bound the edge checks before masking
    secagg_max_weight: float = 65536.0  # bound on an edge's weight (n_k) in the fixed point
    secagg_timeout: float = 60.0      # deadline of the advertise, share and unmask phases
    # Under --compress up=int8/int4: each block's public scale is this multiple of the
    # largest |value| of the previous round's unmasked mean update over the block (what an
    # edge's own update may reach before it is clipped; clipped error is the edge's own).
    secagg_margin: float = 2.0
    # What one round may change under --secagg, whatever an edge adds to its masked words
    # (docs/privacy-security.md states the bound that is left): every edge clips its change
    # of the global to this L2 norm before masking, and the server aborts a round whose
    # unmasked mean moves the global further (0: secagg_clip).
    secagg_max_update: float = 0.0
    # Under --compress up=int8/int4: the ceiling of a public scale (0: secagg_margin x
    # secagg_max_update), which otherwise follows the last mean one edge can make large.
    secagg_max_scale: float = 0.0
    # Under --compress up=int8/int4: a public scale is at most this multiple of the
    # previous round's.
    secagg_scale_growth: float = 4.0
    # Poisoned or oversized uploads (an edge may lie about its weight or send huge values).
    # Each edge's num_examples is capped at what it declared at join, never above this.
    max_weight: int = 1_000_000
    # > 0: bound on the L2 norm of an upload's model delta (upload minus the global, over
    # the shared model tensors); 0: none. Needs every upload, so not with secure aggregation.
    clip_update_norm: float = 0.0
    clip_update_mode: Literal["refuse", "scale"] = "refuse"  # over the bound: refuse | scale down
    # Update compression, each direction: "up=CODEC,down=CODEC" (codecs: fp16, bf16, int8,
    # int4, topk:FRACTION; +ef adds error feedback to an upload codec); "": none.
    compress: str = ""
    # Buffered asynchronous aggregation (FedBuff): "sync" runs rounds; "async" hands work
    # to every free edge and applies the mean change of each `buffer` results, each
    # scaled by `staleness_weight` (constant, poly:A, hinge:A,B) and by `async_lr`;
    # results more than `max_staleness` versions old are refused. `rounds` counts versions.
    mode: Literal["sync", "async"] = "sync"
    buffer: int = 10
    max_staleness: int = 20
    staleness_weight: str = "poly:0.5"
    # The step of the buffered mean change in --mode async. Its old name `server_lr` (a
    # method's server optimiser has its own, e.g. fedadam.server_lr) is still read in
    # --mode async, with a warning, and refused in --mode sync, which never read it.
    async_lr: float = 1.0
    # Evaluation results carry each edge's per-class confusion counts, not only its correct /
    # total / loss / Brier sums: per-class figures (F1) for the operator, at the price of
    # every edge's label histogram (the counts' row sums). Carried to the edges in the run
    # config; refused with --dp, and every edge refuses to send it under DP.
    eval_detail: bool = False

    def validate(self) -> None:
        check_choices(self, "server")
        if self.rounds < 1:
            raise ConfigError(f"server.rounds must be >= 1, got {self.rounds}")
        if self.min_edges < 1:
            raise ConfigError(f"server.min_edges must be >= 1, got {self.min_edges}")
        if self.quorum < 0:
            raise ConfigError(f"server.quorum must be >= 0, got {self.quorum}")
        if not 0 < self.fraction <= 1:
            raise ConfigError(f"server.fraction must be in (0, 1], got {self.fraction}")
        if not self.round_timeout > 0:
            raise ConfigError(f"server.round_timeout must be > 0, got {self.round_timeout}")
        if not 1024 <= self.chunk_bytes <= 3 << 20:
            raise ConfigError(f"server.chunk_bytes must be in [1024, 3 MiB], got {self.chunk_bytes}")
        if self.max_concurrent_uploads < 1:
            raise ConfigError("server.max_concurrent_uploads must be >= 1")
        if self.max_upload_memory != 0 and self.max_upload_memory < 64 << 10:
            raise ConfigError(f"server.max_upload_memory must be 0 (a quarter of the available "
                              f"memory) or >= 64 KiB, got {self.max_upload_memory}")
        if self.max_download_memory != 0 and self.max_download_memory < 64 << 10:
            raise ConfigError(f"server.max_download_memory must be 0 (a shared room and a "
                              f"reserve per edge) or >= 64 KiB, got {self.max_download_memory}")
        if self.max_spill_bytes < 0:
            raise ConfigError(f"server.max_spill_bytes must be >= 0 (0: half the free disk), "
                              f"got {self.max_spill_bytes}")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"server.port out of range: {self.port}")
        if not self.poll_timeout > 0:
            raise ConfigError(f"server.poll_timeout must be > 0, got {self.poll_timeout}")
        if not self.presence_interval > 0:
            raise ConfigError(f"server.presence_interval must be > 0, got {self.presence_interval}")
        if not self.keepalive_interval >= 1:
            raise ConfigError(f"server.keepalive_interval must be >= 1 s, got {self.keepalive_interval}")
        if self.presence_lifetime < 0 or self.presence_grace < 0:
            raise ConfigError(f"server.presence_lifetime and server.presence_grace must be >= 0, "
                              f"got {self.presence_lifetime} and {self.presence_grace}")
        if 0 < self.presence_lifetime < self.presence_interval:
            raise ConfigError(f"server.presence_lifetime ({self.presence_lifetime}) must be 0 or at "
                              f"least presence_interval ({self.presence_interval})")
        if self.max_edges < 1:
            raise ConfigError(f"server.max_edges must be >= 1, got {self.max_edges}")
        if not self.upload_idle_timeout > 0:
            raise ConfigError(f"server.upload_idle_timeout must be > 0, got "
                              f"{self.upload_idle_timeout}")
        if not self.upload_min_rate > 0:
            raise ConfigError(f"server.upload_min_rate must be > 0, got {self.upload_min_rate}")
        if not self.transfer_resume_expiry >= 0:
            raise ConfigError(f"server.transfer_resume_expiry must be >= 0 (0: no resuming), "
                              f"got {self.transfer_resume_expiry}")
        if not self.download_idle_timeout > 0:
            raise ConfigError(f"server.download_idle_timeout must be > 0, got "
                              f"{self.download_idle_timeout}")
        if not self.download_min_rate > 0:
            raise ConfigError(f"server.download_min_rate must be > 0, got "
                              f"{self.download_min_rate}")
        if self.download_window < self.chunk_bytes:
            raise ConfigError(f"server.download_window must be at least one chunk "
                              f"({self.chunk_bytes} bytes), got {self.download_window}")
        if self.max_task_deliveries < 1:
            raise ConfigError(f"server.max_task_deliveries must be >= 1, got "
                              f"{self.max_task_deliveries}")
        if self.keep_checkpoints < 1:
            raise ConfigError(f"server.keep_checkpoints must be >= 1, got {self.keep_checkpoints}")
        if self.metrics_port < -1 or self.metrics_port > 65535:
            raise ConfigError(f"server.metrics_port out of range: {self.metrics_port}")
        if self.eval_every < 0:
            raise ConfigError(f"server.eval_every must be >= 0, got {self.eval_every}")
        if self.secagg_degree < 0:
            raise ConfigError(f"server.secagg_degree must be >= 0, got {self.secagg_degree}")
        # Edges refuse a threshold at or below half of the share holders (SecAggPolicy):
        # below that, two disjoint groups of holders could each give the server t shares.
        if not 0.5 <= self.secagg_threshold < 1:
            raise ConfigError(f"server.secagg_threshold must be in [0.5, 1), got "
                              f"{self.secagg_threshold}")
        for name in ("secagg_clip", "secagg_max_weight", "secagg_timeout", "secagg_margin"):
            if not 0 < getattr(self, name) < math.inf:
                raise ConfigError(f"server.{name} must be > 0 and finite, got "
                                  f"{getattr(self, name)}")
        for name in ("secagg_max_update", "secagg_max_scale"):
            if not 0 <= getattr(self, name) < math.inf:
                raise ConfigError(f"server.{name} must be >= 0 and finite (0: derived), got "
                                  f"{getattr(self, name)}")
        if not 1 <= self.secagg_scale_growth < math.inf:
            raise ConfigError(f"server.secagg_scale_growth must be >= 1 and finite, got "
                              f"{self.secagg_scale_growth}")
        if not 1 <= self.max_weight <= 2**53:  # float64 holds every weight exactly
            raise ConfigError(f"server.max_weight must be in [1, 2**53], got {self.max_weight}")
        if not 0 <= self.clip_update_norm < math.inf:
            raise ConfigError(f"server.clip_update_norm must be >= 0 and finite (0: no bound), "
                              f"got {self.clip_update_norm}")
        if self.clip_update_mode != "refuse" and not self.clip_update_norm:
            raise ConfigError("server.clip_update_mode is set but server.clip_update_norm is 0: "
                              "pass --clip-update-norm C")
        self.validate_async()
        if self.clip_update_norm and self.secagg:
            raise ConfigError("server.clip_update_norm needs each upload and secure aggregation "
                              "shows the server only their sum: use one or the other "
                              "(server.secagg_clip bounds each value under --secagg)")

    def secagg_update_bound(self) -> float:
        """The L2 bound on one round's change of the global under --secagg."""
        return self.secagg_max_update or self.secagg_clip

    def secagg_scale_ceiling(self) -> float:
        """The largest public scale of a masked integer upload."""
        return self.secagg_max_scale or self.secagg_margin * self.secagg_update_bound()

    def validate_async(self) -> None:
        """The buffered-mode settings; ConfigError names what does not combine."""
        if self.buffer < 1:
            raise ConfigError(f"server.buffer must be >= 1, got {self.buffer}")
        if self.max_staleness < 0:
            raise ConfigError(f"server.max_staleness must be >= 0, got {self.max_staleness}")
        if not 0 < self.async_lr < math.inf:
            raise ConfigError(f"server.async_lr must be > 0 and finite, got {self.async_lr}")
        parse_staleness(self.staleness_weight)
        if self.mode != "async":
            return
        if self.secagg:
            raise ConfigError(
                "--mode async does not combine with --secagg: SecAgg+ agrees its masks among "
                "a round's participants before any of them uploads, and a buffer's "
                "contributors are known only as their results arrive (each weighted by its "
                "own staleness, which a masked upload would hide); use --mode sync")
        if self.quorum or self.fraction != 1.0:
            raise ConfigError("server.quorum and server.fraction select a synchronous round's "
                              "participants; --mode async gives work to every free edge and "
                              "applies each --buffer results: leave them at their defaults")


def parse_staleness(text: str) -> StalenessWeight:
    """``server.staleness_weight`` parsed (ConfigError names a bad spec)."""
    try:
        return StalenessWeight.parse(text)
    except ValueError as err:
        raise ConfigError(f"server.staleness_weight: {err}") from None


Accountant = Literal["rdp", "prv", "gdp"]
ACCOUNTANTS: tuple[str, ...] = typing.get_args(Accountant)
#: Why train.clip_grad_norm and DP-SGD are refused together: Opacus already clips every
#: sample's gradient to dp.max_grad_norm, and a second clip of the noisy mean would only
#: rescale the noise the accountant calibrated (DP's clipping is the only clipping).
CLIP_WITH_DP = ("train.clip_grad_norm does not combine with --dp: DP-SGD clips every "
                "sample's gradient to dp.max_grad_norm (--dp-max-grad-norm), the only "
                "clipping under DP; set train.clip_grad_norm = 0")
EVAL_DETAIL_WITH_DP = ("server.eval_detail (--eval-detail) does not combine with --dp: the "
                      "per-class counts it asks every edge for reveal its label histogram, "
                      "which DP-SGD does not cover; nothing per-class is sent under DP")
# A delta this large lets the mechanism publish a sample outright with that probability;
# each edge bounds it further, by 1/|D_k| (fedattn_shared.privacy.dp).
MAX_DELTA = 0.5


@dataclass
class DPConfig:
    """``[dp]``: sample-level DP-SGD on every edge (Opacus), see fedattn_shared.privacy.dp.
    The server resolves ``planned_rounds`` and sends the section to every edge; each edge
    calibrates for its own |D_k| (``delta`` 0: 0.1 / |D_k|, as the ANFR paper)."""

    enabled: bool = False          # sample-level DP-SGD on every edge (--dp)
    target_epsilon: float = 0.0    # the budget; with noise_multiplier 0, sigma is calibrated to it
    noise_multiplier: float = 0.0  # > 0: a fixed sigma (target_epsilon, if set, caps the spend)
    delta: float = 0.0             # 0: 0.1 / |D_k| on each edge
    max_grad_norm: float = 1.0     # per-sample clipping bound C
    accountant: Accountant = "rdp"  # Opacus' accountants
    planned_rounds: int = 0        # rounds the calibration covers; 0: server.rounds
    fix_model: bool = False        # replace every BatchNorm by GroupNorm (+ its activation)
    max_physical_batch: int = 0    # BatchMemoryManager's bound on a physical batch; 0: none
    stats_sigma: float = 0.0       # noise multiplier for STAT_VECTORS/PROTOTYPES/SCALAR_SUMMARY
    stats_clip: float = 1.0        # L2 bound each such tensor is clipped to before the noise
    stats_in_clear: bool = False   # accept uploading those sections without noise, knowingly
    # Reproduction only, never deployment: the noise is drawn from (train.seed, round,
    # edge), so anyone who knows the seed can subtract it and the epsilon means nothing.
    # Off: each edge seeds its noise from the OS's entropy. Edges refuse it without
    # fl-edge --allow-seeded-dp-noise.
    seeded_noise: bool = False

    def validate(self) -> None:
        defaults = DPConfig()
        if not self.enabled:
            changed = [f.name for f in dataclasses.fields(self)
                       if getattr(self, f.name) != getattr(defaults, f.name)]
            if changed:
                raise ConfigError(f"dp.{changed[0]} is set but DP is off: pass --dp "
                                  "(or dp.enabled = true)")
            return
        if not (math.isfinite(self.target_epsilon) and self.target_epsilon >= 0):
            raise ConfigError(f"dp.target_epsilon must be a finite number >= 0, got "
                              f"{self.target_epsilon}")
        if not (math.isfinite(self.noise_multiplier) and self.noise_multiplier >= 0):
            raise ConfigError(f"dp.noise_multiplier must be a finite number >= 0, got "
                              f"{self.noise_multiplier}")
        if self.target_epsilon == 0 and self.noise_multiplier == 0:
            raise ConfigError("--dp needs dp.target_epsilon (--dp-epsilon) or "
                              "dp.noise_multiplier (--dp-noise-multiplier)")
        if not 0 <= self.delta < MAX_DELTA:
            # Opacus reports a negative epsilon for such a delta: nothing would bound the run.
            raise ConfigError(f"dp.delta must be in [0, {MAX_DELTA}) (0: 0.1/|D_k|; each edge "
                              f"also refuses delta >= 1/|D_k|), got {self.delta}")
        if not (math.isfinite(self.max_grad_norm) and self.max_grad_norm > 0):
            raise ConfigError(f"dp.max_grad_norm must be > 0, got {self.max_grad_norm}")
        check_choices(self, "dp")
        if self.planned_rounds < 0 or self.max_physical_batch < 0:
            raise ConfigError("dp.planned_rounds and dp.max_physical_batch must be >= 0")
        if not (math.isfinite(self.stats_sigma) and self.stats_sigma >= 0):
            raise ConfigError(f"dp.stats_sigma must be a finite number >= 0, got {self.stats_sigma}")
        if not (math.isfinite(self.stats_clip) and self.stats_clip > 0):
            raise ConfigError(f"dp.stats_clip must be > 0, got {self.stats_clip}")


def shown(value: Any, limit: int = 60, quote: bool = True) -> str:
    """A value in a message, cut short: a config can come from a peer (the run config an
    edge receives), which then chooses how long a message that echoes it would be."""
    text = repr(value) if quote else str(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _check_type(where: str, value: Any, annotation: Any) -> Any:
    """Coerce a TOML value to a dataclass field's type, or raise naming the field."""
    origin = typing.get_origin(annotation)
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if annotation in (int, str, bool, float):
        if type(value) is not annotation:
            raise ConfigError(f"{where}: expected {annotation.__name__}, got {shown(value)}")
        return value
    if origin is Literal:
        choices = typing.get_args(annotation)
        if value not in choices or type(value) is not type(choices[0]):
            raise ConfigError(f"{where}: {shown(value)} is not one of {', '.join(map(str, choices))}")
        return value
    if origin is list:
        (inner,) = typing.get_args(annotation)
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {shown(value)}")
        return [_check_type(f"{where}[{i}]", v, inner) for i, v in enumerate(value)]
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(annotation):
            try:
                return _check_type(where, value, option)
            except ConfigError:
                continue
        raise ConfigError(f"{where}: {shown(value)} does not fit {annotation}")
    if annotation is type(None) and value is None:
        return None
    raise ConfigError(f"{where}: unsupported type {annotation}")


@functools.cache
def _choice_fields(cls: type) -> tuple[tuple[str, Any], ...]:
    hints = typing.get_type_hints(cls)
    return tuple((f.name, hints[f.name]) for f in dataclasses.fields(cls)
                 if typing.get_origin(hints[f.name]) is Literal)


def check_choices(obj: Any, section: str) -> None:
    """Refuse (ConfigError) a field typed ``Literal[...]`` holding another value, with one
    message for every choice in every config and method's Params: ``section.key: 'x' is
    not one of a, b``. The loader checks values as it sets them; this covers dataclasses
    built directly (a test, a host method's params)."""
    if not dataclasses.is_dataclass(obj):
        return
    for name, annotation in _choice_fields(type(obj)):
        _check_type(f"{section}.{name}", getattr(obj, name), annotation)


def apply_values(obj: Any, section: str, values: dict[str, Any], source: str) -> None:
    """Set dataclass fields from a mapping, refusing unknown keys and wrong types."""
    hints = typing.get_type_hints(type(obj))
    names = {f.name for f in dataclasses.fields(obj)}
    for key, value in values.items():
        if key not in names:
            known = ", ".join(sorted(names)) or "(none)"
            raise ConfigError(f"{source}: unknown key {section}.{shown(key, quote=False)} "
                              f"(known: {known})")
        setattr(obj, key, _check_type(f"{source}: {section}.{key}", value, hints[key]))


def parse_set(items: list[str]) -> dict[str, dict[str, Any]]:
    """``["fedprox.mu=0.1", ...]`` -> {"fedprox": {"mu": 0.1}}; values parsed as TOML."""
    out: dict[str, dict[str, Any]] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        section, dot, name = key.strip().partition(".")
        if not sep or not dot or not section or not name:
            raise ConfigError(f"--set {item!r}: expected section.key=value")
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw  # a bare word: take it as a string
        out.setdefault(section, {})[name] = value
    return out


def load_toml(path: str | Path) -> dict[str, dict[str, Any]]:
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))  # TOML is UTF-8, whatever the locale
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"config file {path}: {err}") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"config file {path}: {err}") from None
    for section, values in data.items():
        if not isinstance(values, dict):
            raise ConfigError(f"config file {path}: top-level key {section!r} must be a [section]")
    return data


def merge_sources(*sources: tuple[str, dict[str, dict[str, Any]]]) -> dict[str, tuple[str, dict]]:
    """Later sources win, key by key. Keeps the name of the source of each section's keys."""
    merged: dict[str, tuple[str, dict]] = {}
    for name, data in sources:
        for section, values in data.items():
            _, current = merged.get(section, (name, {}))
            merged[section] = (name, {**current, **values})
    return merged


def to_json(obj: Any) -> str:
    return json.dumps(dataclasses.asdict(obj), sort_keys=True)
