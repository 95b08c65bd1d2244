"""The GPU check at fl-edge's start: one CUDA operation, and a sentence that names what
stands between this torch and this GPU (no driver, a driver too old for the torch's
CUDA, a GPU generation the build has no kernels for) instead of a CUDA error in the
first round or a silent fall back to the CPU.

Why it is needed: a torch that cannot use the device still imports and still reports
``cuda.is_available()`` in some of these cases (a compute capability without kernels
fails only at the first kernel launch, "no kernel image is available"), and an edge that
trains on the CPU of a GPU box is 10-50x slower with nothing in its log saying so.
"""

from __future__ import annotations

import logging
import re

import torch

from .options import EdgeExit

log = logging.getLogger("fl_edge")

#: The oldest NVIDIA driver branch for each CUDA major version (CUDA's minor version
#: compatibility: any 12.x runtime on R525+, any 13.x on R580+).
DRIVER_FOR_CUDA = {11: "R450", 12: "R525", 13: "R580"}


def _cuda_version(version: str | None) -> tuple[int, int] | None:
    match = re.match(r"(\d+)\.(\d+)", version or "")
    return (int(match[1]), int(match[2])) if match else None


def explain_cuda_error(message: str, torch_version: str, torch_cuda: str | None) -> str:
    """The operator's sentence for a CUDA initialisation or launch error of this torch."""
    build = f"torch {torch_version} (built for CUDA {torch_cuda})"
    cuda = _cuda_version(torch_cuda)
    need = DRIVER_FOR_CUDA.get(cuda[0], "a newer driver") if cuda else "a newer driver"
    found = re.search(r"found version (\d+)", message)
    if found or "driver version is insufficient" in message or "too old" in message:
        supports = ""
        if found:
            value = int(found[1])
            supports = f" (it supports CUDA {value // 1000}.{value % 1000 // 10})"
        return (f"the NVIDIA driver is too old for {build}{supports}: install driver {need} or "
                f"newer, or a torch built for the driver's CUDA (deploy/constraints/cuda12.txt "
                f"for CUDA 12 drivers; docs/operations.md, GPU boxes)")
    if "no NVIDIA driver" in message or "Found no NVIDIA driver" in message:
        return (f"no NVIDIA driver found for {build}: on the host install it; in a container "
                "run with --gpus all (Docker) or --runtime nvidia (Jetson)")
    if "no kernel image" in message:
        return (f"{build} has no kernels for this GPU's compute capability "
                f"({', '.join(torch.cuda.get_arch_list()) if torch_cuda else '-'}): install the "
                "build for its generation (docs/operations.md, GPU boxes)")
    return f"CUDA does not work with {build}: {message.strip().splitlines()[0]}"


def arch_supported(capability: tuple[int, int], arch_list: list[str]) -> bool:
    """Whether a build with ``arch_list`` (``torch.cuda.get_arch_list()``: ``sm_XY``
    kernels and ``compute_XY`` PTX) runs on a GPU of ``capability``: kernels of the same
    major version and a lower or equal minor one run on it, PTX of a lower or equal
    version is compiled for it by the driver."""
    major, minor = capability
    for arch in arch_list:
        kind, _, digits = arch.partition("_")
        digits = digits.rstrip("af")  # sm_90a, sm_100f: family/architecture-specific
        if not digits.isdigit():
            continue
        version = (int(digits[:-1]), int(digits[-1]))
        if kind == "sm" and version[0] == major and version[1] <= minor:
            return True
        if kind == "compute" and version <= capability:
            return True
    return False


def cuda_problem() -> str | None:
    """Why CUDA cannot run here, or None once one operation on GPU 0 succeeded."""
    version, cuda = torch.__version__, torch.version.cuda
    if cuda is None:
        return f"torch {version} is a build without CUDA"
    try:
        torch.cuda.init()
    except (RuntimeError, AssertionError) as err:
        return explain_cuda_error(str(err), version, cuda)
    if torch.cuda.device_count() == 0:
        return f"no CUDA device is visible to torch {version} (CUDA_VISIBLE_DEVICES?)"
    capability = torch.cuda.get_device_capability(0)
    name = torch.cuda.get_device_name(0)
    arch_list = torch.cuda.get_arch_list()
    if not arch_supported(capability, arch_list):
        return (f"{name} is sm_{capability[0]}{capability[1]}, and torch {version} (CUDA "
                f"{cuda}) has kernels for {' '.join(arch_list)} only: install the build for "
                "its generation (docs/operations.md, GPU boxes)")
    try:
        value = (torch.ones(4, device="cuda") * 2).sum().item()  # one kernel launch and a copy back
    except RuntimeError as err:
        return explain_cuda_error(str(err), version, cuda)
    if value != 8.0:
        return f"a CUDA operation on {name} returned {value} instead of 8.0"
    return None


def startup_device(requested: str) -> str:
    """``--device``, checked at start: ``cuda`` that cannot work ends the edge (status 2,
    the reason named); ``auto`` falls back to the CPU with the reason on one log line."""
    if requested == "cpu":
        return "cpu"
    problem = cuda_problem()
    if problem is None:
        capability = torch.cuda.get_device_capability(0)
        log.info("GPU: %s (sm_%d%d), torch %s, CUDA %s", torch.cuda.get_device_name(0),
                 *capability, torch.__version__, torch.version.cuda)
        return "cuda"
    if requested == "cuda":
        raise EdgeExit(2, f"--device cuda: {problem}")
    # A CPU-only torch on a CPU box is the expected case, not a warning.
    (log.info if torch.version.cuda is None else log.warning)(
        "--device auto: training on the CPU: %s", problem)
    return "cpu"
