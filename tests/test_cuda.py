"""Edges on a CUDA device: the same training as on the CPU, mixed precision, and a
federation whose edges train on the GPU. Skipped without a CUDA device (CI has none; run
these on a GPU box)."""

from __future__ import annotations

import copy

import pytest
import torch
from test_method_matrix import run_federation

from fedattn_shared.config import TrainConfig
from fedattn_shared.data.npz import Split
from fedattn_shared.methods import MethodContext, load_method
from fedattn_shared.schema import Kind
from fl_edge.trainer import evaluate, train_local

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA device (run on a GPU box)")
CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def fedsap_edges(stats_mode: str = "train"):
    cls = load_method("fedsap")
    method = cls(MethodContext(TrainConfig(model="se-cnn", lr=0.05), cls.Params(stats_mode=stats_mode)))
    models = method.build_models()
    return method.edge(copy.deepcopy(models), CPU), method.edge(models, CUDA)


def data(n: int = 64) -> Split:
    generator = torch.Generator().manual_seed(0)
    return Split(torch.randn(n, 1, 28, 28, generator=generator),
                 torch.randint(0, 10, (n,), generator=generator))


@pytest.fixture
def exact_float32():
    """cuDNN and cuBLAS use TF32 for float32 by default on Ampere and later (about 1e-3
    relative error): off for comparisons with the CPU."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.mark.parametrize("stats_mode", ["train", "eval"])
def test_fedsap_epoch_on_cuda_matches_the_cpu(stats_mode, exact_float32):
    cpu, gpu = fedsap_edges(stats_mode)
    for edge in (cpu, gpu):
        edge.target = {k: torch.full_like(v, 0.1) for k, v in edge.target.items()}
        edge.has_target = True
        train_local(edge, data(), 1, 16, seed=0, device=edge.device, progress=False)
    for (name, a), (_, b) in zip(cpu.models["model"].state_dict().items(),
                                 gpu.models["model"].state_dict().items(), strict=True):
        assert b.is_cuda
        assert torch.allclose(a, b.cpu(), atol=1e-4, rtol=1e-3), name
    for name in cpu.own_stats:  # the statistics pass ran on the device too
        assert torch.allclose(cpu.own_stats[name], gpu.own_stats[name].cpu(), atol=1e-4)
    assert gpu.training_metrics()["gsr_loss"] == pytest.approx(
        cpu.training_metrics()["gsr_loss"], rel=1e-3)


def test_data_on_the_device_trains_exactly_as_data_copied_per_batch(exact_float32):
    """fl-edge --data-on-device: the batches gathered on the GPU are the batches copied from
    the host, so the same seed gives the same weights (to cuDNN's own run-to-run spread:
    some of its backward kernels add in no fixed order)."""
    _, host = fedsap_edges()
    _, device = fedsap_edges()
    device.models["model"].load_state_dict(host.models["model"].state_dict())
    split = data(96)
    train_local(host, split, 2, 16, seed=3, device=CUDA, progress=False)
    train_local(device, split.to(CUDA), 2, 16, seed=3, device=CUDA, progress=False)
    for (name, a), (_, b) in zip(host.models["model"].state_dict().items(),
                                 device.models["model"].state_dict().items(), strict=True):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4), name


def test_mixed_precision_on_cuda_trains_with_fp32_weights():
    _, gpu = fedsap_edges()
    split = data(128)
    before = evaluate(gpu, split, "train", 10, 64, CUDA).loss_sum
    for epoch in range(5):
        result = train_local(gpu, split, 1, 32, seed=epoch, device=CUDA, progress=False, amp=True)
        assert result.steps == 4
    assert all(p.dtype == torch.float32 for p in gpu.models["model"].parameters())
    assert evaluate(gpu, split, "train", 10, 64, CUDA).loss_sum < before


def test_federation_with_edges_training_on_cuda(tmp_path):
    received, engine = run_federation(tmp_path, "fedsap", model="se-cnn", rounds=2, device="cuda")
    assert len(received) == 4
    stats = engine.aggregator.state[(Kind.STAT_VECTORS, "gsr")]
    assert all(not v.is_cuda and torch.isfinite(v).all() for v in stats.values())
    summary = engine.history["rounds"][-1]["evaluation"]["summary"]["test"]
    assert summary["mean_accuracy"] > 0


def test_edge_exports_gpu_memory_after_training_on_cuda():
    from prometheus_client import CollectorRegistry

    from fl_edge.metrics import EdgeMetrics
    from fl_edge.trainer import TrainResult

    registry = CollectorRegistry()
    metrics = EdgeMetrics(registry)
    device = torch.device("cuda")
    torch.cuda.reset_peak_memory_stats(device)
    block = torch.empty(64 << 20, dtype=torch.uint8, device=device)
    metrics.observe_training(TrainResult(steps=1, examples=10, mean_loss=0.0, last_epoch_loss=0.0,
                                         seconds=1.0), device)
    labels = {"device": str(device)}
    assert registry.get_sample_value("fedattn_edge_gpu_memory_peak_bytes", labels) >= block.numel()
    assert registry.get_sample_value("fedattn_edge_gpu_memory_reserved_bytes", labels) >= block.numel()
    assert registry.get_sample_value("fedattn_edge_samples_per_second") == 10


def test_a_deterministic_cuda_run_repeats_bit_for_bit():
    """train.deterministic on CUDA as the edge applies it (``configure_determinism`` strict:
    deterministic algorithms without warn_only, no cuDNN autotuning, a fixed cuBLAS
    workspace): the same seed on the same device gives the same weights to the bit (se-cnn's
    pooling is global, a mean: no op refuses). In a fresh interpreter, so that the cuBLAS
    workspace setting is in place before the first cuBLAS handle."""
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from fl_edge.trainer import configure_determinism, train_local\n"
        "from test_cuda import data, fedsap_edges\n"
        "configure_determinism(True, 0, strict=True)\n"
        "assert not torch.is_deterministic_algorithms_warn_only_enabled()\n"
        "_, first = fedsap_edges()\n"
        "_, second = fedsap_edges()\n"
        "second.models['model'].load_state_dict(first.models['model'].state_dict())\n"
        "for edge in (first, second):\n"
        "    train_local(edge, data(128), 2, 16, seed=5, device=edge.device, progress=False)\n"
        "pairs = zip(first.models['model'].state_dict().items(),\n"
        "            second.models['model'].state_dict().items(), strict=True)\n"
        "differ = [n for (n, a), (_, b) in pairs if not torch.equal(a, b)]\n"
        "assert not differ, differ\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300, cwd=str(__import__("pathlib").Path(__file__).parent))
    assert result.returncode == 0, result.stderr[-3000:]


def test_strict_determinism_refuses_an_op_without_a_deterministic_kernel():
    """AlexNet-BN's 6x6 adaptive average pool has no deterministic CUDA backward: in strict
    mode torch raises naming it (the edge then exits 2 with the way out), where warn-only
    would have trained on without repeating."""
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from fl_edge.trainer import configure_determinism\n"
        "configure_determinism(True, 0, strict=True)\n"
        "x = torch.randn(2, 3, 13, 13, device='cuda', requires_grad=True)\n"
        "try:\n"
        "    torch.nn.AdaptiveAvgPool2d((6, 6))(x).sum().backward()\n"
        "except RuntimeError as err:\n"
        "    assert 'does not have a deterministic implementation' in str(err), err\n"
        "else:\n"
        "    raise SystemExit('no error')\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
