"""Integer codecs: the quantizer interface SecAgg+ sums masked values through.

Masks add in a ring, so under ``--secagg`` only integers can be summed masked, and each
edge must put its values on the same grid: one public scale per block of values for
every edge (the server derives it from the previous round's unmasked mean), not each
block's own absmax as the plain codec sends. So the masked path cannot call ``encode``;
it asks the codec for what defines its integers instead:

- ``integer_bits``: the width of one value's integer (the ring grows from it by
  ceil(log2 parties) bits so that no honest sum wraps);
- ``levels`` L: the integers run over [-L, L] (L <= 2^(bits - 1) - 1);
- ``block``: how many values share one scale;
- ``round_levels``: the codec's rounding of a value in level units onto its integers
  (int8/int4: stochastic, so unbiased).

``privacy.secagg_ring.IntegerQuantizer`` scales each value onto the grid (the public
scale, the edge's weight against the public reference weight, clipped to [-L, L]),
rounds it with ``round_levels`` and checks what comes back before it is masked; the
server reads the sum back as sum x scale / L. A codec that implements this class is
masked at its own width with its own rounding; nothing in ``privacy/`` names a codec.
"""

from __future__ import annotations

import abc
from typing import ClassVar

import numpy as np
import torch

from .codec import Codec, CodecChoice

#: The widths SecAgg+ masks at: at most 16 bits a value keeps the ring (the width plus
#: ceil(log2 parties)) within its 32-bit words for up to 65,536 parties.
MIN_BITS, MAX_BITS = 2, 16
MIN_BLOCK, MAX_BLOCK = 8, 65536


class IntegerCodec(Codec):
    """A codec whose values travel as integers in [-``levels``, ``levels``] times one
    float scale per ``block`` values: what SecAgg+ can sum masked (module doc)."""

    integer_bits: ClassVar[int]
    levels: ClassVar[int]
    block: int

    @abc.abstractmethod
    def round_levels(self, t: np.ndarray, generator: torch.Generator) -> np.ndarray:
        """Integers (any numeric dtype, integral values) in [-levels, levels] for ``t``,
        float64 values already in level units and within [-levels, levels]. ``generator``
        (seeded from the task) drives any randomness, so a seeded edge sends the same
        bytes twice."""


def integer_codec(choice: CodecChoice) -> IntegerCodec:
    """The codec of ``choice`` as SecAgg+ masks it; ValueError naming what does not fit
    (not an ``IntegerCodec``, a width or level count the ring cannot hold, a block size
    out of range)."""
    codec = choice.codec
    if not isinstance(codec, IntegerCodec):
        raise ValueError(f"codec {codec.spec!r} does not implement the integer-codec interface "
                         "(fedattn_shared.compress.integer.IntegerCodec): SecAgg+ cannot mask it")
    bits, levels, block = codec.integer_bits, codec.levels, codec.block
    if not (type(bits) is int and MIN_BITS <= bits <= MAX_BITS):
        raise ValueError(f"codec {codec.spec!r}: integer_bits {bits!r} outside "
                         f"[{MIN_BITS}, {MAX_BITS}]")
    if not (type(levels) is int and 1 <= levels <= 2 ** (bits - 1) - 1):
        raise ValueError(f"codec {codec.spec!r}: levels {levels!r} outside [1, "
                         f"{2 ** (bits - 1) - 1}] (what {bits} signed bits hold)")
    if not (type(block) is int and MIN_BLOCK <= block <= MAX_BLOCK):
        raise ValueError(f"codec {codec.spec!r}: block {block!r} outside "
                         f"[{MIN_BLOCK}, {MAX_BLOCK}]")
    return codec
