"""SecAgg+'s arithmetic: what an edge's upload becomes before it is masked, and back.

Masks are added in a ring, so only integers can be summed masked. ``Quantizer`` is the
fixed point of a plain run (weight x value in Z_2^32, the weight as one more coordinate);
``IntegerQuantizer`` is the ring of an integer up codec (``--compress up=int8/int4``, or
any ``compress.integer.IntegerCodec``: each edge's change on a public per-block grid,
rounded by the codec's own ``round_levels``, in Z_2^R with R = bits + ceil(log2 parties),
packed at R bits a value). The protocol itself (keys, shares, survivors) is ``secagg.py``; this module knows
nothing of it, so the two can be read apart.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from ..compress.integer import IntegerCodec

RING_BITS = 32
LIMIT = 2**31 - 1           # |sum of quantized values| must stay below this


class SecAggError(ValueError):
    """A protocol step that cannot go on (bad signature, tampered share, too few
    survivors); the message names the edge or the condition."""


# ---- fixed-point quantization into Z_2^32 --------------------------------------------------
@dataclass(frozen=True)
class Quantizer:
    """Fixed point for ``parties`` summands: each edge sends round(w * x * scale) with
    |x| <= clip and 0 < w <= max_weight, so |sum| <= parties * max_weight * clip * scale
    + parties / 2 < 2^31 and the sum never wraps. The weight itself travels as one extra
    coordinate, round(w * weight_scale). The error of the weighted mean is at most
    parties / (2 * scale * total weight) per coordinate."""

    clip: float
    max_weight: float
    parties: int

    @property
    def scale(self) -> float:
        return (LIMIT - self.parties) / (self.parties * self.max_weight * self.clip)

    @property
    def weight_scale(self) -> float:
        return (LIMIT - self.parties) / (self.parties * self.max_weight)

    def quantize(self, values: np.ndarray, weight: float, names: str = "the upload") -> np.ndarray:
        """The edge's check before masking (the server cannot check masked values):
        finite, within the clip range, a weight in (0, max_weight]."""
        if not (math.isfinite(weight) and 0 < weight <= self.max_weight):
            raise SecAggError(f"aggregation weight {weight} is outside (0, {self.max_weight}] "
                              "(server.secagg_max_weight)")
        if not np.all(np.isfinite(values)):
            raise SecAggError(f"non-finite values in {names}")
        peak = float(np.max(np.abs(values))) if values.size else 0.0
        if peak > self.clip:
            raise SecAggError(f"{names}: |value| {peak:.4g} exceeds the clip range "
                              f"{self.clip} (server.secagg_clip)")
        out = np.empty(values.size + 1, dtype=np.int64)
        out[:-1] = np.rint(values.astype(np.float64) * (weight * self.scale))
        out[-1] = round(weight * self.weight_scale)
        return out.astype(np.uint32)  # two's complement: negatives wrap into the ring

    def dequantize(self, total: np.ndarray) -> tuple[np.ndarray, float]:
        """(sum_u w_u x_u, sum_u w_u) from the unmasked ring sum."""
        signed = total.view(np.int32).astype(np.float64)
        return signed[:-1] / self.scale, float(signed[-1]) / self.weight_scale

    def check_sum(self, values: np.ndarray, weight: float, count: int) -> None:
        """The server's check of an unmasked sum over ``count`` edges: 0 < W <= count x
        max_weight and |mean| <= clip, each up to the rounding of ``count`` summands. Every
        honest edge checks its own upload before masking, but nothing stops an edge from
        adding to its masked vector (its weight coordinate above all); a sum outside these
        bounds is not one honest edges produced, and is refused rather than averaged."""
        if count < 1:
            raise SecAggError("an unmasked sum of no edges")
        weight_bound = count * self.max_weight + count / self.weight_scale
        if not (math.isfinite(weight) and 0 < weight <= weight_bound):
            raise SecAggError(f"the unmasked total weight {weight:.6g} is outside (0, {count} x "
                              f"{self.max_weight:g}] (server.secagg_max_weight x {count} edges): "
                              "an edge tampered with its masked weight; nothing is aggregated")
        if values.size:
            peak = float(np.max(np.abs(values))) / weight
            bound = self.clip * (1 + 1e-9) + count / (self.scale * weight)
            if not (math.isfinite(peak) and peak <= bound):
                raise SecAggError(f"the unmasked mean reaches |{peak:.6g}|, beyond the clip range "
                                  f"{self.clip:g} (server.secagg_clip): an edge tampered with its "
                                  "masked values; nothing is aggregated")


# ---- integer quantization into Z_2^R (SecAgg+ under --compress up=int8/int4) ----------------
def levels(bits: int) -> int:
    """The largest integer level of a ``bits``-wide symmetric quantizer (int8: 127)."""
    return 2 ** (bits - 1) - 1


def ring_bits(bits: int, parties: int) -> int:
    """R: the ring that holds an exact sum of ``parties`` values in [-L, L] for L =
    ``levels(bits)``: parties x L < 2^(bits - 1) x 2^ceil(log2 parties) = 2^(R - 1), so no
    honest sum wraps. 10 edges at int8: R = 12."""
    return bits + math.ceil(math.log2(max(parties, 1)))


def packed_length(n: int, ring: int) -> int:
    """Bytes of ``n`` values packed at ``ring`` bits each."""
    return (n * ring + 7) // 8


PACK_CHUNK = 1 << 15  # x 8 values per packing step: bounds its temporaries at ~8 MiB


def _word_bytes(ring: int) -> int:
    """Bytes of the narrowest little-endian word that holds ``ring`` bits (1, 2 or 4)."""
    if not 1 <= ring <= RING_BITS:
        raise ValueError(f"ring of {ring} bits: outside [1, {RING_BITS}]")
    return 1 if ring <= 8 else 2 if ring <= 16 else 4


def pack_bits(words: np.ndarray, ring: int) -> np.ndarray:
    """The low ``ring`` bits of each uint32 word, concatenated little-endian (value i at bit
    i x ring). Vectorized per chunk of 8 x ``PACK_CHUNK`` values (a multiple of 8, so
    every chunk ends on a byte boundary)."""
    width = _word_bytes(ring)
    words = np.ascontiguousarray(words, dtype="<u4")
    out = []
    step = 8 * PACK_CHUNK
    for start in range(0, words.size, step):
        low = words[start:start + step].view(np.uint8).reshape(-1, 4)[:, :width]
        bits = np.unpackbits(low, axis=1, bitorder="little")[:, :ring]
        out.append(np.packbits(bits.reshape(-1), bitorder="little"))
    return np.concatenate(out) if out else np.zeros(0, dtype=np.uint8)


def unpack_bits(data: np.ndarray, ring: int, n: int) -> np.ndarray:
    """``n`` uint32 words from ``pack_bits``'s bytes (each < 2^ring); SecAggError when
    ``data`` is not ``packed_length(n, ring)`` bytes. Value i is gathered from the
    ceil((ring + 7) / 8) bytes from bit i x ring on, per chunk of 8 x ``PACK_CHUNK``."""
    _word_bytes(ring)  # the range check
    data = np.ascontiguousarray(data, dtype=np.uint8)
    if data.size != packed_length(n, ring):
        raise SecAggError(f"packed vector of {data.size} bytes, expected "
                          f"{packed_length(n, ring)} for {n} values of {ring} bits")
    padded = np.zeros(data.size + 8, dtype=np.uint8)  # the last value's spare bytes
    padded[:data.size] = data
    out = []
    step = 8 * PACK_CHUNK
    for start in range(0, n, step):
        offset = np.arange(start, min(start + step, n), dtype=np.int64) * ring
        first = offset >> 3
        value = np.zeros(offset.size, dtype=np.uint64)
        for k in range((ring + 14) // 8):
            value |= padded[first + k].astype(np.uint64) << np.uint64(8 * k)
        value >>= (offset & 7).astype(np.uint64)
        out.append((value & np.uint64((1 << ring) - 1)).astype(np.uint32))
    return np.concatenate(out) if out else np.zeros(0, dtype=np.uint32)


@dataclass(frozen=True)
class IntegerQuantizer:
    """The fixed point of a masked integer upload: the run's integer up codec
    (``--compress up=int8``, ``int4`` or a plug-in ``IntegerCodec``) on a public grid.

    Each edge sends q = R(clip(w/w_ref x / s_b x L)) per value, s_b the public scale of
    the value's block, w_ref a public reference weight, L the codec's ``levels`` and R the
    codec's ``round_levels`` (int8/int4: stochastic rounding, unbiased within the clip
    range), so |q| <= L and the sum over ``parties`` edges lies in [-parties L, parties L],
    which the ring of ``ring_bits`` holds without wrapping. Values travel packed at R bits.
    The weight travels exact, as today's 32-bit coordinate (``Quantizer``'s). The server
    recovers sum_u w_u x_u = w_ref x s_b / L x sum_u q_u; its error per value is at most
    parties x w_ref x s_b / L (one level per edge) plus what edges clipped."""

    codec: IntegerCodec = field(compare=False)
    parties: int
    max_weight: float
    scales: np.ndarray = field(compare=False)      # float32, one per block
    weight_ref: float = 1.0

    @property
    def bits(self) -> int:
        return self.codec.integer_bits

    @property
    def block(self) -> int:
        return self.codec.block

    @property
    def levels(self) -> int:
        return self.codec.levels

    @property
    def ring(self) -> int:
        return ring_bits(self.bits, self.parties)

    @property
    def digest(self) -> bytes:
        """What the edges sign with the survivor list: the whole public fixed point."""
        head = json.dumps([self.bits, self.block, self.parties, self.max_weight,
                           self.weight_ref]).encode()
        return hashlib.sha256(b"fedattn-secagg/fixed-point|" + head
                              + self.scales.astype("<f4").tobytes()).digest()

    def _per_value(self, n: int) -> np.ndarray:
        blocks = -(-n // self.block)
        if self.scales.shape != (blocks,):
            raise SecAggError(f"scales: {self.scales.size} given, {blocks} blocks of "
                              f"{self.block} expected")
        return np.repeat(self.scales.astype(np.float64), self.block)[:n]

    def weight_quantizer(self) -> Quantizer:
        """The fixed point of the weight word (``Quantizer``'s, whose clip it ignores)."""
        return Quantizer(1.0, self.max_weight, self.parties)

    def _weight(self) -> Quantizer:
        return self.weight_quantizer()

    def quantize(self, values: np.ndarray, weight: float, generator: torch.Generator,
                 names: str = "the upload") -> tuple[np.ndarray, np.ndarray]:
        """(the words to mask, values then the weight; what this edge did not send, in the
        units of ``values``: its own rounding and clipping error, the error-feedback
        residual). Checks the weight and finiteness before anything (the server cannot)."""
        if not (math.isfinite(weight) and 0 < weight <= self.max_weight):
            raise SecAggError(f"aggregation weight {weight} is outside (0, {self.max_weight}] "
                              "(server.secagg_max_weight)")
        if not np.all(np.isfinite(values)):
            raise SecAggError(f"non-finite values in {names}")
        scale = self._per_value(values.size)
        factor = weight / self.weight_ref
        if not math.isfinite(factor * self.levels):  # 0 x inf would be NaN below
            raise SecAggError(f"weight_ref {self.weight_ref:g} is too small for weight {weight:g}")
        t = np.clip(values.astype(np.float64) * (factor * self.levels) / scale,
                    -self.levels, self.levels)
        q = self._rounded(t, generator)
        out = np.empty(values.size + 1, dtype=np.int64)
        out[:-1] = q
        out[-1] = round(weight * self._weight().weight_scale)
        error = values - q * (scale / (self.levels * factor))
        return out.astype(np.uint32), error

    def _rounded(self, t: np.ndarray, generator: torch.Generator) -> np.ndarray:
        """The codec's rounding of ``t`` (level units, within [-L, L]), held to what the
        ring needs: one integer in [-L, L] per value (SecAggError naming the codec
        otherwise: a sum of values beyond L could wrap)."""
        q = np.asarray(self.codec.round_levels(t, generator))
        name = self.codec.name
        if q.shape != t.shape or not np.issubdtype(q.dtype, np.number):
            raise SecAggError(f"codec {name}: round_levels gave {q.dtype} {q.shape} for "
                              f"{t.shape} values")
        if q.size and not (np.all(np.isfinite(q)) and np.all(np.floor(q) == q)):
            raise SecAggError(f"codec {name}: round_levels gave values that are not integers")
        peak = float(np.max(np.abs(q))) if q.size else 0.0
        if peak > self.levels:
            raise SecAggError(f"codec {name}: round_levels gave |{peak:g}|, beyond its "
                              f"{self.levels} levels")
        return q

    def dequantize(self, total: np.ndarray, count: int) -> tuple[np.ndarray, float]:
        """(sum_u w_u x_u, sum_u w_u) from the unmasked ring sum over ``count`` edges, after
        ``check``ing it (SecAggError: an edge tampered; nothing is to be aggregated)."""
        ring = self.ring
        values = (total[:-1] & np.uint32((1 << ring) - 1)).astype(np.int64)
        values[values >= 1 << (ring - 1)] -= 1 << ring
        weight = float(total[-1:].view(np.int32)[0]) / self._weight().weight_scale
        self.check(values, weight, count)
        scale = self._per_value(values.size)
        return values * (scale * (self.weight_ref / self.levels)), weight

    def check(self, q: np.ndarray, weight: float, count: int) -> None:
        """The server's check of an unmasked integer sum over ``count`` edges: |sum| <=
        count x L per value, the weight as ``Quantizer.check_sum`` bounds it. An edge can
        add anything to its masked words; a sum outside these bounds no honest edges
        produced, and is refused rather than averaged."""
        self._weight().check_sum(np.zeros(0), weight, count)
        bound = count * self.levels
        peak = int(np.max(np.abs(q))) if q.size else 0
        if peak > bound:
            raise SecAggError(f"the unmasked integer sum reaches |{peak}|, beyond {count} edges "
                              f"x {self.levels} ({self.codec.name} levels): an edge tampered with "
                              "its masked values; nothing is aggregated")


def public_scales(mean: np.ndarray, block: int, margin: float) -> np.ndarray:
    """One scale per block of ``block`` values: ``margin`` x the largest |value| of
    ``mean`` (the previous round's unmasked weighted mean of the masked quantity: public
    to the server, a sum over edges, no single edge's) over the block, floored at 1e-4 of
    the vector's largest (a block that did not move last round may move now) and 1e-12."""
    n = mean.size
    blocks = -(-n // block)
    padded = np.zeros(blocks * block)
    padded[:n] = np.abs(mean)
    peak = padded.reshape(blocks, block).max(axis=1) if n else np.zeros(0)
    floor = max(float(peak.max()) * 1e-4 if n else 0.0, 1e-12)
    return (margin * np.maximum(peak, floor)).astype(np.float32)
