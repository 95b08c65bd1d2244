"""Compiled loops for the server's passes over model-sized vectors, when numba is
installed (the ``server`` extra: ``pip install 'fedattn[server]'``), else None and the
callers run NumPy's ufuncs.

Why: each NumPy ufunc call is a pass over memory, and the exact sum's compensated
addition (``methods.exact_sum.two_sum``) is eight of them per upload and coordinate;
one compiled loop does the eight operations in registers. The close of a spilled
ResNet-18 round of 8 uploads took 0.70 s of CPU in NumPy passes and 0.16 s in the loop
(bench/exact_sum.py measures it on a machine). The upload scan for NaN/Inf is three
passes (and two temporary arrays) against one.

Same bits: each loop runs, per element, the IEEE operations of the ufunc passes it
replaces, in the same order, compiled without fast-math (LLVM then neither fuses a
multiply and an add nor reorders them); tests/test_exact_sum.py checks that both give
the same bits.

Why a size floor: numba's first call in a process costs ~1 s of CPU (the import and
LLVM's start, the compiled code itself cached on disk), which a daemon pays once and a
small model's round never repays; below ``COMPILED_FROM`` elements NumPy runs.
"""

from __future__ import annotations

import functools
import importlib
import logging
from types import ModuleType

log = logging.getLogger(__name__)

# Elements a pass must reach for the compiled loops to run (MobileNetV3-Small's 1.5 M
# parameters do, LeNet's 60 k do not).
COMPILED_FROM = 1 << 20


@functools.cache
def _load() -> ModuleType | None:
    """``_compiled`` once numba is imported and its loops are defined, else None (numba
    missing, or no writable place for its cache)."""
    try:
        return importlib.import_module("._compiled", __package__)
    except ImportError:
        return None
    except Exception as err:  # numba installed but unusable here: NumPy still works
        log.warning("numba's loops are unusable (%s: %s); NumPy's passes run instead (a "
                    "writable NUMBA_CACHE_DIR lets numba cache its code)", type(err).__name__,
                    err)
        return None


def compiled(size: int) -> ModuleType | None:
    """The compiled loops (``_compiled``) for a pass over ``size`` elements, or None
    when NumPy's passes should run (too small to repay the first call, or no numba)."""
    return _load() if size >= COMPILED_FROM else None


def warm(size: int) -> str:
    """Takes numba's first call now, at a daemon's start, when passes over ``size``
    elements will run compiled, so that the first round does not (it would block the
    event loop for the import); returns what will run the large passes, for the
    start-up log line."""
    if size < COMPILED_FROM:
        return "NumPy passes (a model below 2**20 values)"
    loops = _load()
    if loops is None:
        return "NumPy passes (numba is not installed or unusable: the 'server' extra)"
    loops.warm()
    return f"numba {loops.numba.__version__}"


__all__ = ["COMPILED_FROM", "compiled", "warm"]
