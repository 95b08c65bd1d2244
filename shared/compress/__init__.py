"""Update compression: codecs that shrink the tensors a payload carries, both directions.

A ``Codec`` turns a float32 vector of ``n`` values into a few named tensors whose layout
depends only on ``n`` and the codec's parameters (``Codec.layout``), so the receiver knows
every size before a byte arrives and refuses anything else as it refuses an off-schema
upload. ``section.py`` applies a codec to a payload section (its floating tensors, as one
vector, as the change against a base the receiver also holds); ``spec.py`` parses the run's
``--compress up=...,down=...``; codecs are registered under the ``fedattn.codecs`` entry
point, as methods are, so a user can add one.

Built in: ``fp16`` and ``bf16`` (2 bytes a value), ``int8[:BLOCK]`` and ``int4[:BLOCK]``
(block absmax scale, stochastic rounding: unbiased, and summable under SecAgg+), and
``topk:FRACTION`` (biased: use it with ``+ef``, whose residuals ``feedback.Residuals`` keeps).
"""

from .codec import Codec, CodecChoice, Parts
from .feedback import Residuals, section_key
from .registry import available_codecs, load_codec
from .spec import CompressSpec

__all__ = ["Codec", "CodecChoice", "CompressSpec", "Parts", "Residuals", "available_codecs",
           "load_codec", "section_key"]
