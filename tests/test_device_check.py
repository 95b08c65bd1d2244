"""fl-edge's GPU check at start: the sentence an operator gets for each way a torch and a
GPU do not fit (CUDA's own error texts as the drivers print them), the compute-capability
rule, and on this GPU-less machine the real fl-edge refusing --device cuda with the reason
and --device auto saying why it trains on the CPU."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import REPO, write_edge_dirs

from fl_edge.device_check import arch_supported, cuda_problem, explain_cuda_error

#: torch.cuda.get_arch_list() of PyPI builds: 2.7.1 cu126 and a CUDA 13 build.
CU126 = ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"]
CU130 = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120", "compute_120"]


@pytest.mark.parametrize(("capability", "arch_list", "runs"), [
    ((8, 7), CU126, True),     # Jetson Orin on sm_80 kernels (same major, lower minor)
    ((8, 9), CU126, True),     # Ada (L4, RTX 40xx)
    ((7, 0), CU126, True),     # V100
    ((6, 0), CU126, True),     # P100
    ((7, 0), CU130, False),    # V100 under a CUDA 13 build: no kernels, no PTX below 12.0
    ((6, 1), CU130, False),    # Pascal GeForce
    ((10, 0), CU126, False),   # Blackwell B200 needs a CUDA 12.8+ build
    ((12, 1), CU130, True),    # sm_120 kernels run on 12.1
    ((12, 0), ["sm_90", "compute_90"], True),  # PTX of an older version JIT-compiles
    ((8, 0), ["sm_86"], False),  # kernels of a newer minor do not run on an older one
    ((9, 0), ["sm_90a"], True),
])
def test_which_gpu_a_build_runs_on(capability, arch_list, runs):
    assert arch_supported(capability, arch_list) is runs


def test_a_driver_too_old_is_named_with_what_to_install():
    # torch's message when the driver's CUDA is older than the runtime's (R535 = CUDA 12.2).
    message = ("The NVIDIA driver on your system is too old (found version 12020). Please update "
               "your GPU driver by downloading and installing a new version from the URL: ...")
    text = explain_cuda_error(message, "2.14.1+cu130", "13.0")
    assert "too old for torch 2.14.1+cu130 (built for CUDA 13.0)" in text
    assert "supports CUDA 12.2" in text and "R580" in text and "cuda12.txt" in text
    text = explain_cuda_error("CUDA driver version is insufficient for CUDA runtime version",
                              "2.7.1", "12.6")
    assert "too old" in text and "R525" in text


def test_no_driver_and_no_kernel_image_are_named():
    text = explain_cuda_error("Found no NVIDIA driver on your system. Please check that you have "
                              "an NVIDIA GPU and installed a driver", "2.5.0", "12.6")
    assert "no NVIDIA driver" in text and "--gpus all" in text and "--runtime nvidia" in text
    text = explain_cuda_error("CUDA error: no kernel image is available for execution on the "
                              "device", "2.14.1", "13.0")
    assert "no kernels for this GPU's compute capability" in text
    assert explain_cuda_error("CUDA error: out of memory\nmore", "2.5.0", "12.6") == (
        "CUDA does not work with torch 2.5.0 (built for CUDA 12.6): CUDA error: out of memory")


@pytest.fixture
def data(tmp_path):
    return write_edge_dirs(tmp_path, 1, per_edge=20)[0]


def fl_edge(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fl_edge", "--insecure", *args],
                          capture_output=True, text=True, timeout=120, cwd=REPO)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: tests/test_cuda.py covers it")
def test_device_cuda_without_a_usable_gpu_exits_2_with_the_reason(data, tmp_path):
    problem = cuda_problem()
    assert problem
    done = fl_edge("--server", "127.0.0.1:1", "--data-dir", str(data), "--device", "cuda",
                   "--state-dir", str(tmp_path / "state"))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == f"fl-edge: error: --device cuda: {problem}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: tests/test_cuda.py covers it")
def test_device_auto_says_in_one_line_why_it_trains_on_the_cpu(data, tmp_path):
    # No server listens on port 1: the edge retries; --retry-for 1 ends it after the log line.
    done = fl_edge("--server", "127.0.0.1:1", "--data-dir", str(data), "--retry-for", "1",
                   "--state-dir", str(tmp_path / "state"))
    lines = [line for line in done.stderr.splitlines() if "--device auto" in line]
    assert len(lines) == 1 and f"training on the CPU: {cuda_problem()}" in lines[0], done.stderr
    assert done.returncode == 1  # the unreachable server, not the device
