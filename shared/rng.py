"""The lock on torch's global RNG, shared by everything that seeds and draws from it.

torch's global RNG is one per process; fl-sim hosts several edges as threads of one
process. Building a method's models (``Method.build_models``: seeded, then every layer's
initialisation draws from it) and a deterministic training round (``fl_edge.trainer``)
must each run alone on it, or their draws interleave in an order that depends on thread
scheduling and a fixed seed stops giving the same models and rounds. A lock, not state:
re-entrant, because a method may build models inside its own round.
"""

from __future__ import annotations

import threading

GLOBAL_RNG_LOCK = threading.RLock()
