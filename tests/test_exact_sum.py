"""The server's exact sum against exact arithmetic: whatever its implementation (NumPy
passes or numba's compiled loop, slices, threads), ``add_scaled`` and ``spilled_mean``
must give the float64 nearest the exact sum of the rounded products ``weight * value``
(Python's fractions), in every arrival order. Every test runs both ways."""

from __future__ import annotations

import itertools
from fractions import Fraction

import pytest
import torch

from fedattn_shared import kernels
from fedattn_shared.methods import exact_sum
from fedattn_shared.methods.exact_sum import add_scaled, finish_sum, spilled_mean
from fedattn_shared.methods.spill import UploadSpill
from fedattn_shared.schema import Kind

WEIGHTS = (1.0, 37.0, 999_983.0, 0.1, 4096.0)
KEY = (Kind.SHARED_TENSORS, "")


@pytest.fixture(autouse=True, params=["numpy", "compiled"])
def loops(request, monkeypatch) -> str:
    """Each test with NumPy's passes and with the compiled loop (``kernels``), whatever
    the vectors' size."""
    if request.param == "compiled":
        if kernels.compiled(kernels.COMPILED_FROM) is None:
            pytest.skip("numba is not installed (the 'server' extra)")
        monkeypatch.setattr(kernels, "COMPILED_FROM", 0)
    else:
        monkeypatch.setattr(kernels, "COMPILED_FROM", 1 << 62)
    return request.param


def values(dtype: torch.dtype, n: int = 600, seed: int = 0, low: int = -8, high: int = 3
           ) -> list[torch.Tensor]:
    """One vector per weight: magnitudes over 10**low..10**high and both signs (integers
    for an integer dtype), the last nearly cancelling the others' weighted sum."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in WEIGHTS[:-1]:
        if dtype.is_floating_point:
            scale = torch.pow(10.0, torch.empty(n, dtype=torch.float64).uniform_(
                low, high, generator=generator))
            sign = torch.where(torch.rand(n, generator=generator) < 0.5, -1.0, 1.0)
            out.append((sign * scale).to(dtype))
        else:
            out.append(torch.randint(-2**40, 2**40, (n,), generator=generator).to(dtype))
    partial = sum(v.double() * w for v, w in zip(out, WEIGHTS, strict=False))
    out.append((-partial / WEIGHTS[-1]).to(dtype))
    return out


def exact(uploads: list[torch.Tensor], weights=WEIGHTS) -> torch.Tensor:
    """The float64 nearest the exact sum of each coordinate's rounded products."""
    columns = zip(*(v.double().tolist() for v in uploads), strict=True)
    sums = [float(sum((Fraction(w * x) for w, x in zip(weights, column, strict=True)),
                      Fraction(0)))
            for column in columns]
    return torch.tensor(sums, dtype=torch.float64)


@pytest.mark.parametrize(("dtype", "low", "high"), [
    (torch.float32, -8, 3), (torch.bfloat16, -8, 3), (torch.int64, 0, 0),
    # Products of 53-bit values are rounded: their range must stay within the sum's exact
    # regime (``add_scaled``: ~2**48 for 5 edges); float16's last vector must stay finite.
    (torch.float64, -2, 2), (torch.float16, -3, 1)])
def test_the_compensated_sum_is_the_exact_sum_rounded_once(dtype, low, high):
    """Every dtype an upload may carry, weights up to 1e6 and 0.1 (not a binary
    fraction), 18 of the 120 arrival orders: the float64 nearest the exact sum."""
    uploads = values(dtype, low=low, high=high)
    expected = exact(uploads)
    for order in itertools.islice(itertools.permutations(range(len(uploads))), 0, 120, 7):
        total = torch.zeros(uploads[0].numel(), dtype=torch.float64)
        comp = torch.zeros_like(total)
        for i in order:
            add_scaled(total, uploads[i], WEIGHTS[i], comp)
        assert torch.equal(finish_sum(total, comp), expected), order


@pytest.mark.parametrize("workers", [1, 2])
def test_the_spilled_mean_is_the_exact_mean(workers, tmp_path, monkeypatch):
    """Uploads of a float32 and a float64 tensor read back from disk, slices of 5 that
    cut across both, summed on 1 and 2 threads: the exact sum rounded once, divided by
    the total weight."""
    monkeypatch.setattr(exact_sum, "SPILL_SLICE", 5)
    singles, doubles = values(torch.float32, 23), values(torch.float64, 19, seed=1)
    spill = UploadSpill(tmp_path, 1 << 30)
    spilled = []
    for i, (a, b) in enumerate(zip(singles, doubles, strict=True)):
        views = [memoryview(t.numpy()).cast("B") for t in (a, b)]
        path = spill.write_raw(1, f"e{i}", f"e{i}", views)
        spilled.append((path, WEIGHTS[i], {KEY: (0, [torch.float32, torch.float64])}))
    layout = [("a", torch.float32, (23,)), ("b", torch.float64, (19,))]
    mean = spilled_mean(spilled, KEY, layout, sum(WEIGHTS), workers=workers)
    assert torch.equal(mean["a"], (exact(singles) / sum(WEIGHTS)).float())
    assert torch.equal(mean["b"], exact(doubles) / sum(WEIGHTS))


def test_the_spilled_mean_has_the_in_ram_sums_bits_signed_zeros_too(tmp_path):
    """The bits, not only the values, of the in-RAM path (``add_scaled``): a slice's
    first upload goes through ``first_term`` (one pass, not ``two_sum``'s eight), whose
    sum keeps a -0.0 that ``0 + p`` makes +0.0: the finish must make it +0.0."""
    first = torch.tensor([-0.0, 0.0, -0.0, 1.5, -2.25e-30, 3.0e38], dtype=torch.float32)
    second = torch.tensor([-0.0, -0.0, 0.0, -1.5, 2.25e-30, -3.0e38], dtype=torch.float32)
    weights = (3.0, 999_983.0)
    total = torch.zeros(first.numel(), dtype=torch.float64)
    comp = torch.zeros_like(total)
    for upload, weight in zip((first, second), weights, strict=True):
        add_scaled(total, upload, weight, comp)
    in_ram = (finish_sum(total, comp) / sum(weights)).float()
    spill = UploadSpill(tmp_path, 1 << 30)
    spilled = [(spill.write_raw(1, f"e{i}", f"e{i}", [memoryview(t.numpy()).cast("B")]),
                weights[i], {KEY: (0, [torch.float32])}) for i, t in enumerate((first, second))]
    alone = [(spilled[0][0], weights[0], spilled[0][2])]
    layout = [("a", torch.float32, (first.numel(),))]
    mean = spilled_mean(spilled, KEY, layout, sum(weights))["a"]
    assert torch.equal(mean.view(torch.int32), in_ram.view(torch.int32))
    one = spilled_mean(alone, KEY, layout, weights[0])["a"]  # the first term alone
    total = torch.zeros(first.numel(), dtype=torch.float64)
    comp = torch.zeros_like(total)
    add_scaled(total, first, weights[0], comp)
    expected = (finish_sum(total, comp) / weights[0]).float()
    assert torch.equal(one.view(torch.int32), expected.view(torch.int32))
    assert one[0].item() == 0.0 and not torch.signbit(one[0])  # as -0.0 * 3 + 0 is


def test_a_numba_that_cannot_run_here_leaves_numpy_s_passes(monkeypatch, caplog):
    """numba installed where it cannot cache its code (no writable ``__pycache__`` nor
    home: a RuntimeError as the loops are defined) or not installed at all: no loops, the
    NumPy passes, and a warning naming the cause for the first."""
    def unusable(name, package=None):
        raise RuntimeError("cannot cache function 'pair_add': no locator available")

    def missing(name, package=None):
        raise ModuleNotFoundError("No module named 'numba'")

    for cause, warned in ((unusable, True), (missing, False)):
        kernels._load.cache_clear()
        caplog.clear()
        with monkeypatch.context() as patch:
            patch.setattr(kernels.importlib, "import_module", cause)
            assert kernels._load() is None
        assert ("NUMBA_CACHE_DIR" in caplog.text) is warned
    kernels._load.cache_clear()
    total, comp = torch.zeros(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)
    add_scaled(total, torch.ones(3), 2.0, comp)  # whichever path is here again
    assert finish_sum(total, comp).tolist() == [2.0, 2.0, 2.0]


def test_a_daemon_takes_numba_s_first_call_at_its_start_and_names_what_runs():
    """``kernels.warm``: below the floor nothing is loaded and NumPy's passes are named;
    at it, the loops are compiled or loaded for the server's argument types, so that the
    first round's scan (on the event loop) and sum find them ready."""
    assert kernels.warm(kernels.COMPILED_FROM - 1).startswith("NumPy passes")
    named = kernels.warm(kernels.COMPILED_FROM)
    if kernels._load() is None:
        assert named.startswith("NumPy passes (numba")
    else:
        assert named == f"numba {kernels._load().numba.__version__}"
        for function in (kernels._load().pair_add, kernels._load().any_exponent_full):
            assert function.signatures  # compiled for the server's types already
