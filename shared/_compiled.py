"""The numba loops behind ``kernels`` (imported only through it: numba is optional).

Compiled on first call for the array types given (numba reads the types of the
arguments, not the annotations), cached on disk beside this file (or in
numba's user cache directory when that is read-only); ``nogil`` so that the exact sum's
slice workers run on several cores. No fast-math anywhere: see ``kernels``.
"""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(cache=True, nogil=True)
def pair_add(hi: np.ndarray, lo: np.ndarray, values: np.ndarray, weight: float) -> None:
    """``methods.exact_sum.two_sum`` in one loop: the product ``weight * values`` rounded
    once to float64 (``values`` float32 or float64, cast exactly first), added into the
    compensated pair (``hi``, ``lo``) by TwoSum, the new sum left in ``hi``."""
    for i in range(hi.shape[0]):
        p = np.float64(values[i]) * weight
        h = hi[i]
        s = h + p
        b = s - h                       # the part of p that reached s
        lo[i] += (h - (s - b)) + (p - b)  # the exact error, as two_sum's passes
        hi[i] = s


@numba.njit(cache=True, nogil=True)
def any_exponent_full(bits: np.ndarray, mask: np.unsignedinteger) -> bool:
    """Whether any value's exponent bits (``mask``) are all set, i.e. any value is NaN or
    Inf (``bits``: the values as unsigned integers of their width). No early exit: a loop
    without one vectorizes, and a non-finite upload is refused anyway."""
    found = False
    for i in range(bits.shape[0]):
        found |= (bits[i] & mask) == mask
    return found


def warm() -> None:
    """Compiles (or loads from the cache) each loop for the argument types the server
    passes: float32 and float64 values into the float64 pair; the scan's read-only views
    of 16-, 32- and 64-bit floats' bits."""
    hi, lo = np.zeros(1), np.zeros(1)
    for dtype in (np.float32, np.float64):
        pair_add(hi, lo, np.zeros(1, dtype), 1.0)
    for uint in (np.uint16, np.uint32, np.uint64):
        any_exponent_full(np.frombuffer(bytes(8), dtype=uint), uint(1))


__all__ = ["any_exponent_full", "numba", "pair_add", "warm"]
