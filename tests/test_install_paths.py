"""The device's torch survives `pip install .`: each platform's constraints file
(deploy/constraints/) resolved by the real pip against the real package index, in a venv
that holds only stub dist-infos of the torch and torchvision the device already has.

A Jetson's torch is NVIDIA's build for its integrated GPU and an older driver's x86 box
needs a CUDA 12 build; a PyPI torch pulled in by a dependency (opacus 1.6 requires
torch>=2.6) replaces it with a build the device cannot run, and the install still succeeds.
No GPU is needed to catch that: pip's resolution (`--dry-run --report`) says what it would
install. The stubs are METADATA and RECORD only, so pip sees the packages installed; they
carry no Requires-Dist, because torch's own dependencies came with the device's torch.

The resolution runs on this machine's platform (x86_64), with Python 3.10 (JetPack 6's)
when it is available: which torch wheel pip would pick differs on aarch64, whether it
wants one at all does not. The machine's own pip configuration (PIP_CONFIG_FILE, which
may cap torch) is switched off, so a cap outside the repository cannot make this pass.
Skips when the package index cannot be reached; downloads are cached in a temporary
folder shared by the tests of this module, never in the repository."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from conftest import REPO

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10 (JetPack 6)
    import tomli as tomllib

CONSTRAINTS = REPO / "deploy" / "constraints"
#: Packages that are the device's GPU stack: the install must bring none of them.
DEVICE_STACK = re.compile(r"^(torch|torchvision|torchaudio|triton|nvidia-.*)$")
INDEX = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _python310() -> str:
    """JetPack 6's Python when this machine has it (on PATH or under pyenv), else ours."""
    candidates = [shutil.which("python3.10"),
                  *sorted(str(p) for p in Path.home().glob(".pyenv/versions/3.10*/bin/python3.10"))]
    for candidate in filter(None, candidates):
        if subprocess.run([candidate, "-c", ""], capture_output=True).returncode == 0:
            return candidate
    return sys.executable


@pytest.fixture(scope="module")
def index_reachable() -> None:
    try:
        urllib.request.urlopen(f"{INDEX}/opacus/", timeout=15).close()
    except OSError as err:
        pytest.skip(f"the package index {INDEX} is unreachable: {err}")


@pytest.fixture(scope="module")
def pip_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("pip-cache")


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """The real pyproject.toml and README with its packages as empty folders: pip builds the
    project's metadata (its dependencies) from them without writing into the checkout."""
    root = tmp_path_factory.mktemp("project")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, root / name)
    config = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    folders = config.get("package-dir", {})
    for package in config["packages"]:
        top, *rest = package.split(".")
        folder = root / folders.get(top, top) / Path(*rest)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "__init__.py").touch()
    return root


def stub_env(root: Path, installed: dict[str, str]) -> Path:
    """A venv (without pip) whose site-packages holds stub dist-infos of `installed`."""
    subprocess.run([_python310(), "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
    python = root / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               check=True, capture_output=True, text=True).stdout.strip())
    for name, version in installed.items():
        info = site / f"{name}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        (info / "INSTALLER").write_text("device\n")
        files = ("METADATA", "INSTALLER", "RECORD")
        (info / "RECORD").write_text("".join(f"{info.name}/{f},,\n" for f in files))
    return python


def _pip_env() -> dict[str, str]:
    """This process's environment without pip's machine-wide settings (config file, find-links,
    constraints) and without PYTHONPATH, keeping how to reach the index."""
    keep = {"PIP_INDEX_URL", "PIP_CERT", "PIP_DEFAULT_TIMEOUT", "PIP_TRUSTED_HOST"}
    env = {k: v for k, v in os.environ.items()
           if not (k.startswith("PIP_") and k not in keep) and k != "PYTHONPATH"}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    return env


def resolve(python: Path, constraints: Path, project: Path, cache: Path, tmp_path: Path,
            *extra: str) -> subprocess.CompletedProcess:
    """`pip install --dry-run --report` of the project into the stub venv, run by this pip."""
    return subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--dry-run", "--quiet",
         "--report", str(tmp_path / "report.json"), "--cache-dir", str(cache),
         "-c", str(constraints), str(project), *extra],
        capture_output=True, text=True, timeout=600, env=_pip_env())


def would_install(tmp_path: Path) -> dict[str, str]:
    report = json.loads((tmp_path / "report.json").read_text())
    return {item["metadata"]["name"].lower(): item["metadata"]["version"] for item in report["install"]}


#: Each platform's constraints and what its device has before `pip install .`: the Jetson's
#: torch from the Jetson AI Lab index (as in the L4T PyTorch image) or NVIDIA's JetPack 6.1
#: wheel (a pre-release with a local label), and PyPI's CUDA 12.6 build on an x86 box.
PATHS = {
    "jetpack6-jetson-ai-lab": ("jetpack6.txt", {"torch": "2.5.0", "torchvision": "0.20.0"}),
    "jetpack6-nvidia-wheel": ("jetpack6.txt", {"torch": "2.5.0a0+872d972e41.nv24.08",
                                               "torchvision": "0.20.0a0+afc54f7"}),
    "cuda12": ("cuda12.txt", {"torch": "2.7.1", "torchvision": "0.22.1"}),
}


@pytest.mark.parametrize("path", PATHS)
def test_installing_the_package_keeps_the_devices_torch(path, index_reachable, project, pip_cache,
                                                         tmp_path):
    constraints, installed = PATHS[path]
    python = stub_env(tmp_path / "venv", installed)
    done = resolve(python, CONSTRAINTS / constraints, project, pip_cache, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    install = would_install(tmp_path)
    assert "fedattn" in install and "opacus" in install  # the resolution did run
    assert not {name for name in install if DEVICE_STACK.match(name)}, install
    if constraints == "jetpack6.txt":
        assert install["opacus"].startswith("1.5."), install  # 1.6 requires torch>=2.6
        assert install["numpy"].startswith("1."), install  # the Jetson torch's NumPy ABI


def test_a_dependency_that_wants_another_torch_fails_the_jetson_install(index_reachable, project,
                                                                       pip_cache, tmp_path):
    """The pins bind: opacus 1.6.0 (torch>=2.6) is refused with the device's torch named,
    instead of being installed with a PyPI torch beside it."""
    python = stub_env(tmp_path / "venv", PATHS["jetpack6-jetson-ai-lab"][1])
    done = resolve(python, CONSTRAINTS / "jetpack6.txt", project, pip_cache, tmp_path, "opacus==1.6.0",
                   "--verbose")  # cancels --quiet: pip explains the conflict
    out = done.stdout + done.stderr
    assert done.returncode != 0 and "ResolutionImpossible" in out, out
    assert re.search(r"opacus 1\.6\.0 depends on torch>=2\.6", out), out


def test_the_constraints_files_pin_the_device_stack():
    """Every platform file names torch and torchvision to one release (an open range would
    let pip pick a newer PyPI build), and the CPU file at the repository root stays the `make setup` pins."""
    for name in ("jetpack6.txt", "cuda12.txt", "oldest.txt"):
        lines = [line.split("#")[0].strip() for line in (CONSTRAINTS / name).read_text().splitlines()]
        pins = {re.split(r"[=<>!~ ]", line)[0]: line for line in lines if line}
        for package in ("torch", "torchvision"):
            assert package in pins and re.search(r"==|>=[^,]+,<", pins[package]), (name, pins)
    root = (REPO / "constraints.txt").read_text()
    assert re.search(r"^torch==", root, re.M) and re.search(r"^torchvision==", root, re.M)
