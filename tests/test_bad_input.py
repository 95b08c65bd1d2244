"""The wire's bad-input suite: a real fl-server process, driven by a hand-written raw gRPC
client that joins, keeps a presence stream open, long-polls tasks and submits malformed,
oversized, mistyped, non-finite, stale, duplicate and unauthenticated uploads.

Every refusal must (1) reach the client as ``accepted == False`` with a reason naming what
was wrong, (2) be logged by the server with the sender's edge id, and (3) leave the
server's state and running sum untouched. (3) is checked through the wire alone: the
global model comes back in the next task's common payload. A refusal that costs the edge
its task closes the (single-edge) phase with zero results, so the next global is
bit-identical to the previous one; a refusal that does not is followed by a valid upload
of ``global + 1`` and the next global must be exactly that upload's weighted mean.

One server process serves the whole module, one scenario per round.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable

import grpc
import pytest
import torch
from conftest import Cluster, Proc, wait_for
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from grpc_health.v1 import health_pb2, health_pb2_grpc
from rawedge import (
    NUM_EXAMPLES,
    UPLOAD_CHUNK,
    RawEdge,
    Task,
    encoded_train,
    raw_layout,
    shifted,
    stream,
    train_messages,
)

from fedattn_shared import PROTOCOL_VERSION
from fedattn_shared.schema import Kind, Section
from fedattn_shared.wire import fedattn_pb2 as pb
from fedattn_shared.wire import fedattn_pb2_grpc as pb_grpc
from fedattn_shared.wire.signing import BodyMac, new_key_share
from fedattn_shared.wire.transport import MAX_MESSAGE_BYTES, payload_chunks

ROUNDS = 200             # more than the suite uses: the run must still be going at the end
ROUND_TIMEOUT = 15.0
TARGET = "model/classifier.0.weight"  # the tensor the bad uploads tamper with


# ---- checks --------------------------------------------------------------------------------


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def assert_bit_identical(after: dict[str, torch.Tensor], before: dict[str, torch.Tensor]) -> None:
    assert sorted(after) == sorted(before)
    for name in before:
        assert after[name].dtype == before[name].dtype and after[name].shape == before[name].shape
        assert tensor_bytes(after[name]) == tensor_bytes(before[name]), f"{name} changed"


def assert_single_upload_mean(after: dict[str, torch.Tensor], upload: dict[str, torch.Tensor]) -> None:
    """One accepted upload: the weighted mean is the upload. The server's running sum is
    float32 (sum = w * x, mean = sum / w), which may round x by one ulp when w = 5 is not a
    power of two; anything else that leaked into the sum (a refused upload, a duplicate
    with other values) moves the mean by orders of magnitude more."""
    assert sorted(after) == sorted(upload)
    for name in upload:
        assert after[name].dtype == upload[name].dtype
        torch.testing.assert_close(after[name], upload[name], rtol=2.5e-7, atol=0,
                                   msg=lambda m, name=name: f"{name}: {m}")


class Suite:
    def __init__(self, cluster: Cluster, server: Proc, edge: RawEdge):
        self.cluster = cluster
        self.server = server
        self.edge = edge
        self.expected_rounds: dict[int, str] = {}  # round -> "dropped" | "accepted"
        self.expected_evaluations: dict[int, str] = {}  # round -> "dropped"

    def train_task(self) -> Task:
        """The next training task; evaluation tasks on the way get a valid result."""
        for _ in range(10):
            task = self.edge.next_task()
            if task.header.phase == "train":
                return task
            assert task.header.phase == "evaluate", task.header
            reply = self.edge.submit(self.edge.evaluation(task))
            assert reply.accepted, reply.reason
        raise AssertionError("no training task in 10 tasks")

    def log_mark(self) -> int:
        return self.server.mark()

    def logged(self, mark: int, *needles: str) -> str:
        return self.server.logged(mark, *needles, timeout=10)

    def expect_refusal(self, reply: pb.SubmitReply, mark: int, edge_id: str, *reason: str) -> None:
        assert not reply.accepted
        for needle in reason:
            assert needle in reply.reason, f"{needle!r} not in {reply.reason!r}"
        # Logged as "... refused: <reason>" by both daemons: the reason does not repeat it.
        assert not reply.reason.startswith("refused"), reply.reason
        self.logged(mark, f"submission from {edge_id} refused", *reason)

    def expect_dropped(self, task: Task, mark: int, refused_at: float) -> None:
        """The refusal cost the only participant its task: the training phase closed at
        once with zero results and the global model is bit-identical."""
        self.logged(mark, f"round {task.header.round} train: dropped {self.edge.edge_id} (bad upload")
        after = self.edge.next_task()
        assert time.monotonic() - refused_at < ROUND_TIMEOUT / 2, "closed by the deadline, not the drop"
        assert (after.header.round, after.header.phase) == (task.header.round, "evaluate")
        assert_bit_identical(after.globals, task.globals)
        assert after.header.common_id == task.header.common_id
        self.expected_rounds[task.header.round] = "dropped"

    def expect_task_kept(self, task: Task) -> Task:
        """The refusal did not cost the task: a valid upload of global + 1 is accepted and
        becomes the next global (the refused upload never reached the running sum).
        Returns the evaluation task that carries it."""
        upload = shifted(task.globals, 1.0)
        reply = self.edge.submit(train_messages(self.edge, task, upload))
        assert reply.accepted, reply.reason
        after = self.edge.next_task()
        assert (after.header.round, after.header.phase) == (task.header.round, "evaluate")
        assert_single_upload_mean(after.globals, upload)
        self.expected_rounds[task.header.round] = "accepted"
        return after


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    cluster = Cluster(tmp_path_factory.mktemp("bad-input"))
    edge = None
    try:
        # Resuming off: a stream that ends short (truncated, or cut by the transport's
        # cap) is then refused at once, as these cases expect; with it on, the server
        # holds it for the edge to resume and the drop comes at the expiry
        # (tests/test_resume_uploads.py).
        server = cluster.server("--method", "fedavg", "--model", "lenet-bn", "--rounds", str(ROUNDS),
                                "--min-edges", "1", "--quorum", "1",
                                "--round-timeout", str(ROUND_TIMEOUT),
                                "--transfer-resume-expiry", "0")
        edge = RawEdge(cluster.port)
        edge.connect()
        yield Suite(cluster, server, edge)
    finally:
        if edge is not None:
            edge.close()
        cluster.close()


# ---- join ----------------------------------------------------------------------------------


def test_join_with_a_known_id_and_another_secret_is_denied(suite):
    mark = suite.log_mark()
    with pytest.raises(grpc.RpcError) as err:
        suite.edge.join(edge_secret=secrets.token_hex(32))
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert suite.edge.edge_id in err.value.details() and "secret" in err.value.details()
    suite.logged(mark, "join refused", suite.edge.edge_id, "different secret")


def test_join_with_another_protocol_version_fails_precondition(suite):
    with pytest.raises(grpc.RpcError) as err:
        suite.edge.join(protocol_version=PROTOCOL_VERSION + 1)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "protocol version" in err.value.details()


def test_join_without_a_signed_upload_key_share_is_denied(suite):
    other = Ed25519PrivateKey.generate()
    _, share, foreign_proof = new_key_share(other, suite.edge.edge_id)
    for overrides in ({"upload_key_share": b"", "upload_key_proof": b""},
                      {"upload_key_share": share, "upload_key_proof": foreign_proof}):
        mark = suite.log_mark()
        with pytest.raises(grpc.RpcError) as err:
            suite.edge.join(**overrides)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert suite.edge.edge_id in err.value.details()
        assert "upload_key_share" in err.value.details()
        suite.logged(mark, "join refused", suite.edge.edge_id, "upload key share")


def test_refused_joins_left_the_session_alone(suite):
    # Neither refused join replaced the session: the edge still polls and uploads with it.
    task = suite.train_task()
    suite.expect_task_kept(task)


# ---- refusals that cost the edge its task ----------------------------------------------------

# Each builds the submit stream from (edge, task); the reply's reason must name every needle.
Builder = Callable[[RawEdge, Task], list[pb.SubmitMessage]]


def second_header(edge: RawEdge, task: Task) -> list[pb.SubmitMessage]:
    header, chunks = raw_layout(edge, task, shifted(task.globals, 1.0))
    return stream(header, chunks[:1]) + stream(header, chunks[1:])


def chunk_across_section_end(edge: RawEdge, task: Task) -> list[pb.SubmitMessage]:
    # fedavg uploads one section, so its end is the payload's: the last chunk runs past it.
    header, chunks = raw_layout(edge, task, shifted(task.globals, 1.0))
    return stream(header, [*chunks[:-1], chunks[-1] + b"\x00\x00\x00\x00"])


def chunk_after_the_end(edge: RawEdge, task: Task) -> list[pb.SubmitMessage]:
    header, chunks = raw_layout(edge, task, shifted(task.globals, 1.0))
    return stream(header, [*chunks, b"\x00\x00\x00\x00"])


def truncated(edge: RawEdge, task: Task) -> list[pb.SubmitMessage]:
    header, chunks = raw_layout(edge, task, shifted(task.globals, 1.0))
    assert len(chunks) > 2
    return stream(header, chunks[: len(chunks) // 2])  # then the client half-closes


def total_bytes_lie(edge: RawEdge, task: Task) -> list[pb.SubmitMessage]:
    header, chunks = raw_layout(edge, task, shifted(task.globals, 1.0))
    header.payload.total_bytes = 1 << 40
    return stream(header, chunks)


def oversized_tensor(edge: RawEdge, task: Task) -> list[pb.SubmitMessage]:
    # A manifest declaring a 4 TiB tensor: refused from the manifest, nothing allocated.
    header, chunks = raw_layout(edge, task, shifted(task.globals, 1.0))
    meta = next(t for t in header.payload.sections[0].tensors if t.name == TARGET)
    old = 4 * 120 * 256
    del meta.shape[:]
    meta.shape.extend([1 << 20, 1 << 20])
    header.payload.total_bytes += 4 * (1 << 40) - old
    return stream(header, chunks[:1])


def wrong_shape(edge: RawEdge, task: Task) -> list[pb.SubmitMessage]:
    tensors = shifted(task.globals, 1.0)
    tensors[TARGET] = tensors[TARGET].reshape(256, 120)
    return train_messages(edge, task, tensors)


def wrong_dtype(edge: RawEdge, task: Task) -> list[pb.SubmitMessage]:
    tensors = shifted(task.globals, 1.0)
    tensors[TARGET] = tensors[TARGET].to(torch.float64)
    return train_messages(edge, task, tensors)


def nan_value(edge: RawEdge, task: Task) -> list[pb.SubmitMessage]:
    tensors = shifted(task.globals, 1.0)
    tensors[TARGET][7, 11] = float("nan")
    return train_messages(edge, task, tensors)


def inf_value(edge: RawEdge, task: Task) -> list[pb.SubmitMessage]:
    tensors = shifted(task.globals, 1.0)
    tensors[TARGET][0, 0] = float("-inf")
    return train_messages(edge, task, tensors)


def undeclared_section(edge: RawEdge, task: Task) -> list[pb.SubmitMessage]:
    # fedavg declares SHARED_TENSORS only; STAT_VECTORS belongs to other methods.
    extra = Section(Kind.STAT_VECTORS, "", {"gsr": torch.ones(16)})
    encoded = encoded_train(shifted(task.globals, 1.0), (extra,))
    return stream(edge.header(task, encoded.manifest),
                  [chunk for _, chunk in payload_chunks(encoded, UPLOAD_CHUNK)])


def missing_tensor(edge: RawEdge, task: Task) -> list[pb.SubmitMessage]:
    tensors = shifted(task.globals, 1.0)
    del tensors[TARGET]
    return train_messages(edge, task, tensors)


def zero_examples(edge: RawEdge, task: Task) -> list[pb.SubmitMessage]:
    return train_messages(edge, task, shifted(task.globals, 1.0), num_examples=0)


def forged_signature(edge: RawEdge, task: Task) -> list[pb.SubmitMessage]:
    messages = train_messages(edge, task, shifted(task.globals, 1.0))
    edge.sign(messages, Ed25519PrivateKey.generate())  # not the key bound at join
    return messages


def altered_after_signing(edge: RawEdge, task: Task) -> list[pb.SubmitMessage]:
    messages = train_messages(edge, task, shifted(task.globals, 1.0))
    edge.sign(messages)
    messages[0].header.num_examples = 10 * NUM_EXAMPLES  # a relay rewrites the weight
    return messages


def body_altered_after_signing(edge: RawEdge, task: Task) -> list[pb.SubmitMessage]:
    messages = train_messages(edge, task, shifted(task.globals, 1.0))
    edge.sign(messages)
    data = bytearray(messages[1].data)
    data[0] ^= 0x01  # a relay (or the network) flips one bit of the body
    messages[1].data = bytes(data)
    return messages


def mac_under_another_key(edge: RawEdge, task: Task) -> list[pb.SubmitMessage]:
    # Signed with the right signing key, but the body MAC is under a key the server never
    # agreed to (what a man in the middle of the join could have given the edge).
    messages = train_messages(edge, task, shifted(task.globals, 1.0))
    edge.sign(messages, mac_key=secrets.token_bytes(32))
    return messages


DROPPING: list[tuple[str, Builder, tuple[str, ...]]] = [
    ("second-header", second_header, ("second header",)),
    ("chunk-across-section-end", chunk_across_section_end, ("crosses the end of section",)),
    ("chunk-after-the-end", chunk_after_the_end, ("beyond the declared payload",)),
    ("truncated", truncated, ("upload ended after",)),
    ("total-bytes-lie", total_bytes_lie, ("total_bytes",)),
    ("oversized-tensor", oversized_tensor, ("shape", TARGET, "[1048576, 1048576]")),
    ("wrong-shape", wrong_shape, ("shape", TARGET, "[256, 120]")),
    ("wrong-dtype", wrong_dtype, ("dtype", TARGET, "FLOAT64")),
    ("nan", nan_value, ("non-finite", TARGET)),
    ("inf", inf_value, ("non-finite", TARGET)),
    ("undeclared-section-kind", undeclared_section, ("section", "STAT_VECTORS", "schema")),
    ("missing-tensor", missing_tensor, ("tensor names", TARGET)),
    ("zero-examples", zero_examples, ("num_examples",)),
    ("forged-signature", forged_signature, ("signature does not verify",)),
    ("altered-after-signing", altered_after_signing, ("signature does not verify",)),
    ("body-altered-after-signing", body_altered_after_signing, ("signature does not verify",)),
    ("mac-under-another-key", mac_under_another_key, ("signature does not verify",)),
]


@pytest.mark.parametrize("build, reason", [pytest.param(b, r, id=i) for i, b, r in DROPPING])
def test_refusal_drops_the_task_and_leaves_the_global_bit_identical(suite, build, reason):
    edge = suite.edge
    task = suite.train_task()
    mark = suite.log_mark()
    reply = edge.submit(build(edge, task))
    refused_at = time.monotonic()
    suite.expect_refusal(reply, mark, edge.edge_id, *reason)
    suite.expect_dropped(task, mark, refused_at)


def test_message_over_the_transport_cap_is_refused_and_drops_the_task(suite):
    # One data message over gRPC's 4 MiB cap, from a channel without a send cap: the
    # transport refuses it, the service sees the upload end before its first byte.
    edge = suite.edge
    task = suite.train_task()
    header, chunks = raw_layout(edge, task, shifted(task.globals, 1.0))
    header.body_mac_iv = BodyMac.new_iv()  # unsigned: the transport refuses it first
    uncapped = grpc.insecure_channel(f"127.0.0.1:{suite.cluster.port}")
    try:
        mark = suite.log_mark()
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.FederatedLearningStub(uncapped).Submit(
                iter(stream(header, [b"".join(chunks) + bytes(MAX_MESSAGE_BYTES)])), timeout=30)
        refused_at = time.monotonic()
    finally:
        uncapped.close()
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    suite.logged(mark, f"submission from {edge.edge_id} refused", "upload ended after 0 of")
    suite.expect_dropped(task, mark, refused_at)


def eval_nan_loss(result: pb.EvaluationResult) -> None:
    result.loss_sum = float("nan")


def eval_per_class_counts_not_asked(result: pb.EvaluationResult) -> None:
    # A hostile edge sends its confusion matrix, whose row sums are its label histogram (what
    # every protocol-3 edge sent), to a server that runs without --eval-detail.
    result.counts.extend([9 if i // 10 == i % 10 else 1 for i in range(100)])


def eval_correct_over_total(result: pb.EvaluationResult) -> None:
    result.correct = result.total + 1


def eval_total_over_max_weight(result: pb.EvaluationResult) -> None:
    # A made-up total would outweigh every other edge in the pooled accuracy.
    result.total, result.correct = 1_000_001, 1_000_001


def eval_brier_over_two_per_sample(result: pb.EvaluationResult) -> None:
    result.brier_sum = 2.0 * result.total + 1.0


def eval_negative_loss(result: pb.EvaluationResult) -> None:
    result.loss_sum = -1.0


def eval_unknown_split(result: pb.EvaluationResult) -> None:
    result.split = "train"


def eval_bnrecal_not_asked(result: pb.EvaluationResult) -> None:
    # The BN-recalibrated diagnostic's split from a run that did not ask for it
    # (train.bn_recalibrated_eval is off).
    result.split = "test_bnrecal"


BAD_EVALUATIONS = [
    ("nan-loss", eval_nan_loss, "non-finite loss"),
    ("per-class-counts-not-asked", eval_per_class_counts_not_asked,
     "per-class counts were not asked for"),
    ("correct-over-total", eval_correct_over_total, "correct 181 is over total 180"),
    ("total-over-max-weight", eval_total_over_max_weight, "over --max-weight 1000000"),
    ("brier-over-2-per-sample", eval_brier_over_two_per_sample, "Brier sum 361 is outside"),
    ("negative-loss", eval_negative_loss, "loss sum -1 is not >= 0"),
    ("unknown-split", eval_unknown_split, "split 'train'"),
    ("bnrecal-split-not-asked", eval_bnrecal_not_asked, "split 'test_bnrecal'"),
    ("tensors-in-an-evaluation", None, "is not in method fedavg's upload schema"),
]


@pytest.mark.parametrize("spoil, reason", [pytest.param(f, r, id=i) for i, f, r in BAD_EVALUATIONS])
def test_bad_evaluation_drops_the_task_and_leaves_the_global_bit_identical(suite, spoil, reason):
    edge = suite.edge
    # The round's training result is valid; the evaluation that follows is not.
    task = suite.expect_task_kept(suite.train_task())
    messages = edge.evaluation(task)
    if spoil is None:
        encoded = encoded_train(task.globals)
        messages[0].header.payload.CopyFrom(encoded.manifest)
        messages += stream(None, [chunk for _, chunk in payload_chunks(encoded, UPLOAD_CHUNK)])
    else:
        spoil(messages[0].header.evaluation[0])
    mark = suite.log_mark()
    reply = edge.submit(messages)
    refused_at = time.monotonic()
    suite.expect_refusal(reply, mark, edge.edge_id, reason)
    suite.logged(mark, f"round {task.header.round} evaluate: dropped {edge.edge_id} (bad upload")
    after = edge.next_task()
    assert time.monotonic() - refused_at < ROUND_TIMEOUT / 2, "closed by the deadline, not the drop"
    assert (after.header.round, after.header.phase) == (task.header.round + 1, "train")
    assert_bit_identical(after.globals, task.globals)
    suite.expected_evaluations[task.header.round] = "dropped"


# ---- refusals that keep the task ------------------------------------------------------------


def data_before_header(suite: Suite, task: Task) -> list[pb.SubmitMessage]:
    header, chunks = raw_layout(suite.edge, task, shifted(task.globals, 100.0))
    return stream(None, chunks[:1]) + stream(header, chunks[1:])


def wrong_round(suite: Suite, task: Task) -> list[pb.SubmitMessage]:
    return train_messages(suite.edge, task, shifted(task.globals, 100.0), round=task.header.round - 1)


def future_round(suite: Suite, task: Task) -> list[pb.SubmitMessage]:
    return train_messages(suite.edge, task, shifted(task.globals, 100.0), round=task.header.round + 1)


def wrong_task_id(suite: Suite, task: Task) -> list[pb.SubmitMessage]:
    return train_messages(suite.edge, task, shifted(task.globals, 100.0),
                          task_id=task.header.task_id + 1000)


def wrong_phase(suite: Suite, task: Task) -> list[pb.SubmitMessage]:
    return train_messages(suite.edge, task, shifted(task.globals, 100.0), phase="evaluate")


def wrong_nonce(suite: Suite, task: Task) -> list[pb.SubmitMessage]:
    return train_messages(suite.edge, task, shifted(task.globals, 100.0), task_nonce=b"\x00" * 16)


def unknown_edge(suite: Suite, task: Task) -> list[pb.SubmitMessage]:
    return train_messages(suite.edge, task, shifted(task.globals, 100.0), edge_id=GHOST)


def bad_session(suite: Suite, task: Task) -> list[pb.SubmitMessage]:
    return train_messages(suite.edge, task, shifted(task.globals, 100.0), session="0" * 32)


def no_session(suite: Suite, task: Task) -> list[pb.SubmitMessage]:
    return train_messages(suite.edge, task, shifted(task.globals, 100.0), session="")


def wrong_protocol(suite: Suite, task: Task) -> list[pb.SubmitMessage]:
    return train_messages(suite.edge, task, shifted(task.globals, 100.0),
                          protocol_version=PROTOCOL_VERSION + 1)


def short_body_mac_iv(suite: Suite, task: Task) -> list[pb.SubmitMessage]:
    messages = train_messages(suite.edge, task, shifted(task.globals, 100.0))
    suite.edge.sign(messages)
    messages[0].header.body_mac_iv = b"\x00" * 8
    return messages


GHOST = f"ghost-{secrets.token_hex(4)}"
SELF = object()  # the suite's own edge id

KEEPING: list[tuple[str, Callable, object, tuple[str, ...]]] = [
    # data before the header: the server cannot know whose upload it is
    ("data-before-header", data_before_header, None, ("first message must be a header",)),
    ("stale-round", wrong_round, SELF, ("stale or wrong task", "round")),
    ("future-round", future_round, SELF, ("stale or wrong task", "round")),
    ("wrong-task-id", wrong_task_id, SELF, ("stale or wrong task", "task")),
    ("wrong-phase", wrong_phase, SELF, ("stale or wrong task", "phase 'evaluate'")),
    ("wrong-task-nonce", wrong_nonce, SELF, ("task nonce does not match",)),
    ("unknown-edge", unknown_edge, GHOST, ("unknown edge", GHOST)),
    ("bad-session", bad_session, SELF, ("session",)),
    ("no-session", no_session, SELF, ("session",)),
    ("wrong-protocol-version", wrong_protocol, SELF, ("protocol version",)),
    ("short-body-mac-iv", short_body_mac_iv, SELF, ("body_mac_iv must be 12 bytes",)),
]


@pytest.mark.parametrize("build, sender, reason",
                         [pytest.param(b, s, r, id=i) for i, b, s, r in KEEPING])
def test_refusal_keeps_the_task_and_never_reaches_the_sum(suite, build, sender, reason):
    edge = suite.edge
    task = suite.train_task()
    mark = suite.log_mark()
    reply = edge.submit(build(suite, task))
    if sender is None:
        # No header, no identity: the reply says why; the server logs nothing it could name.
        assert not reply.accepted and reason[0] in reply.reason, reply.reason
    else:
        suite.expect_refusal(reply, mark, edge.edge_id if sender is SELF else sender, *reason)
    assert f"dropped {edge.edge_id}" not in suite.server.log()[mark:]
    # The refused upload carried global + 100; the next global is the valid global + 1.
    suite.expect_task_kept(task)


# ---- duplicates ---------------------------------------------------------------------------------


def test_duplicate_submissions_are_refused_and_counted_once(suite):
    edge = suite.edge
    task = suite.train_task()
    # A second edge, connected but silent, keeps this round's evaluation open after our
    # own result, so a duplicate evaluation meets an open phase.
    other = RawEdge(suite.cluster.port, prefix="quiet")
    try:
        other.connect()
        upload = shifted(task.globals, 1.0)
        first = train_messages(edge, task, upload)
        reply = edge.submit(first)
        assert reply.accepted, reply.reason

        mark = suite.log_mark()
        reply = edge.submit(first)  # byte for byte the same upload again
        # With --quorum 1 the phase closes on the first result, so the second one meets a
        # closed (or already following) phase; any of these refusals keeps the sum intact.
        suite.expect_refusal(reply, mark, edge.edge_id)
        assert any(r in reply.reason for r in ("duplicate", "no phase is open", "stale or wrong task"))
        mark = suite.log_mark()
        reply = edge.submit(train_messages(edge, task, shifted(task.globals, 50.0)))
        suite.expect_refusal(reply, mark, edge.edge_id)

        evaluation = edge.next_task()
        assert (evaluation.header.round, evaluation.header.phase) == (task.header.round, "evaluate")
        # Counted once: a second copy of global + 1 would leave the mean alone, but the
        # global + 50 one would have moved it to global + 25.5.
        assert_single_upload_mean(evaluation.globals, upload)
        suite.expected_rounds[task.header.round] = "accepted"

        result = edge.evaluation(evaluation)
        reply = edge.submit(result)
        assert reply.accepted, reply.reason
        mark = suite.log_mark()
        reply = edge.submit(result)
        suite.expect_refusal(reply, mark, edge.edge_id, "duplicate submission",
                             f"task {evaluation.header.task_id}")

        other.leave()  # drops the silent edge's evaluation task: the round ends
        after = suite.train_task()
        assert after.header.round == task.header.round + 1
        assert_bit_identical(after.globals, evaluation.globals)
        # The round's checkpoint (history.json with it) is written while the next round's
        # tasks go out: wait for its record rather than read the file once.
        history = suite.cluster.tmp / "server-state" / "history.json"
        record = wait_for(lambda: next((r for r in json.loads(history.read_text())["rounds"]
                                        if r["round"] == task.header.round), None),
                          30, f"round {task.header.round}'s history record")
        assert record["evaluate"]["received"] == [edge.edge_id]
        assert other.edge_id in record["evaluate"]["dropped"]
    finally:
        other.close()


# ---- afterwards ---------------------------------------------------------------------------------


def test_history_matches_and_the_server_still_serves(suite):
    edge = suite.edge
    suite.train_task()  # completes the last scenario's round: its record goes to history.json
    path = suite.cluster.tmp / "server-state" / "history.json"
    last = max([*suite.expected_rounds, *suite.expected_evaluations])

    def written() -> dict | None:
        records = {r["round"]: r for r in json.loads(path.read_text())["rounds"]}
        return records if last in records else None

    records = wait_for(written, 30, f"round {last}'s history record")
    for round_number, outcome in sorted(suite.expected_rounds.items()):
        record = records[round_number]
        if outcome == "dropped":
            assert record["train"]["received"] == [], round_number
            assert record["train"]["dropped"][edge.edge_id].startswith("bad upload"), round_number
            assert record["aggregate"]["aggregated"] == 0, round_number
        else:
            assert record["train"]["received"] == [edge.edge_id], round_number
            assert record["aggregate"]["aggregated"] == 1, round_number
            assert record["aggregate"]["total_weight"] == NUM_EXAMPLES, round_number
    for round_number in sorted(suite.expected_evaluations):
        record = records[round_number]["evaluate"]
        assert record["received"] == [], round_number
        assert record["dropped"][edge.edge_id].startswith("bad upload"), round_number

    assert suite.server.popen.poll() is None, suite.server.log()[-3000:]
    health = health_pb2_grpc.HealthStub(edge.channel)
    status = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status
    assert status == health_pb2.HealthCheckResponse.SERVING
    log = suite.server.log()
    assert "Traceback" not in log and "Unexpected error" not in log, log[-3000:]
