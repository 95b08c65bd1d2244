"""The device's own memory limits in training (``fl_edge.memory``): passes split to
--max-physical-batch give the batch's mean gradient, an out-of-memory error halves the pass
and retries the step (plain steps and DP-SGD), and DP-SGD takes --amp / --grad-accum as far
as Opacus allows instead of refusing the run."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import REPO
from test_dp import dp_config, make_method, split

from fedattn_shared.privacy.dp import PrivacyPolicy, PrivateTraining
from fedattn_shared.schema import TRAIN, Payload, Section
from fl_edge.memory import DeviceMemoryError, MemoryBackoff, micro_batches, out_of_memory
from fl_edge.options import EdgeOptions
from fl_edge.run import dp_loop_options
from fl_edge.trainer import train_local

CPU = torch.device("cpu")


@pytest.mark.parametrize("n,limit,start", [(16, 5, 0), (16, 8, 0), (17, 4, 3), (7, 7, 0),
                                           (64, 3, 10), (5, None, 0), (9, 2, 8)])
def test_parts_are_numpys_array_split_of_what_is_left(n, limit, start):
    parts = micro_batches(n, limit, start)
    rest = np.arange(start, n)
    expected = [rest] if limit is None or len(rest) <= limit else np.array_split(
        rest, -(-len(rest) // limit))
    assert [list(range(p.start, p.stop)) for p in parts] == [list(e) for e in expected]


def test_allocator_errors_are_recognised_and_others_are_not():
    assert out_of_memory(torch.OutOfMemoryError("CUDA out of memory"))
    assert out_of_memory(MemoryError())
    assert out_of_memory(RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: "
                                      "can't allocate memory: you tried to allocate 1 bytes"))
    assert not out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    backoff = MemoryBackoff()
    backoff.shrink(16, CPU)
    assert backoff.limit == 8
    backoff.shrink(8, CPU)
    backoff.shrink(5, CPU)  # a last part smaller than the limit: half of what was tried
    assert backoff.limit == 2 and backoff.backoffs == 3
    with pytest.raises(DeviceMemoryError, match="one sample"):
        MemoryBackoff(1).shrink(4, CPU)


def plain_edge(seed: int = 0, image_size: int = 28):
    """A FedAvg edge on a model whose samples are independent in training (GroupNorm, no
    dropout): splitting a batch changes its gradient's rounding only."""
    method = make_method("fedavg", dp=None, batch_size=16, image_size=image_size)
    method.dp = None
    torch.manual_seed(seed)
    return method.edge(method.build_models(), CPU)


def plain_edge_sized(image_size: int):
    """``plain_edge`` on larger images (the real memory limit's subprocess)."""
    return plain_edge(0, image_size)


class AllocatorLimit:
    """An allocator error injected at the first convolution (or, ``late``, at the last
    linear layer, after every layer before it ran and Opacus captured their activations): a
    pass over more than ``most`` samples raises torch.OutOfMemoryError as CUDA's caching
    allocator does, before the layer computes anything."""

    def __init__(self, model: torch.nn.Module, most: int, late: bool = False):
        self.most, self.failures = most, 0
        kind = torch.nn.Linear if late else torch.nn.Conv2d
        layers = [m for m in model.modules() if isinstance(m, kind)]
        (layers[-1] if late else layers[0]).register_forward_pre_hook(self)

    def __call__(self, module, inputs):
        if torch.is_grad_enabled() and inputs[0].shape[0] > self.most:
            self.failures += 1
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate a pass of "
                                         f"{inputs[0].shape[0]} samples")


def weights(algo) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in algo.models["model"].state_dict().items()}


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_out_of_memory_halves_the_pass_and_the_step_is_the_same(grad_accum, caplog):
    """16-sample batches on a device that fits 6: the pass is retried at 8 (fails), then 4.
    The run equals, bit for bit, one that split every batch into 4-sample parts from the
    start, and the unsplit run to float rounding; the limit is kept for later batches."""
    data = split(64)
    runs = {}
    for name, limit in (("whole", None), ("from the start", 4), ("backed off", None)):
        algo = plain_edge()
        memory = MemoryBackoff(limit)
        hook = AllocatorLimit(algo.models["model"], 6) if name == "backed off" else None
        with caplog.at_level(logging.WARNING, "fl_edge.memory"):
            result = train_local(algo, data, 2, 16, seed=3, device=CPU, progress=False,
                                 grad_accum=grad_accum, memory=memory)
        runs[name] = (weights(algo), result, memory, hook)
    (backed, result, memory, hook) = runs["backed off"]
    assert hook.failures == 2 and memory.limit == 4 and memory.backoffs == 2
    assert result.steps == runs["whole"][1].steps == 8 // grad_accum
    assert sum("out of memory" in r.getMessage() for r in caplog.records) == 2
    for key, value in runs["from the start"][0].items():
        assert torch.equal(backed[key], value), key
        assert torch.allclose(runs["whole"][0][key], value, rtol=1e-5, atol=1e-6), key
    assert result.mean_loss == pytest.approx(runs["whole"][1].mean_loss, rel=1e-5)


def test_one_sample_too_many_ends_with_a_device_memory_error():
    algo = plain_edge()
    AllocatorLimit(algo.models["model"], 0)
    with pytest.raises(DeviceMemoryError):
        train_local(algo, split(32), 1, 16, seed=0, device=CPU, progress=False)


def dp_run(limit_at_start: int, inject: int | None, device_limit: int = 0, late: bool = False):
    """One DP-SGD round with noise drawn from the seed (so two runs can be compared)."""
    method = make_method("fedavg", dp=dp_config(seeded_noise=True, max_physical_batch=limit_at_start),
                         batch_size=16)
    torch.manual_seed(0)
    algo = method.edge(method.build_models(), CPU)
    state = method.initial_state(algo.models)
    algo.receive(TRAIN, Payload([Section(k, n, t) for (k, n), t in state.items()]), Payload())
    privacy = PrivateTraining(algo, method.dp, 64, 16, policy=PrivacyPolicy(allow_seeded_noise=True),
                              max_physical_batch=device_limit)
    privacy.begin_phase(5, "train")
    hook = AllocatorLimit(algo.models["model"], inject, late) if inject else None
    memory = MemoryBackoff()
    result = train_local(algo, split(64), 1, 16, seed=5, device=CPU, progress=False,
                         privacy=privacy, memory=memory)
    return weights(algo), result, privacy.end_round(1), memory, hook


@pytest.mark.parametrize("late", [False, True])
def test_dp_sgd_backs_off_within_the_logical_batch(late):
    """Under DP-SGD a physical batch that runs out of memory is split further within its
    logical batch: each part's per-sample gradients are clipped into the sum, the noise and
    the step come once per logical batch. Bit for bit the run of a device that bounded its
    physical batches at the learned size from the start; the unsplit run to rounding."""
    start, whole = dp_run(0, None, device_limit=3), dp_run(0, None)
    backed = dp_run(0, 3, late=late)
    assert backed[3].limit < 4 and backed[4].failures >= 1
    assert backed[2]["dp_steps"] == whole[2]["dp_steps"] == start[2]["dp_steps"] == 4
    server = dp_run(3, None)
    learned = dp_run(0, None, device_limit=backed[3].limit)
    for key, value in whole[0].items():
        assert torch.equal(backed[0][key], learned[0][key]), key
        assert torch.equal(start[0][key], server[0][key]), key  # device limit == server's
        assert torch.allclose(backed[0][key], value, rtol=1e-5, atol=1e-6), key
        assert torch.allclose(start[0][key], value, rtol=1e-5, atol=1e-6), key


def test_dp_sgd_takes_accumulation_as_physical_batches_and_sets_amp_aside(caplog, tmp_path):
    opts = EdgeOptions(server="x", data_dir=tmp_path, state_dir=tmp_path, amp=True, grad_accum=4)
    with caplog.at_level(logging.WARNING, "fl_edge"):
        assert dp_loop_options(True, opts, 32) == (False, 1, 8)
    assert len(caplog.records) == 1
    assert "--grad-accum 4" in caplog.text and "--amp is set aside" in caplog.text
    opts.max_physical_batch = 5
    assert dp_loop_options(True, opts, 32) == (False, 1, 5)  # the stricter wins
    assert dp_loop_options(False, opts, 32) == (True, 4, 5)  # no DP: as given


REAL_LIMIT = """
import ctypes, json, resource, sys, torch
# Large blocks always mapped and unmapped (glibc would raise its mmap threshold after the
# first frees and keep them in the heap), so the address space measured is what is held.
LIBC = ctypes.CDLL("libc.so.6")
LIBC.mallopt(-3, 1 << 17)  # M_MMAP_THRESHOLD, fixed
sys.path.insert(0, "tests")
from test_edge_memory import plain_edge_sized, weights
from fedattn_shared.data.npz import Split
from fl_edge.memory import MemoryBackoff
from fl_edge.trainer import train_local

def vm(key):
    return int(dict(l.split(":", 1) for l in open("/proc/self/status"))[key].split()[0]) * 1024

CPU = torch.device("cpu")
g = torch.Generator().manual_seed(0)
data = Split(torch.randn(256, 1, 96, 96, generator=g), torch.randint(0, 10, (256,), generator=g))
probe = plain_edge_sized(96)  # warms the libraries up, then measures a 128-sample step
train_local(probe, Split(data.x[:16], data.y[:16]), 1, 8, seed=1, device=CPU, progress=False)
before = vm("VmSize")
train_local(probe, Split(data.x[:128], data.y[:128]), 1, 128, seed=1, device=CPU, progress=False)
need = vm("VmPeak") - before
del probe
LIBC.malloc_trim(0)
resource.setrlimit(resource.RLIMIT_AS, (vm("VmSize") + int(0.7 * need), resource.RLIM_INFINITY))
algo, memory = plain_edge_sized(96), MemoryBackoff()
train_local(algo, data, 1, 128, seed=1, device=CPU, progress=False, memory=memory)
resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
runs = {}
for name, limit in (("from the start", memory.limit), ("whole", None)):
    runs[name] = plain_edge_sized(96)
    train_local(runs[name], data, 1, 128, seed=1, device=CPU, progress=False,
                memory=MemoryBackoff(limit))
a, b, c = weights(algo), weights(runs["from the start"]), weights(runs["whole"])
print(json.dumps({"need": need, "limit": memory.limit, "backoffs": memory.backoffs,
                  "equal": all(torch.equal(a[k], b[k]) for k in a),
                  "close": all(torch.allclose(a[k], c[k], rtol=1e-5, atol=1e-5) for k in a)}))
"""


def test_a_real_memory_limit_backs_off_instead_of_crashing():
    """A real allocator failure: the process's address space is capped (RLIMIT_AS) at what
    it holds plus 70 % of what a 128-sample step was measured to need, so the CPU
    allocator refuses the step ("can't allocate memory"). The edge halves its pass until it
    fits, and the weights are bit for bit those of a run that started at the learned limit,
    and the unsplit run's to rounding."""
    result = subprocess.run([sys.executable, "-c", REAL_LIMIT], capture_output=True, text=True,
                            timeout=600, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["backoffs"] >= 1 and figures["limit"] <= 64, figures
    assert "can't allocate memory" not in result.stdout
    assert "out of memory on cpu with 128 samples per pass" in result.stderr
    assert figures["equal"] and figures["close"], figures
