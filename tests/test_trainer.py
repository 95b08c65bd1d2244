"""The generic local training loop: schedules, gradient accumulation, mixed precision."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from fedattn_shared.config import ConfigError, TrainConfig
from fedattn_shared.data.npz import Split
from fedattn_shared.methods import MethodContext, load_method
from fedattn_shared.wire.transport import payload_chunks
from fl_edge.trainer import ShuffledBatches, evaluate, train_local


def test_lr_schedules_by_hand():
    cosine = TrainConfig(lr=0.1, lr_schedule="cosine", lr_min=0.01)
    assert cosine.lr_at(1, 5) == pytest.approx(0.1)
    assert cosine.lr_at(3, 5) == pytest.approx(0.01 + 0.5 * 0.09 * (1 + math.cos(math.pi / 2)))
    assert cosine.lr_at(5, 5) == pytest.approx(0.01)
    step = TrainConfig(lr=0.1, lr_schedule="step", lr_step_rounds=2, lr_gamma=0.5)
    assert [step.lr_at(r, 9) for r in (1, 2, 3, 4, 5)] == pytest.approx([0.1, 0.1, 0.05, 0.05, 0.025])
    assert TrainConfig(lr=0.1).lr_at(7, 9) == 0.1
    with pytest.raises(ConfigError, match="lr_schedule"):
        TrainConfig(lr_schedule="linear").validate()


def make(method="fedavg", **kwargs):
    cls = load_method(method)
    m = cls(MethodContext(TrainConfig(**kwargs), cls.Params()))
    return m.edge(m.build_models(), torch.device("cpu"))


def data(n=40):
    g = torch.Generator().manual_seed(0)
    return Split(torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g))


@pytest.mark.parametrize("n, batch_size", [(40, 8), (33, 8), (17, 16), (5, 32), (64, 64)])
def test_shuffled_batches_are_the_dataloaders_batches(n, batch_size):
    """The loop's batches (one gather each) are, batch for batch and epoch after epoch, what
    DataLoader(TensorDataset, shuffle=True) gave with the same generator, so a seed trains
    on the same batches as before; a last batch of one sample is dropped by both."""
    from torch.utils.data import DataLoader, TensorDataset

    split = data(n)
    drop_last = n % batch_size == 1
    ours = ShuffledBatches(split, batch_size, torch.Generator().manual_seed(3), drop_last)
    g = torch.Generator().manual_seed(3)
    theirs = DataLoader(TensorDataset(split.x, split.y), batch_size=batch_size, shuffle=True,
                        generator=g, num_workers=0, drop_last=drop_last)
    for _ in range(3):  # the generator carries on from epoch to epoch in both
        a, b = list(ours), list(theirs)
        assert len(a) == len(b) == len(ours) == len(theirs)
        for (xa, ya), (xb, yb) in zip(a, b, strict=True):
            assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert torch.equal(ours.generator.get_state(), g.get_state())


def test_determinism_is_switched_without_importing_the_compiler():
    """configure_determinism sets what torch.use_deterministic_algorithms(warn_only=True)
    sets, without importing torch._inductor (and torch._dynamo: seconds at every edge's
    first join). In a fresh interpreter, since this one may have imported it already."""
    code = ("import sys, torch; from fl_edge.trainer import configure_determinism; "
            "configure_determinism(True, 0); "
            "assert torch.are_deterministic_algorithms_enabled(); "
            "assert torch.is_deterministic_algorithms_warn_only_enabled(); "
            "assert 'torch._inductor' not in sys.modules and 'torch._dynamo' not in sys.modules; "
            "import os; assert os.environ['CUBLAS_WORKSPACE_CONFIG'] == ':4096:8'; "
            "configure_determinism(False, 0); "
            "assert not torch.are_deterministic_algorithms_enabled()")
    env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, env=env)
    assert result.returncode == 0, result.stderr[-2000:]


def test_round_learning_rate_and_accumulation_steps():
    algo = make()
    result = train_local(algo, data(40), epochs=2, batch_size=8, seed=0, device=torch.device("cpu"),
                         progress=False, lr=0.123, grad_accum=2)
    # 5 batches per epoch -> 3 optimizer steps per epoch (2 + 2 + 1).
    assert result.steps == 6 and result.examples == 80
    assert algo.optimizers()[0].param_groups[0]["lr"] == 0.123


def test_accumulated_step_equals_one_big_batch_step():
    """Without BatchNorm statistics in play (eval-mode BN), 2 x 8 accumulated = 1 x 16."""
    torch.manual_seed(0)
    a, b = make(), make()
    b.models["model"].load_state_dict(a.models["model"].state_dict())
    d = data(16)
    for algo in (a, b):
        algo.train_mode = algo.eval_mode  # freeze BN so both see the same normalisation
    train_local(a, d, 1, 16, 0, torch.device("cpu"), False, lr=0.1, grad_accum=1)
    train_local(b, d, 1, 8, 0, torch.device("cpu"), False, lr=0.1, grad_accum=2)
    for (name, pa), pb in zip(a.models["model"].named_parameters(), b.models["model"].parameters(),
                              strict=True):
        assert torch.allclose(pa, pb, atol=1e-6), name


def test_amp_on_cpu_trains_and_evaluates():
    algo = make()
    result = train_local(algo, data(32), 1, 16, 0, torch.device("cpu"), False, amp=True)
    assert math.isfinite(result.mean_loss) and result.steps == 2
    counts = evaluate(algo, data(32), "test", 10, 8, torch.device("cpu"))
    assert counts.total == 32 and counts.confusion.shape == (10, 10)


def test_batches_in_order_never_end_with_a_single_sample():
    from fl_edge.trainer import _batches

    data = Split(torch.arange(9.0).view(9, 1, 1, 1), torch.arange(9))
    sizes = [len(y) for _, y in _batches(data, 4, torch.device("cpu"))]
    assert sizes == [4, 5]  # 4 + 4 + 1 -> the lone sample joins the batch before it
    assert torch.cat([y for _, y in _batches(data, 4, torch.device("cpu"))]).tolist() == list(range(9))
    assert [len(y) for _, y in _batches(data, 3, torch.device("cpu"))] == [3, 3, 3]
    one = Split(torch.zeros(1, 1, 1, 1), torch.zeros(1, dtype=torch.int64))
    assert [len(y) for _, y in _batches(one, 4, torch.device("cpu"))] == [1]


def test_train_and_eval_mode_reach_every_module_even_when_one_differs():
    algo = make()
    model = algo.models["model"]
    algo.train_mode()
    assert all(m.training for m in model.modules())
    algo.train_mode()  # already training throughout: nothing to change
    assert all(m.training for m in model.modules())
    batchnorm = next(m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d))
    batchnorm.eval()  # one module left in eval mode (as an evaluation pass leaves it)
    algo.train_mode()
    assert batchnorm.training and all(m.training for m in model.modules())
    batchnorm.train()
    model.training = False  # only the root differs
    algo.eval_mode()
    assert not any(m.training for m in model.modules())
    batchnorm.train()
    algo.eval_mode()
    assert not batchnorm.training


def receive_random_downlink(algo) -> None:
    """Sends random shared tensors through encode/decode into ``algo`` and checks that each
    landed in its own tensor."""
    from fedattn_shared.schema import Kind, Payload, Section
    from fedattn_shared.wire.serialize import decode, encode

    sent = {name: torch.randn(algo.live_tensor(name).shape) for name in algo.shared_specs}
    encoded = encode(Payload([Section(Kind.SHARED_TENSORS, "", sent)]))
    received = decode(encoded.manifest, bytearray(b"".join(c for _, c in payload_chunks(encoded))))
    algo.receive("train", received, Payload())
    for name, value in sent.items():
        assert torch.equal(algo.live_tensor(name), value), name


def test_shared_tensors_live_in_one_vector_that_loads_and_trains_in_place():
    from fedattn_shared.schema import Kind
    from fedattn_shared.tensors import contiguous_run
    from fedattn_shared.wire.serialize import decode, encode

    algo = make()
    shared = [algo.live_tensor(name) for name in algo.shared_specs]
    run = contiguous_run(shared)
    assert run is not None and run.numel() == sum(t.numel() for t in shared)
    # Parameters kept their identity: the modules and the optimizer hold the same objects.
    params = dict(algo.models["model"].named_parameters())
    assert all(algo.live_tensor(f"model/{k}") is p for k, p in params.items()
               if f"model/{k}" in algo.shared_specs)
    receive_random_downlink(algo)  # in one copy; every tensor gets its own values
    # Training updates the parameters, so the upload (read as the one vector) changes.
    before = run.clone()
    split = Split(torch.randn(8, 1, 28, 28), torch.arange(8) % 10)
    train_local(algo, split, 1, 4, 1, torch.device("cpu"), False, lr=0.1)
    assert not torch.equal(run, before)
    upload = algo.after_train(1)
    encoded = encode(upload)
    assert len(encoded.section_views[0]) == 1
    back = decode(encoded.manifest, bytearray(b"".join(c for _, c in payload_chunks(encoded))))
    for name in algo.shared_specs:
        assert torch.equal(back.tensors(Kind.SHARED_TENSORS)[name], algo.live_tensor(name))


def test_a_replaced_parameter_still_loads():
    algo = make()
    name = next(iter(algo.shared_specs))
    algo.live_tensor(name).data = torch.zeros_like(algo.live_tensor(name))  # out of the vector
    receive_random_downlink(algo)


def _two_rounds(algo, fresh_before_second: bool = False) -> dict[str, torch.Tensor]:
    """Two rounds of local training on the same algorithm object (as an edge keeps it), the
    second from the first's end; ``fresh_before_second`` builds a new optimizer between them."""
    train_local(algo, data(40), 1, 8, 0, torch.device("cpu"), False)
    if fresh_before_second:
        algo._optimizers = None  # what a brand-new torch.optim object would start from
    train_local(algo, data(40), 1, 8, 1, torch.device("cpu"), False)
    return {k: v.clone() for k, v in algo.models["model"].state_dict().items()}


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_each_round_starts_a_fresh_optimizer_by_default(optimizer):
    """The papers restart their local optimizer every round (issue #44 item 2): by default
    the second round is bit-identical to one stepped by a newly built optimizer, and with
    ``optimizer_state = "carry"`` it is not (the momentum / moments of round one act)."""
    settings = {"optimizer": optimizer, "momentum": 0.9 if optimizer == "sgd" else 0.0,
                "lr": 0.05 if optimizer == "sgd" else 0.001}
    torch.manual_seed(0)
    reset = _two_rounds(make(**settings))
    torch.manual_seed(0)
    fresh = _two_rounds(make(**settings), fresh_before_second=True)
    torch.manual_seed(0)
    carried = _two_rounds(make(optimizer_state="carry", **settings))
    assert TrainConfig().optimizer_state == "reset"
    for name in reset:
        assert torch.equal(reset[name], fresh[name]), name
    assert any(not torch.equal(reset[k], carried[k]) for k in reset if reset[k].is_floating_point())
