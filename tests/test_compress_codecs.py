"""The built-in codecs: round trips within each codec's stated bound, exactness where a
codec claims it, unbiased stochastic rounding, determinism, error feedback, the fixed
layout, and every refusal of a malformed encoded vector (the peer's bytes)."""

from __future__ import annotations

import math

import pytest
import torch

from fedattn_shared.compress import CompressSpec, load_codec
from fedattn_shared.compress.codec import Codec
from fedattn_shared.compress.feedback import Residuals, section_key
from fedattn_shared.compress.section import decode_section, encode_section, encoded_spec
from fedattn_shared.schema import Kind, Payload, Section, SectionSpec, TensorSpec
from fedattn_shared.wire.payload import WireError
from fedattn_shared.wire.serialize import decode as wire_decode
from fedattn_shared.wire.serialize import encode as wire_encode

CODECS = ["fp16", "bf16", "int8", "int8:64", "int4", "int4:8", "topk:0.01", "topk:0.3", "topk:1.0"]
SIZES = [0, 1, 2, 7, 8, 255, 256, 257, 1000, 65535, 65537, 140_001]
QUANTIZERS = ["int8", "int8:64", "int4", "int4:8"]


def codec_of(spec: str) -> Codec:
    return load_codec(spec).codec


def seeded(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def vector(n: int, scale: float, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=seeded(seed)) * scale


def step_per_value(codec: Codec, parts: dict[str, torch.Tensor], n: int) -> torch.Tensor:
    """A quantizer's stated error bound for each value: its block's scale / levels."""
    return (parts["scale"] / codec.levels).repeat_interleave(codec.block)[:n]


def check_bound(codec: Codec, x: torch.Tensor, parts: dict[str, torch.Tensor],
                y: torch.Tensor) -> None:
    """Each codec's stated bound on |decode(encode(x)) - x|."""
    err = (y.double() - x.double()).abs()
    if codec.name == "fp16":  # round to nearest: half an ulp, 2^-11 relative (or subnormal)
        assert bool((err <= x.double().abs() * 2.0**-11 + 2.0**-25).all())
    elif codec.name == "bf16":
        assert bool((err <= x.double().abs() * 2.0**-8 + 2.0**-134).all())
    elif codec.name in ("int8", "int4"):
        bound = step_per_value(codec, parts, x.numel()).double()
        assert bool((err <= bound * (1 + 1e-6)).all())
        # and the grid is really that coarse: some value lands off its exact input
        if x.numel() > 100 and bool(x.any()):
            assert float(err.max()) > 0
    else:  # topk: exactly k kept, at the largest |x|, exact; the rest decode as 0
        index = kept_positions(parts)
        assert index.numel() == codec.kept(x.numel())
        assert torch.equal(y[index], x[index]) and torch.equal(parts["values"], x[index])
        dropped = torch.ones(x.numel(), dtype=torch.bool)
        dropped[index] = False
        assert not bool(y[dropped].any())
        if 0 < index.numel() < x.numel():
            assert float(x.abs()[dropped].max()) <= float(x.abs()[index].min())


def kept_positions(parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """top-k's kept positions, read from its parts the slow, obvious way."""
    positions = []
    pairs = parts["index"].tolist()
    at = 0
    for block, count in enumerate(parts["counts"].tolist()):
        for low, high in pairs[at:at + count]:
            positions.append(block * 65536 + low + 256 * high)
        at += count
    return torch.tensor(positions, dtype=torch.int64)


@pytest.mark.parametrize("spec", CODECS)
@pytest.mark.parametrize("magnitude", [1.0, 1e-6, 3e4])
def test_round_trip_within_bound_and_layout(spec: str, magnitude: float) -> None:
    codec = codec_of(spec)
    generator = seeded(1)
    for n in SIZES:
        x = vector(n, magnitude, seed=n)
        if codec.name == "fp16":
            x = x.clamp(-65504, 65504)
        parts = codec.encode(x, generator)
        layout = codec.layout(n)
        assert list(parts) == list(layout)
        for name, (dtype, shape) in layout.items():
            assert parts[name].dtype == dtype and tuple(parts[name].shape) == shape, (spec, n, name)
        assert sum(p.numel() * p.element_size() for p in parts.values()) == codec.encoded_bytes(n)
        y = codec.decode(parts, n)
        assert y.dtype == torch.float32 and y.shape == (n,)
        check_bound(codec, x, parts, y)


@pytest.mark.parametrize("spec", ["bf16", "int8", "int4", "topk:0.01", "topk:1.0"])
def test_huge_magnitudes_and_zeros(spec: str) -> None:
    codec = codec_of(spec)
    for x in (vector(1000, 1e30), torch.zeros(300), torch.zeros(1)):
        parts = codec.encode(x, seeded())
        y = codec.decode(parts, x.numel())
        check_bound(codec, x, parts, y)
        if not bool(x.any()):
            assert not bool(y.any())
            if "scale" in parts:
                assert not bool(parts["scale"].any())  # a block of zeros has scale 0


def test_a_quantizer_keeps_a_tiny_block_scale() -> None:
    """An absmax of 1e-6 (late-training changes) survives: the scale is float32."""
    x = torch.full((256,), 1e-6)
    x[::2] = -1e-6
    for spec in ("int8", "int4"):
        codec = codec_of(spec)
        parts = codec.encode(x, seeded())
        assert float(parts["scale"][0]) == pytest.approx(1e-6, rel=1e-7)
        assert torch.equal(codec.decode(parts, 256), x)  # +-absmax is a level: exact


def test_half_formats_exact_for_representable_values() -> None:
    x16 = (torch.randn(5000, generator=seeded()) * 100).to(torch.float16)
    x16 = torch.cat([x16, torch.tensor([65504.0, -65504.0, 6e-8, 0.0], dtype=torch.float16)])
    fp16 = codec_of("fp16")
    assert torch.equal(fp16.decode(fp16.encode(x16.float()), x16.numel()), x16.float())
    xb = (torch.randn(5000, generator=seeded()) * 1e20).to(torch.bfloat16)
    xb = torch.cat([xb, torch.tensor([3.38e38, -1e-38, 0.0], dtype=torch.bfloat16)])
    bf16 = codec_of("bf16")
    assert torch.equal(bf16.decode(bf16.encode(xb.float()), xb.numel()), xb.float())


def test_bf16_rounds_to_nearest_even() -> None:
    bf16 = codec_of("bf16")
    # halfway between 1 and 1 + 2^-7 goes to 1 (even); halfway above 1 + 2^-7 goes up
    x = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 1 + 2**-8 + 2**-20])
    y = bf16.decode(bf16.encode(x), 4)
    assert y.tolist() == [1.0, 1 + 2**-6, -1.0, 1 + 2**-7]


def test_topk_full_fraction_is_exact_and_topk_keeps_the_largest() -> None:
    x = torch.cat([vector(70_000, 1e3), torch.tensor([3.4e38, -1e-45, 0.0])])
    full = codec_of("topk:1.0")
    assert torch.equal(full.decode(full.encode(x), x.numel()), x)
    # distinct magnitudes, largest planted at known places: exactly those are kept
    n = 200_000
    x = torch.randperm(n, generator=seeded()).float().mul_(1e-3)
    x[::3] *= -1
    codec = codec_of("topk:0.01")
    k = codec.kept(n)
    assert k == 2000
    y = codec.decode(codec.encode(x), n)
    assert set(torch.nonzero(y).view(-1).tolist()) == set(x.abs().topk(k).indices.tolist())


def test_topk_ties_keep_the_lowest_positions() -> None:
    """Equal magnitudes (a frozen layer's zero change) are chosen by position, so the
    bytes do not depend on how torch walks them."""
    codec = codec_of("topk:0.5")
    parts = codec.encode(torch.tensor([1.0, -1.0, 1.0, -1.0]))
    assert kept_positions(parts).tolist() == [0, 1]
    x = torch.zeros(200_000)
    x[[7, 150_000, 199_999]] = torch.tensor([-1.0, 2.0, 0.5])
    parts = codec_of("topk:0.00003").encode(x)  # k = 6: the 3 non-zeros, then zeros 0, 1, 2
    assert kept_positions(parts).tolist() == [0, 1, 2, 7, 150_000, 199_999]
    assert parts["counts"].tolist() == [4, 0, 1, 1]


def test_topk_k_depends_only_on_n() -> None:
    codec = codec_of("topk:0.07")
    assert [codec.kept(n) for n in (0, 1, 10, 100, 101)] == [0, 1, 1, 7, 8]
    assert codec_of("topk:0.5").kept(3) == 2
    assert codec_of("topk:0.00000001").kept(10) == 1


@pytest.mark.parametrize("spec", ["int8", "int4", "int4:8"])
def test_stochastic_rounding_is_unbiased(spec: str) -> None:
    """The mean of many seeded decodes converges to x at the rate of the standard error;
    rounding to nearest would miss by up to half a step and fail this."""
    codec = codec_of(spec)
    n, draws = 300, 1500
    x = vector(n, 1.0, seed=3)
    generator = seeded(7)
    total = torch.zeros(n, dtype=torch.float64)
    for _ in range(draws):
        parts = codec.encode(x, generator)
        total += codec.decode(parts, n).double()
    step = step_per_value(codec, parts, n).double()
    z = (total / draws - x.double()) / (step / 2 / math.sqrt(draws))  # sd <= step / 2
    assert float(z.abs().max()) < 5
    assert abs(float(z.mean())) < 5 / math.sqrt(n)  # no systematic drift either way
    # not trivially exact: the single draws do differ from x
    assert float((codec.decode(parts, n) - x).abs().max()) > 0.1 * float(step.max())


@pytest.mark.parametrize("spec", CODECS)
def test_same_seed_same_bytes(spec: str) -> None:
    codec = codec_of(spec)
    x = vector(10_000, 1.0)
    first, again = codec.encode(x, seeded(5)), codec.encode(x, seeded(5))
    assert all(torch.equal(first[name], again[name]) for name in first)
    if codec.name in ("int8", "int4"):  # the rounding really is random
        other = codec.encode(x, seeded(6))
        assert not torch.equal(first["q"], other["q"])
        unseeded = [codec.encode(x)["q"] for _ in range(2)]
        assert not torch.equal(*unseeded)


def test_same_bytes_on_one_thread_and_two() -> None:
    """An edge's bytes do not depend on its torch thread count (the random draws are
    serial; top-k's ties are broken by position)."""
    x = vector(300_000, 1.0)
    x[::5] = 0
    before = torch.get_num_threads()
    try:
        for spec in ("int8", "int4", "topk:0.01", "topk:0.9"):
            codec = codec_of(spec)
            encoded = []
            for threads in (1, 2):
                torch.set_num_threads(threads)
                encoded.append(codec.encode(x, seeded(3)))
            assert all(torch.equal(encoded[0][name], encoded[1][name]) for name in encoded[0])
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("spec", ["fp16", "bf16", "int8", "int4", "topk:0.01", "topk:0.1"])
def test_error_feedback_keeps_the_cumulative_sum(spec: str) -> None:
    """With a residual carried over rounds, the decoded sum trails the input sum by
    exactly the residual, which stays bounded; without it, top-k loses a steady part of
    every round and the gap grows with the rounds."""
    n, rounds = 3000, 120
    spec_ = SectionSpec(Kind.SHARED_TENSORS, "", {"w": TensorSpec(torch.float32, (n,))})
    codec = codec_of(spec)
    generator = seeded(2)
    drift = vector(n, 0.05, seed=11)  # a steady direction, as SGD updates have
    residual = torch.zeros(n)
    sent = torch.zeros(n, dtype=torch.float64)
    lost = torch.zeros(n, dtype=torch.float64)  # the same codec without feedback
    inputs = torch.zeros(n, dtype=torch.float64)
    gaps = []
    for r in range(rounds):
        x = drift + vector(n, 0.05, seed=100 + r)
        inputs += x.double()
        section = Section(Kind.SHARED_TENSORS, "", {"w": x})
        encoded, residual = encode_section(section, spec_, codec, generator=generator,
                                           residual=residual)
        sent += decode_section(encoded, spec_, codec).tensors["w"].double()
        plain, none = encode_section(section, spec_, codec, generator=generator)
        assert none is None
        lost += decode_section(plain, spec_, codec).tensors["w"].double()
        assert torch.allclose(inputs - sent, residual.double(), atol=1e-4)
        gaps.append(float((inputs - sent).abs().max()))
        if codec.name in ("int8", "int4"):  # within one step of this round's grid
            parts = {name[len("codec:"):]: t for name, t in encoded.tensors.items()}
            assert bool((residual.abs() <= step_per_value(codec, parts, n) * (1 + 1e-6)).all())
        elif codec.name in ("fp16", "bf16"):
            assert float(residual.abs().max()) <= 2.0**-8 * float((x + residual).abs().max())
    assert max(gaps[rounds // 2:]) <= 1.5 * max(gaps[:rounds // 2]) + 1e-3  # no drift
    if codec.biased:
        no_feedback = float((inputs - lost).abs().max())
        assert no_feedback > 3 * max(gaps)


def test_residuals_store_and_state(tmp_path) -> None:
    residuals = Residuals()
    key = section_key(Kind.SHARED_TENSORS, "head")
    assert key == "shared_tensors/head"
    assert torch.equal(residuals.take(key, 4), torch.zeros(4))
    residuals.keep(key, torch.tensor([1.0, -2.0, 3.0, 0.5]))
    residuals.keep("other", None)  # no feedback: nothing kept
    assert residuals.take(key, 4).tolist() == [1.0, -2.0, 3.0, 0.5]
    assert torch.equal(residuals.take(key, 5), torch.zeros(5))  # the model changed
    torch.save(residuals.state_dict(), tmp_path / "ef.pt")
    back = Residuals.from_state(torch.load(tmp_path / "ef.pt", weights_only=True))
    assert back.take(key, 4).tolist() == [1.0, -2.0, 3.0, 0.5] and list(back.vectors) == [key]
    for bad, match in (({key: torch.zeros(2, 2)}, "1-D float32"),
                       ({key: torch.zeros(2, dtype=torch.float64)}, "1-D float32"),
                       ({key: torch.tensor([float("nan")])}, "non-finite"),
                       ({3: torch.zeros(2)}, "not a string")):
        with pytest.raises(ValueError, match=match):
            Residuals.from_state(bad)


@pytest.mark.parametrize("spec", CODECS)
def test_section_travels_the_real_wire(spec: str) -> None:
    """Every part dtype can travel: encode a section, send it through the wire serializer,
    decode it on the other side against the same base."""
    spec_ = SectionSpec(Kind.SHARED_TENSORS, "", {
        "conv.weight": TensorSpec(torch.float32, (16, 3, 3, 3)),
        "bn.num_batches_tracked": TensorSpec(torch.int64, ()),
        "fc.weight": TensorSpec(torch.float32, (10, 70)),
    })
    base = {"conv.weight": vector(432, 1.0, seed=1).view(16, 3, 3, 3)}
    tensors = {"conv.weight": base["conv.weight"] + vector(432, 0.01, seed=2).view(16, 3, 3, 3),
               "bn.num_batches_tracked": torch.tensor(12),
               "fc.weight": vector(700, 0.1, seed=3).view(10, 70)}
    codec = codec_of(spec)
    encoded, _ = encode_section(Section(Kind.SHARED_TENSORS, "", tensors), spec_, codec,
                                base=base, generator=seeded())
    schema = encoded_spec(spec_, codec)
    assert {n: (t.dtype, tuple(t.shape)) for n, t in encoded.tensors.items()} == \
        {n: (t.dtype, t.shape) for n, t in schema.tensors.items()}
    sent = wire_encode(Payload([encoded]))
    data = b"".join(bytes(v) for views in sent.section_views for v in views)
    received = wire_decode(sent.manifest, data).sections[0]
    out = decode_section(received, spec_, codec, base=base).tensors
    assert int(out["bn.num_batches_tracked"]) == 12
    change = torch.cat([(tensors["conv.weight"] - base["conv.weight"]).view(-1),
                        tensors["fc.weight"].view(-1)])
    tolerance = {"int8": float(change.abs().max()) / 127, "int4": float(change.abs().max()) / 7,
                 "fp16": 1e-3, "bf16": 1e-2, "topk": 0.0}[codec.name]
    for name in ("conv.weight", "fc.weight"):
        assert out[name].shape == tensors[name].shape
        if codec.name != "topk" or spec == "topk:1.0":
            assert float((out[name] - tensors[name]).abs().max()) <= tolerance


# ---- the peer's bytes: each malformed part refused by name ----

def good(spec: str, n: int = 1000) -> tuple[Codec, dict[str, torch.Tensor]]:
    codec = codec_of(spec)
    return codec, {k: v.clone() for k, v in codec.encode(vector(n, 1.0), seeded()).items()}


def refused(codec: Codec, parts: dict[str, torch.Tensor], n: int, match: str) -> None:
    with pytest.raises(WireError, match=match):
        codec.decode(parts, n)


@pytest.mark.parametrize("spec", ["int8", "int4"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), -1e-3])
def test_bad_scale_refused(spec: str, value: float) -> None:
    codec, parts = good(spec)
    parts["scale"][2] = value
    refused(codec, parts, 1000, f"{spec} scale: (non-finite|negative)")


def test_int8_q_minus_128_refused() -> None:
    codec, parts = good("int8")
    parts["q"][999] = -128
    refused(codec, parts, 1000, r"int8 q: value -128 outside \[-127, 127\]")
    parts["q"][999] = 127  # in range, accepted
    codec.decode(parts, 1000)


def test_int8_decoded_non_finite_refused() -> None:
    codec, parts = good("int8")
    parts["scale"][0] = torch.finfo(torch.float32).max  # finite, but 127 * (max / 127) is Inf
    parts["q"][0] = 127
    refused(codec, parts, 1000, "int8 decoded: non-finite")


@pytest.mark.parametrize("position", [0, 1, 498, 499])
def test_int4_nibble_minus_8_refused(position: int) -> None:
    codec, parts = good("int4", n=999)
    byte = int(parts["q"][position // 2])
    nibble_shift = 4 * (position % 2)
    parts["q"][position // 2] = (byte & ~(0xF << nibble_shift) & 0xFF) | (8 << nibble_shift)
    refused(codec, parts, 999, r"int4 q: nibble -8 outside \[-7, 7\]")


def test_int4_nibbles_8_to_15_are_negative_and_padding_must_be_zero() -> None:
    codec = codec_of("int4:8")
    # nibbles 1, 15 (-1), 7, 9 (-7), then 0 and a padding nibble
    parts = {"q": torch.tensor([0xF1, 0x97, 0x00], dtype=torch.uint8),
             "scale": torch.tensor([7.0])}
    assert codec.decode(parts, 5).tolist() == [1.0, -1.0, 7.0, -7.0, 0.0]
    parts["q"][2] = 0x10
    refused(codec, parts, 5, "int4 q: padding nibble")


def test_quantizer_shapes_checked() -> None:
    codec, parts = good("int8")
    refused(codec, {**parts, "scale": parts["scale"][:-1]}, 1000, r"int8 scale: .* \(3,\), expected")
    refused(codec, {**parts, "q": parts["q"][:-1]}, 1000, r"int8 q: .* \(999,\), expected")
    refused(codec, {**parts, "q": parts["q"].view(torch.uint8)}, 1000, "int8 q: torch.uint8")
    refused(codec, {"q": parts["q"]}, 1000, "int8 scale: missing")
    refused(codec, {**parts, "extra": parts["q"]}, 1000, "int8 extra: not a part")
    fp16, half = good("fp16")
    refused(fp16, {"values": half["values"][:-1]}, 1000, "fp16 values: .* expected")


def test_topk_counts_refused() -> None:
    n = 140_000  # three blocks of 65536
    codec, parts = good("topk:0.01", n)
    counts = parts["counts"].clone()
    parts["counts"][0] = -1
    refused(codec, parts, n, "topk counts: negative")
    parts["counts"] = counts.clone()
    parts["counts"][0] += 1
    refused(codec, parts, n, "topk counts: sum")
    # a count moved between blocks still sums to k, but then an index leaves its block
    # or the order breaks: refused either way, by the index part
    parts["counts"] = counts.clone()
    parts["counts"][2] += parts["counts"][1]
    parts["counts"][1] = 0
    refused(codec, parts, n, "topk index")


def test_topk_index_refused() -> None:
    n = 140_000
    codec, parts = good("topk:0.01", n)
    k = codec.kept(n)
    index = parts["index"].clone()
    parts["index"][k - 1] = torch.tensor([0xFF, 0xFF], dtype=torch.uint8)  # last block is short
    refused(codec, parts, n, "topk index: an index is outside its block")
    parts["index"] = index.clone()
    parts["index"][[3, 4]] = parts["index"][[4, 3]]
    refused(codec, parts, n, "topk index: indices within a block not ascending")
    parts["index"] = index.clone()
    parts["index"][5] = parts["index"][4]
    refused(codec, parts, n, "topk index: a repeated index")
    parts["index"] = index.clone()
    codec.decode(parts, n)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_values_refused(value: float) -> None:
    for spec, part in (("topk:0.01", "values"), ("fp16", "values"), ("bf16", "values")):
        codec, parts = good(spec)
        parts[part][0] = value
        refused(codec, parts, 1000, f"{codec.name} values: non-finite")


def test_topk_part_dtype_and_shape_checked() -> None:
    codec, parts = good("topk:0.01")
    refused(codec, {**parts, "values": parts["values"].double()}, 1000, "topk values")
    refused(codec, {**parts, "index": parts["index"].view(-1)}, 1000, "topk index")


@pytest.mark.parametrize("spec", CODECS)
def test_random_bytes_never_escape_as_other_errors(spec: str) -> None:
    """Whatever a peer sends in the layout's shape, decode returns a finite vector of n
    or refuses with a WireError: never an IndexError or a crash."""
    codec = codec_of(spec)
    generator = seeded(9)
    n = 70_001
    for _ in range(20):
        parts = {}
        for name, (dtype, shape) in codec.layout(n).items():
            count = math.prod(shape)
            raw = torch.randint(0, 256, (count * dtype.itemsize,), dtype=torch.uint8,
                                generator=generator)
            parts[name] = raw.view(dtype).view(shape)
        try:
            y = codec.decode(parts, n)
        except WireError:
            continue
        assert y.shape == (n,) and bool(torch.isfinite(y).all())


@pytest.mark.parametrize("spec", ["bf16", "int8", "int4", "topk:0.01"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_encode_refuses_non_finite_input(spec: str, value: float) -> None:
    x = vector(1000, 1.0)
    x[500] = value
    with pytest.raises(ValueError, match="non-finite"):
        codec_of(spec).encode(x, seeded())


def test_bf16_refuses_a_value_rounding_to_inf() -> None:
    with pytest.raises(ValueError, match="beyond bfloat16's range"):
        codec_of("bf16").encode(torch.tensor([torch.finfo(torch.float32).max]))


def test_encoded_sizes() -> None:
    n = 1_000_000
    ratio = {spec: codec_of(spec).encoded_bytes(n) / (4 * n)
             for spec in ("fp16", "bf16", "int8:256", "int4:256", "topk:0.01")}
    assert ratio["fp16"] == ratio["bf16"] == 0.5
    assert ratio["int8:256"] <= 0.26
    assert ratio["int4:256"] <= 0.13
    assert ratio["topk:0.01"] <= 0.03
    for spec in CODECS:
        codec = codec_of(spec)
        for n in list(range(0, 700, 37)) + [65536, 65537, 131072]:
            assert codec.encoded_bytes(n) == sum(
                math.prod(shape) * dtype.itemsize for dtype, shape in codec.layout(n).values())


def test_load_codec_every_builtin() -> None:
    cases = {"fp16": "fp16", "bf16": "bf16", "int8": "int8:256", "int8:128": "int8:128",
             "int8:8": "int8:8", "int8:65536": "int8:65536", "int4": "int4:256",
             "int4:64": "int4:64", "topk:0.01": "topk:0.01", "topk:1": "topk:1",
             "topk:1.0": "topk:1.0"}
    for text, canonical in cases.items():
        for suffix in ("", "+ef"):
            choice = load_codec(text + suffix)
            assert choice.spec == canonical + suffix and choice.feedback == bool(suffix)
            assert load_codec(choice.spec).spec == choice.spec  # the canonical form parses
    assert load_codec("int8:64").codec.block == 64
    assert (load_codec("int8").codec.integer_bits, load_codec("int4").codec.integer_bits) == (8, 4)
    assert load_codec("topk:0.01").codec.biased and not load_codec("int8").codec.biased
    spec = CompressSpec.parse("up=topk:0.01+ef,down=bf16")
    assert spec.text == "up=topk:0.01+ef,down=bf16"
    assert CompressSpec.parse("up=int4:64").text == "up=int4:64"


@pytest.mark.parametrize("text, match", [
    ("int8:7", r"block size 7 outside \[8, 65536\]"),
    ("int8:65537", "outside"),
    ("int4:0", "outside"),
    ("int8:abc", "not an integer"),
    ("int8:1.5", "not an integer"),
    ("int8:0000000000256", "not an integer"),
    ("topk", "needs the kept fraction"),
    ("topk:0", r"outside \(0, 1\]"),
    ("topk:0.0", "outside"),
    ("topk:1.5", "outside"),
    ("topk:1e9999999999", "not a decimal"),
    ("topk:nan", "not a decimal"),
    ("fp16:1", "takes no argument"),
    ("bf16:x", "takes no argument"),
    ("int9", "unknown codec"),
    ("topk:-0.1", "is not NAME"),
])
def test_load_codec_bad_args_refused(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        load_codec(text)


@pytest.mark.parametrize("spec", CODECS)
def test_strided_input_encodes_as_its_copy(spec: str) -> None:
    codec = codec_of(spec)
    x = vector(2001, 1.0)[::2]
    strided, copied = codec.encode(x, seeded(4)), codec.encode(x.clone(), seeded(4))
    assert all(torch.equal(strided[name], copied[name]) for name in copied)
