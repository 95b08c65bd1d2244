"""The edge's session loop: join, keep presence, long-poll for tasks, train or evaluate,
stream results back; reconnect with backoff whenever the server is away.

The edge takes no method flag: the server's join reply carries the method, model and
hyperparameters. The edge holds them to its own rules before using any of it: only an
installed method, or a module:Class it was started with ``--allow-method`` for (refused
before any import); DP-SGD within its privacy policy and its ledger's pin (refused before
any training, ``fedattn_shared.privacy.dp``); downlinks no larger than the run's models
imply (refused on the header, before allocating). A refusal ends the edge with status 2,
naming the setting. The model stays resident across rounds; private state is written
atomically after every local training, before the upload.
"""

from __future__ import annotations

import json
import logging
import math
import random
import resource
import socket
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from fedattn_shared import PROTOCOL_VERSION
from fedattn_shared.augment import InputPipeline
from fedattn_shared.config import CLIP_WITH_DP, ConfigError, DPConfig, TrainConfig, apply_values
from fedattn_shared.data import DataError, EdgeData, load_edge_data
from fedattn_shared.methods import check_method_allowed, load_method
from fedattn_shared.methods.base import EdgeAlgorithm, Method, MethodContext
from fedattn_shared.methods.phases import EVALUATE, TRAIN
from fedattn_shared.privacy.dp import (
    BudgetSpent,
    PinnedPolicy,
    PolicyRefusal,
    PrivacyPolicy,
    PrivateTraining,
    check_dp,
)
from fedattn_shared.state import StateError
from fedattn_shared.tls import edge_credentials
from fedattn_shared.wire import fedattn_pb2 as pb
from fedattn_shared.wire import fedattn_pb2_grpc as pb_grpc
from fedattn_shared.wire.accounting import (
    DOWN,
    GRPC_FRAME_PREFIX,
    META,
    UP,
    ByteMeter,
    data_message_wire_bytes,
)
from fedattn_shared.wire.codec import encode
from fedattn_shared.wire.payload import Kind, Payload, WireError
from fedattn_shared.wire.signing import (
    BodyMac,
    exchange,
    new_key_share,
    sign_submission,
    upload_mac_key,
)
from fedattn_shared.wire.transport import (
    MAX_MESSAGE_BYTES,
    BufferPool,
    PayloadAssembler,
    channel_options,
    data_frames,
    deserializer,
    serialize,
)

from .secagg import EdgeSecAgg, SecAggError, SecAggPolicy, is_secagg_phase, strip_secagg
from .store import (
    PrivateStore,
    load_or_create_identity,
    load_or_create_signing_key,
    private_digest,
)
from .trainer import configure_determinism, evaluate, loader_seed, train_local

log = logging.getLogger("fl_edge")

RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
             grpc.StatusCode.CANCELLED, grpc.StatusCode.RESOURCE_EXHAUSTED,
             grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.ABORTED}


class EdgeExit(Exception):
    """The edge stops with ``code`` and ``message``. ``tell_server``: a reason the edge
    sends the server as it leaves (for refusals of the server's own settings; never local
    paths or data)."""

    def __init__(self, code: int, message: str, tell_server: str = ""):
        super().__init__(message)
        self.code = code
        self.tell_server = tell_server


def policy_exit(err: PolicyRefusal, ledger_path: Path) -> EdgeExit:
    """Exit 2 for a server [dp] the edge's policy refuses; the ledger's path is named
    locally when the limit came from it, and the server hears the refusal alone."""
    where = f" ({ledger_path})" if err.pinned else ""
    return EdgeExit(2, f"refusing the server's privacy settings: {err}{where}",
                    tell_server=f"refused the server's privacy settings: {err}")


class Rejoin(Exception):
    """The server no longer knows this session (it restarted): join again at once."""


@dataclass
class EdgeOptions:
    server: str
    data_dir: Path
    state_dir: Path
    join_token: str = ""
    name: str | None = None
    device: str = "auto"
    metrics_port: int = -1
    progress: bool | None = None
    max_backoff: float = 30.0
    retry_for: float = 0.0  # seconds without reaching the server before giving up; 0: forever
    eval_batch_size: int = 256
    batch_size: int | None = None  # overrides the server's train.batch_size on this device
    amp: bool = False
    grad_accum: int = 1
    tls_dir: Path | None = None   # mutual TLS; its certificate names the edge id
    tls_server_name: str = ""
    # The edge's privacy limits (--dp-max-epsilon, --require-dp): a weaker server is refused.
    privacy: PrivacyPolicy = field(default_factory=PrivacyPolicy)
    # module:Class method specs this edge imports when a server names them (--allow-method);
    # any other method must be installed under the fedattn.methods entry points.
    allow_methods: tuple[str, ...] = ()


# The downlink cap (bytes per payload, the common and the personal part each): before the
# run's models are known, a bound for any model fedattn ships; after, DOWNLINK_FACTOR x the
# bytes of the models' state plus DOWNLINK_SLACK (see ``downlink_cap``).
DOWNLINK_CAP_BEFORE_SETUP = 1 << 30
DOWNLINK_FACTOR = 4
DOWNLINK_SLACK = 64 << 20


def downlink_cap(models: dict[str, torch.nn.Module]) -> int:
    """The most bytes one downlink payload of a run may declare. What a method sends an
    edge is made of its models' tensors: the global (at most every state tensor, in a
    dtype no wider than float64), SCAFFOLD's control variates beside it, the initial
    models once; hence a small multiple of the models' state. The slack covers what does
    not grow with the model (SecAgg+'s keys and shares, prototypes, scalars). A server
    that declares more is refused before the edge allocates a byte for it."""
    state = sum(t.numel() * t.element_size() for model in models.values()
                for t in model.state_dict().values())
    return DOWNLINK_FACTOR * state + DOWNLINK_SLACK


@dataclass
class Received:
    header: pb.TaskHeader
    common: Payload
    personal: Payload


class EdgeMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.round = Gauge("fedattn_edge_round", "Last round this edge worked on", registry=registry)
        self.connected = Gauge("fedattn_edge_connected", "1 while joined to the server",
                               registry=registry)
        self.train_seconds = Gauge("fedattn_edge_local_train_seconds", "Last local training time",
                                   registry=registry)
        self.samples_per_second = Gauge("fedattn_edge_samples_per_second",
                                        "Last local training throughput", registry=registry)
        self.accuracy = Gauge("fedattn_edge_accuracy", "Last evaluation accuracy", ["split"],
                              registry=registry)
        self.loss = Gauge("fedattn_edge_loss", "Last evaluation mean loss", ["split"],
                          registry=registry)
        self.info = Gauge("fedattn_edge_info", "1, labelled with this edge's id and device",
                          ["edge", "device"], registry=registry)
        self.trained_samples = Counter("fedattn_edge_trained_samples",
                                       "Samples seen in local training", registry=registry)
        self.last_success_round = Gauge("fedattn_edge_last_success_round",
                                        "Last round whose result the server accepted",
                                        registry=registry)
        self.last_success_time = Gauge("fedattn_edge_last_success_timestamp_seconds",
                                       "Unix time of the last accepted result", registry=registry)
        self.submissions = Counter("fedattn_edge_submissions", "Results sent, by the server's answer",
                                   ["phase", "result"], registry=registry)
        self.retries = Counter("fedattn_edge_rpc_retries", "Server calls failed and retried",
                               ["code"], registry=registry)
        self.private_state_bytes = Gauge("fedattn_edge_private_state_bytes",
                                         "Size of the private state file", registry=registry)
        self.peak_rss_bytes = Gauge("fedattn_edge_peak_rss_bytes",
                                    "Peak resident memory of the edge process", registry=registry)
        self.gpu_peak_bytes = Gauge("fedattn_edge_gpu_memory_peak_bytes",
                                    "Peak CUDA memory allocated by the last local training",
                                    ["device"], registry=registry)
        self.gpu_reserved_bytes = Gauge("fedattn_edge_gpu_memory_reserved_bytes",
                                        "CUDA memory held by the caching allocator", ["device"],
                                        registry=registry)
        self._registry = registry
        self.dp_epsilon: Gauge | None = None

    def track_privacy(self, spent: float, budget: float) -> None:
        """Exports the DP-SGD spend, from the moment DP-SGD runs: an edge without it has no
        epsilon at all (a 0 would read as perfect privacy)."""
        if self.dp_epsilon is None:
            self.dp_epsilon = Gauge("fedattn_edge_dp_epsilon",
                                    "Privacy spent by DP-SGD so far (epsilon at the ledger's "
                                    "delta)", registry=self._registry)
            if math.isfinite(budget):
                Gauge("fedattn_edge_dp_epsilon_budget",
                      "The epsilon this edge's DP-SGD may spend in all (--dp-epsilon)",
                      registry=self._registry).set(budget)
        self.dp_epsilon.set(spent)

    def observe_training(self, result, device: torch.device) -> None:
        """Throughput and memory after a local training (the caller resets CUDA's peak)."""
        self.train_seconds.set(result.seconds)
        self.samples_per_second.set(result.samples_per_second)
        self.trained_samples.inc(result.examples)
        self.peak_rss_bytes.set(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        if device.type == "cuda":
            self.gpu_peak_bytes.labels(str(device)).set(torch.cuda.max_memory_allocated(device))
            self.gpu_reserved_bytes.labels(str(device)).set(torch.cuda.memory_reserved(device))


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise EdgeExit(2, "--device cuda: no CUDA device is available")
    return torch.device(name)


class EdgeDaemon:
    def __init__(self, options: EdgeOptions):
        self.opts = options
        self.device = pick_device(options.device)
        self.credentials = None
        if options.tls_dir is not None:
            try:
                self.credentials, token, certified = edge_credentials(options.tls_dir)
            except StateError as err:
                raise EdgeExit(2, str(err)) from None
            if options.name and options.name != certified:
                raise EdgeExit(2, f"--name {options.name}: the certificate in "
                                  f"{options.tls_dir} is for edge {certified}")
            options.name = certified
            options.join_token = token  # under mutual TLS the join carries the enrollment token
        try:
            self.identity = load_or_create_identity(options.state_dir, options.name)
            self.signing_key = load_or_create_signing_key(options.state_dir)
            # Fail at start, not after the first round of training, if state cannot be saved.
            with tempfile.NamedTemporaryFile(dir=options.state_dir, prefix=".write-check-"):
                pass
        except (StateError, OSError) as err:
            raise EdgeExit(2, f"state dir {options.state_dir}: {err}") from None
        self.store = PrivateStore(options.state_dir)
        self.secagg = EdgeSecAgg(options.state_dir, self.identity.edge_id, self.signing_key)
        self.registry = CollectorRegistry()
        self.meter = ByteMeter(self.registry)
        self.metrics = EdgeMetrics(self.registry)
        self.metrics.info.labels(self.identity.edge_id, str(self.device)).set(1)
        self.config_json: str | None = None
        self.fingerprint = ""
        self.method: Method | None = None
        self.algo: EdgeAlgorithm | None = None
        self.data: EdgeData | None = None
        self.train_cfg: TrainConfig | None = None
        self.privacy: PrivateTraining | None = None
        self.chunk_bytes = 1 << 20
        self.downlink_cap = DOWNLINK_CAP_BEFORE_SETUP
        self.cached_common: tuple[str, Payload, bytearray] | None = None
        self.buffers = BufferPool(keep=1)
        self.writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="state-writer")
        self.pending_writes: list[Future] = []
        self.session = ""
        self.upload_mac_key = b""  # agreed with the server at join, for this session only
        self.metrics_port: int | None = None

    # ---- lifecycle --------------------------------------------------------------------
    def run(self) -> int:
        if self.opts.metrics_port >= 0:
            server, _ = start_http_server(self.opts.metrics_port, registry=self.registry)
            self.metrics_port = server.server_port
            log.info("metrics on :%d", self.metrics_port)
        backoff = 0.5
        unreachable_since: float | None = None
        while True:
            try:
                self._session()
                return 0
            except Rejoin:
                log.info("server forgot this session; joining again")
                continue
            except WireError as err:
                raise EdgeExit(2, f"server {self.opts.server} sent a task this edge refuses: "
                                  f"{err}") from None
            except grpc.RpcError as err:
                code = err.code() if hasattr(err, "code") else None
                if code not in RETRYABLE:
                    raise EdgeExit(2, f"server refused: {code.name if code else ''} "
                                      f"{err.details() if hasattr(err, 'details') else err}") from None
                now = time.monotonic()
                unreachable_since = unreachable_since or now
                if self.opts.retry_for and now - unreachable_since > self.opts.retry_for:
                    raise EdgeExit(1, f"server {self.opts.server} unreachable for "
                                      f"{now - unreachable_since:.0f}s; giving up") from None
                delay = backoff * (0.5 + random.random())
                log.warning("server %s unavailable (%s); retrying in %.1fs", self.opts.server,
                            code.name if code else err, delay)
                self.metrics.connected.set(0)
                self.metrics.retries.labels(code.name if code else "UNKNOWN").inc()
                time.sleep(delay)
                backoff = min(backoff * 2, self.opts.max_backoff)
                continue
            finally:
                self.metrics.connected.set(0)
            backoff, unreachable_since = 0.5, None

    def _session(self) -> None:
        if self.credentials is not None:
            override = ([("grpc.ssl_target_name_override", self.opts.tls_server_name)]
                        if self.opts.tls_server_name else [])
            channel = grpc.secure_channel(self.opts.server, self.credentials,
                                          options=channel_options() + override)
        else:
            channel = grpc.insecure_channel(self.opts.server, options=channel_options())
        with channel:
            stub = pb_grpc.FederatedLearningStub(channel)
            # Data chunks travel as pre-built frames and arrive as views (transport.py).
            stub.NextTask = channel.unary_stream(
                "/fedattn.v1.FederatedLearning/NextTask", request_serializer=serialize,
                response_deserializer=deserializer(pb.TaskMessage))
            stub.Submit = channel.stream_unary(
                "/fedattn.v1.FederatedLearning/Submit", request_serializer=serialize,
                response_deserializer=pb.SubmitReply.FromString)
            self._join(stub)
            stop = threading.Event()
            call = stub.Presence(pb.PresenceRequest(edge_id=self.identity.edge_id,
                                                    session=self.session))
            presence = threading.Thread(target=self._presence, args=(call, stop), daemon=True)
            presence.start()
            try:
                while True:
                    received = self._next_task(stub)
                    status = received.header.status
                    if status == pb.TaskHeader.DONE:
                        log.info("server says the run is over")
                        self._leave(stub, "run finished")
                        return
                    if status == pb.TaskHeader.TASK:
                        self._handle(stub, received)
            finally:
                stop.set()
                # Cancelled and its thread joined before the channel closes: a stream still
                # running through the channel's close can abort the process at exit.
                call.cancel()
                presence.join(timeout=10)
                self._flush_writes()

    # ---- join / presence / leave --------------------------------------------------------
    def _join(self, stub, state_fingerprint: str | None = None) -> None:
        """Joins (a new session). ``state_fingerprint``: what the join says of the private
        state, when it repeats an earlier join of this session's start."""
        if state_fingerprint is None:
            state_fingerprint = self.fingerprint or (self.store.stored_fingerprint() or "")
        key_private, key_share, key_proof = new_key_share(self.signing_key,
                                                          self.identity.edge_id)
        info = {"hostname": socket.gethostname(), "device": str(self.device),
                "torch": torch.__version__}
        if self.data is not None:
            # The server caps this edge's aggregation weight (num_examples) at it.
            info["num_examples"] = str(len(self.data.train))
        request = pb.JoinRequest(
            protocol_version=PROTOCOL_VERSION, edge_id=self.identity.edge_id,
            edge_secret=self.identity.secret, join_token=self.opts.join_token,
            info=info,
            state_fingerprint=state_fingerprint,
            signing_key=self.signing_key.public_key().public_bytes_raw(),
            upload_key_share=key_share, upload_key_proof=key_proof,
        )
        self.meter.count_message(UP, request)
        try:
            reply = stub.Join(request, timeout=30)
        except grpc.RpcError as err:
            if err.code() in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED,
                              grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT):
                raise EdgeExit(2, f"join refused by {self.opts.server}: {err.details()}") from None
            raise
        self.meter.count_message(DOWN, reply)
        try:
            self.upload_mac_key = upload_mac_key(exchange(key_private, reply.upload_key_share),
                                                 self.identity.edge_id, reply.session)
        except ValueError:
            raise EdgeExit(2, f"{self.opts.server} sent no valid upload key share "
                              "(fedattn versions differ?)") from None
        self.session = reply.session
        self.chunk_bytes = reply.chunk_bytes or self.chunk_bytes
        if reply.config_json != self.config_json:
            try:
                self._setup(reply.config_json, reply.fingerprint)
            except EdgeExit as err:
                # The server hears why (its history records it) rather than a silent drop.
                if err.tell_server:
                    self._leave(stub, err.tell_server[:500])
                raise
            if "num_examples" not in info:
                # The training split depends on the server's configuration, known only now:
                # join again to declare its size (the new session replaces this one), saying
                # the same of the private state (none: the server sends initial weights).
                self._join(stub, state_fingerprint)
                return
        self.metrics.connected.set(1)
        log.info("joined %s as %s (method %s)", self.opts.server, self.identity.edge_id,
                 self.method.name)

    def _presence(self, call, stop: threading.Event) -> None:
        """Holds the presence stream open (the server selects connected edges only and
        drops the task of one whose stream closes) until ``stop`` or the stream ends."""
        try:
            for _ in call:
                if stop.is_set():
                    break
        except grpc.RpcError:
            pass  # the main loop notices a lost server on its own calls

    def _leave(self, stub, reason: str) -> None:
        try:
            request = pb.LeaveRequest(edge_id=self.identity.edge_id, session=self.session,
                                      reason=reason)
            self.meter.count_message(UP, request)
            stub.Leave(request, timeout=10)
        except grpc.RpcError:
            pass

    # ---- configuration ------------------------------------------------------------------
    def _setup(self, config_json: str, fingerprint: str) -> None:
        """The server's run configuration, checked against this edge's own rules before
        anything of it is used: the method must be installed or allowed (checked before
        any import), the DP-SGD settings within the edge's policy and the ledger's pin."""
        try:
            config = json.loads(config_json)
            if not isinstance(config, dict):
                raise ValueError("not a JSON object")
            try:
                check_method_allowed(config["method"], self.opts.allow_methods)
            except ValueError as err:
                raise EdgeExit(2, f"refusing the server's method: {err}",
                               tell_server=f"refused the server's method: {err}") from None
            train = TrainConfig()
            apply_values(train, "train", config["train"], "server config")
            train.validate()
            configure_determinism(train.deterministic, train.threads)
            dp = None
            if config.get("dp") is not None:
                dp = DPConfig()
                apply_values(dp, "dp", config["dp"], "server config")
                dp.validate()
                if dp.enabled and train.clip_grad_norm:
                    raise ConfigError(CLIP_WITH_DP)
            # What this edge holds every secure-aggregation round to (not the round's word).
            secagg = SecAggPolicy.from_config(config["secagg"]) if "secagg" in config else None
        except (ConfigError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise EdgeExit(2, f"cannot use the server's configuration: {err}") from None
        try:
            ledger = self.store.load_ledger()
            pinned = PinnedPolicy.from_ledger(ledger) if ledger is not None else None
        except StateError as err:
            raise EdgeExit(2, f"{err} ({self.store.ledger_path})") from None
        try:
            self.opts.privacy.check(dp, pinned)
        except PolicyRefusal as err:
            raise policy_exit(err, self.store.ledger_path) from None
        try:
            method_cls = load_method(config["method"])
            params = method_cls.Params()
            apply_values(params, config["method"], config.get("params", {}), "server config")
            method = method_cls(MethodContext(train, params, dp=dp))
        except (ConfigError, ValueError, TypeError, AttributeError) as err:
            raise EdgeExit(2, f"cannot use the server's configuration: {err}") from None
        models = method.build_models()
        local_fingerprint = method.fingerprint(models)
        if local_fingerprint != fingerprint:
            raise EdgeExit(2, f"this edge builds model fingerprint {local_fingerprint} but the "
                              f"server's is {fingerprint}: fedattn versions differ")
        algo = method.edge(models, self.device)
        if algo.schedule.steps_per_batch > 1 and self.opts.grad_accum > 1:
            raise EdgeExit(2, f"method {method.name!r} takes {algo.schedule.steps_per_batch} optimizer "
                              "steps per batch and does not combine with --grad-accum")
        try:
            data = load_edge_data(self.opts.data_dir, train)
        except DataError as err:
            raise EdgeExit(2, str(err)) from None
        if self.store.exists():
            try:
                meta = self.store.load(algo, fingerprint)
            except StateError as err:
                raise EdgeExit(2, str(err)) from None
            log.info("resumed private state from %s (round %s, phase %s, digest %s)",
                     self.store.path, meta.get("round"), meta.get("phase"), private_digest(algo))
        self.privacy = self._private_training(method, algo, len(data.train),
                                              self.opts.batch_size or train.batch_size, ledger)
        self.method, self.algo, self.data, self.train_cfg = method, algo, data, train
        self.secagg.policy = secagg
        self.downlink_cap = downlink_cap(models)
        self.config_json, self.fingerprint = config_json, fingerprint
        self._write(self.store.save_run_config, config_json, fingerprint)
        self.cached_common = None
        log.info("data: %d train, %d test, %s global-test samples", len(data.train),
                 len(data.test), len(data.global_test) if data.global_test else "no")

    def _private_training(self, method: Method, algo: EdgeAlgorithm, num_examples: int,
                          batch_size: int, ledger: dict | None) -> PrivateTraining | None:
        """DP-SGD for the run (once: the models are wrapped for good), calibrated to this
        edge's data, continuing the ledger on disk, within the edge's policy and the
        ledger's pin. The ledger is written at once, so the first run's pin holds from
        before its first step."""
        if method.dp is None:
            return None
        if self.opts.amp or self.opts.grad_accum > 1:
            raise EdgeExit(2, "the server runs DP-SGD: --amp and --grad-accum do not combine "
                              "with it (dp.max_physical_batch bounds memory instead)")
        try:
            check_dp(method)
            privacy = PrivateTraining(algo, method.dp, num_examples, batch_size, ledger,
                                      policy=self.opts.privacy)
        except PolicyRefusal as err:
            raise policy_exit(err, self.store.ledger_path) from None
        except (ValueError, StateError) as err:
            raise EdgeExit(2, f"{err} ({self.store.ledger_path})") from None
        self._write(self.store.save_ledger, privacy.ledger())
        self.metrics.track_privacy(privacy.spent(), privacy.budget)
        log.info("DP-SGD: sigma %.4g, q %.4g, delta %.3g, C %g, %d steps per round, epsilon "
                 "spent so far %.4g of %s", privacy.noise_multiplier, privacy.sample_rate,
                 privacy.delta, method.dp.max_grad_norm, privacy.batches_per_round,
                 privacy.spent(), f"{privacy.budget:g}")
        return privacy

    def _write(self, save, *args) -> None:
        """State writes are atomic: on a read-only or full disk the old files stay intact
        and the edge stops with the path named rather than training on without a record."""
        try:
            save(*args)
        except (OSError, StateError) as err:
            raise EdgeExit(2, f"cannot write state under {self.opts.state_dir}: {err} "
                              "(the previous state files are intact)") from None
        if save == self.store.save:
            self.metrics.private_state_bytes.set(self.store.path.stat().st_size)

    def _write_behind(self, save, *args) -> None:
        """A state write that overlaps the upload. What it saves stays untouched until
        _flush_writes, which runs before the next task and before the session ends."""
        self.pending_writes.append(self.writer.submit(self._write, save, *args))

    def _flush_writes(self) -> None:
        writes, self.pending_writes = self.pending_writes, []
        for write in writes:
            write.result()  # re-raises the write's EdgeExit

    # ---- tasks --------------------------------------------------------------------------
    def _call(self, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.UNAUTHENTICATED:
                raise Rejoin() from None
            raise

    def _next_task(self, stub) -> Received:
        self._flush_writes()
        cached_id = self.cached_common[0] if self.cached_common else ""
        request = pb.TaskRequest(edge_id=self.identity.edge_id, session=self.session,
                                 cached_common=cached_id)
        self.meter.count_message(UP, request)
        stream = self._call(stub.NextTask, request, timeout=120)
        header = None
        assemblers: list[PayloadAssembler] = []
        cap = self.downlink_cap
        try:
            for message in stream:
                if not isinstance(message, memoryview):
                    header = message.header
                    self.meter.count_message(DOWN, message)
                    if header.status != pb.TaskHeader.TASK:
                        break
                    for part, manifest in (("common", header.common), ("personal", header.personal)):
                        if part == "common" and header.common_cached:
                            continue
                        if manifest.total_bytes > cap:  # before a byte is allocated
                            why = ("the bound before the run's models are known"
                                   if self.method is None else
                                   f"{DOWNLINK_FACTOR} x the run's model state + "
                                   f"{DOWNLINK_SLACK >> 20} MiB")
                            raise WireError(
                                f"its round {header.round} {header.phase[:40]!r} task declares a "
                                f"{part} downlink of {manifest.total_bytes} bytes, over this "
                                f"edge's cap of {cap} bytes ({why})")
                    if not header.common_cached:
                        assemblers.append(PayloadAssembler(header.common, cap, MAX_MESSAGE_BYTES,
                                                           pool=self.buffers))
                    assemblers.append(PayloadAssembler(header.personal, cap, MAX_MESSAGE_BYTES))
                    continue
                target = next((a for a in assemblers if not a.complete), None)
                if header is None or target is None:
                    raise WireError("data before the task header or past the payload")
                kind = target.add(message)
                self.meter.count(DOWN, kind.label, data_message_wire_bytes(len(message)),
                                 len(message))
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.UNAUTHENTICATED:
                raise Rejoin() from None
            raise
        if header is None:
            raise WireError("task stream ended without a header")
        if header.status != pb.TaskHeader.TASK:
            return Received(header, Payload(), Payload())
        if header.common_cached:
            if not self.cached_common or self.cached_common[0] != header.common_id:
                raise WireError("server referred to a cached downlink this edge does not hold")
            common = self.cached_common[1]
            personal = assemblers[0].finish()
        else:
            common = assemblers[0].finish()
            personal = assemblers[1].finish()
            if self.cached_common is not None:
                # Nothing views the previous global any more (the model copied it and the
                # next receive replaces the method's references), so its buffer serves the
                # next download instead of a fresh one that page-faults on every 4 KiB.
                self.buffers.give(self.cached_common[2])
            self.cached_common = (header.common_id, common, assemblers[0].buffer)
            self._write_behind(self.store.save_global, header.common, assemblers[0].buffer)
        return Received(header, common, personal)

    def _handle(self, stub, received: Received) -> None:
        header = received.header
        algo, train, data = self.algo, self.train_cfg, self.data
        self.metrics.round.set(header.round)
        personal = received.personal
        init = personal.get(Kind.SHARED_TENSORS, "init")
        if init is not None:
            # The server's initial (pretrained) models, sent once to an edge without state.
            algo.load_shared(init.tensors)
            personal = Payload([s for s in personal.sections if s is not init])
            log.info("loaded the server's initial weights (%d tensors)", len(init.tensors))
        if is_secagg_phase(header.phase):  # a step of secure aggregation, not the method's
            try:
                upload = self.secagg.step(header.phase, header.round, personal)
            except SecAggError as err:
                log.error("round %d %s: %s; this edge sits the step out", header.round,
                          header.phase, err)
                upload = Payload()
            self._submit(stub, header, upload, 0, [], {})
            return
        masked = personal.get(Kind.SECAGG, "request") is not None
        personal = strip_secagg(personal)
        algo.receive(header.phase, received.common, personal)
        metrics: dict[str, float] = {}
        evaluation: list[pb.ConfusionCounts] = []
        upload = Payload()
        num_examples = len(data.train)
        spec = json.loads(header.spec_json or "{}")
        lr = train.lr_at(header.round, int(spec.get("rounds", header.round)))
        seed = loader_seed(train.seed, header.round, self.identity.edge_id)
        if self.privacy is not None:
            self.privacy.begin_phase(seed, header.phase)
        if header.phase == TRAIN:
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)
            privacy = self.privacy
            if privacy is not None:
                try:
                    privacy.check_budget()
                except BudgetSpent as err:
                    log.error("%s", err)
                    self._leave(stub, str(err))
                    raise EdgeExit(3, str(err)) from None
            result = train_local(algo, data.train, train.local_epochs,
                                 self.opts.batch_size or train.batch_size, seed, self.device,
                                 self.opts.progress, lr=lr, amp=self.opts.amp,
                                 grad_accum=self.opts.grad_accum, privacy=privacy,
                                 clip_grad_norm=train.clip_grad_norm,
                                 inputs=InputPipeline(train.augment, train.input_size),
                                 deterministic=train.deterministic)
            upload, dp_figures = self._book_privacy(header, algo.after_train(result.steps))
            self._write_behind(self.store.save, algo, self.fingerprint, header.round,
                               header.phase)
            private_figures = algo.private_figures()
            if private_figures:
                self._write_behind(self.store.record_private, header.round, private_figures)
            metrics = {"train_seconds": result.seconds, "steps": float(result.steps),
                       "samples_per_second": result.samples_per_second, "lr": lr, **dp_figures}
            if privacy is None:
                # Losses are statistics of the training data: under DP they stay home.
                metrics.update({"train_loss": result.mean_loss,
                                "last_epoch_loss": result.last_epoch_loss,
                                **algo.training_metrics()})
                if train.clip_grad_norm:  # refused with DP: this branch only
                    metrics.update({"grad_norm": result.grad_norm_mean,
                                    "clipped_fraction": result.clipped_steps / max(result.steps, 1)})
            self.metrics.observe_training(result, self.device)
            log.info("round %d: trained %d steps in %.2fs (loss %.4f)", header.round,
                     result.steps, result.seconds, result.mean_loss)
        elif header.phase == EVALUATE:
            scorer, finetune_epochs = algo.before_evaluate()
            if finetune_epochs:
                # Fine-tuning is training on the train split: it is clipped and augmented
                # as local training is; the evaluation below only resizes.
                result = train_local(scorer, data.train, finetune_epochs,
                                     self.opts.batch_size or train.batch_size, seed, self.device,
                                     self.opts.progress, lr=lr, amp=self.opts.amp,
                                     grad_accum=self.opts.grad_accum,
                                     clip_grad_norm=train.clip_grad_norm,
                                     inputs=InputPipeline(train.augment, train.input_size),
                                     deterministic=train.deterministic)
                # The fine-tuned model is private state: export and predict score it too.
                self._write_behind(self.store.save, algo, self.fingerprint, header.round,
                                   header.phase)
                metrics = {"finetune_loss": result.mean_loss,
                           "finetune_seconds": result.seconds}
                log.info("round %d: fine-tuned %d steps before evaluation", header.round,
                         result.steps)
            splits = [("test", data.test)] + ([("global_test", data.global_test)]
                                              if data.global_test is not None else [])
            for split_name, split in splits:
                counts = evaluate(scorer, split, split_name, train.num_classes,
                                  self.opts.eval_batch_size, self.device,
                                  InputPipeline(input_size=train.input_size))
                evaluation.append(pb.ConfusionCounts(
                    split=split_name, num_classes=train.num_classes,
                    counts=counts.confusion.reshape(-1).tolist(),
                    loss_sum=counts.loss_sum, brier_sum=counts.brier_sum))
                self.metrics.accuracy.labels(split_name).set(counts.accuracy)
                self.metrics.loss.labels(split_name).set(counts.loss_sum / max(counts.total, 1))
                log.info("round %d: %s accuracy %.4f on %d samples", header.round, split_name,
                         counts.accuracy, counts.total)
        else:
            try:
                upload = algo.phase_upload(header.phase)
            except ValueError as err:
                raise EdgeExit(2, f"server asked for phase {header.phase!r}: {err} "
                                  "(fedattn versions differ?)") from None
            upload, metrics = self._book_privacy(header, upload)
        if masked:  # the server sees only the sum: mask weight * upload, send no n_k or loss
            try:
                upload = self.secagg.mask(header.round, header.phase, received.personal, upload,
                                          algo.upload_weight(header.phase, num_examples),
                                          self.method, algo.models)
            except (SecAggError, ValueError) as err:
                log.error("round %d %s: not masking this upload: %s", header.round,
                          header.phase, err)
                upload = Payload()
            num_examples = 0
            metrics = {k: v for k, v in metrics.items()
                       if k in ("train_seconds", "steps", "lr") or k.startswith("dp_")}
        self._submit(stub, header, upload, num_examples, evaluation, metrics)

    def _book_privacy(self, header: pb.TaskHeader, upload: Payload) -> tuple[Payload, dict]:
        """Under DP: the upload with its statistics noised, the phase's DP-SGD steps and
        releases booked, and the ledger written, before anything of it leaves the edge
        (the budget survives a crash). Returns the upload and the figures to report."""
        privacy = self.privacy
        if privacy is None:
            return upload, {}
        upload = privacy.privatize_upload(header.phase, upload)
        figures = privacy.end_round(header.round, header.phase)
        self._write(self.store.save_ledger, privacy.ledger())
        self.metrics.track_privacy(figures["dp_epsilon"], privacy.budget)
        return upload, figures

    def _submit(self, stub, task: pb.TaskHeader, upload: Payload, num_examples: int,
                evaluation: list, metrics: dict[str, float]) -> None:
        encoded = encode(upload, checksum=False)  # the signed body MAC covers the bytes
        header = pb.SubmitMessage(header=pb.SubmitHeader(
            protocol_version=PROTOCOL_VERSION, edge_id=self.identity.edge_id,
            session=self.session, round=task.round, task_id=task.task_id, phase=task.phase,
            num_examples=num_examples, payload=encoded.manifest, evaluation=evaluation,
            metrics=metrics, task_nonce=task.task_nonce, body_mac_iv=BodyMac.new_iv()))
        header.header.signature = sign_submission(
            self.signing_key, header.header,
            encoded.body_mac(self.upload_mac_key, header.header.body_mac_iv))

        def messages():
            self.meter.count_message(UP, header)
            yield header
            for kind, frame, size in data_frames(encoded, self.chunk_bytes):
                self.meter.count(UP, kind.label, len(frame) + GRPC_FRAME_PREFIX, size)
                yield frame

        reply = self._call(stub.Submit, messages(), timeout=600)
        self.meter.count_message(DOWN, reply, kind=META)
        self.metrics.submissions.labels(task.phase, "accepted" if reply.accepted else "refused").inc()
        if reply.accepted:
            self.metrics.last_success_round.set(task.round)
            self.metrics.last_success_time.set_to_current_time()
        else:
            log.warning("round %d %s result refused: %s", task.round, task.phase, reply.reason)
