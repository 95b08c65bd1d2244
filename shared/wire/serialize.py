"""Payloads (``schema.py``) <-> a protobuf manifest plus raw little-endian bytes.

Serialization only, lossless (the lossy value codecs are ``compress/``). On the wire a
payload is a manifest (kinds, names, dtypes, shapes, total size, CRC-32) followed by the
tensors' raw bytes in manifest order; how those bytes are cut into chunks and received
back is ``transport``'s part.
"""

from __future__ import annotations

import functools
import math
import mmap
import sys
from dataclasses import dataclass

import torch
from zlib_ng import zlib_ng

from ..schema import Kind, Payload, Section
from ..tensors import contiguous_run
from . import fedattn_pb2 as pb
from .payload import SectionLayout, TensorViews, WireError, tensor_entries
from .signing import BodyMac

# The payload checksum: zlib's CRC-32, computed by zlib-ng's (4x faster on 1 MiB chunks;
# the CRC costs more than the copy of every received chunk). Same values as zlib.crc32.
crc32 = zlib_ng.crc32

if sys.byteorder != "little":  # pragma: no cover - every supported edge is little-endian
    raise ImportError("fedattn's wire serializer assumes a little-endian host")

MAX_TENSOR_DIMS = 8
# A manifest entry is ~50 bytes per tensor: 256 KiB covers models of thousands of tensors.
MAX_REMEMBERED_LAYOUT_BYTES = 256 << 10


_TORCH_TO_WIRE = {
    torch.float32: pb.FLOAT32,
    torch.float16: pb.FLOAT16,
    torch.bfloat16: pb.BFLOAT16,
    torch.float64: pb.FLOAT64,
    torch.int64: pb.INT64,
    torch.int32: pb.INT32,
    torch.uint8: pb.UINT8,
    torch.int8: pb.INT8,
    torch.bool: pb.BOOL,
}
_WIRE_TO_TORCH = {v: k for k, v in _TORCH_TO_WIRE.items()}
_NUMPY_NATIVE = frozenset(_TORCH_TO_WIRE) - {torch.bfloat16, torch.bool}


def wire_dtype(dtype: torch.dtype) -> int:
    try:
        return _TORCH_TO_WIRE[dtype]
    except KeyError:
        raise WireError(f"dtype {dtype} cannot travel on the wire") from None


def torch_dtype(code: int) -> torch.dtype:
    try:
        return _WIRE_TO_TORCH[code]
    except KeyError:
        raise WireError(f"unknown wire dtype code {code}") from None


def dtype_name(code: int) -> str:
    return pb.DType.Name(code) if code in pb.DType.values() else f"dtype#{code}"


def _checked_shape(meta: pb.TensorMeta) -> tuple[int, ...]:
    shape = tuple(meta.shape)
    if len(shape) > MAX_TENSOR_DIMS:
        raise WireError(f"tensor {meta.name!r}: {len(shape)} dims (max {MAX_TENSOR_DIMS})")
    if shape and min(shape) < 0:
        raise WireError(f"tensor {meta.name!r}: negative dimension in shape {list(shape)}")
    return shape


def section_layout(meta: pb.SectionMeta) -> SectionLayout:
    """The layout of a section's manifest. A model's manifest repeats every round, and
    walking hundreds of tensor entries costs about 1 ms of Python each time a payload is
    validated, sized or decoded, so layouts are remembered by the manifest's bytes (up to
    a size, so that a peer sending large manifests cannot fill memory with them)."""
    serialized = meta.SerializeToString()
    if len(serialized) > MAX_REMEMBERED_LAYOUT_BYTES:
        return _layout_of_serialized.__wrapped__(serialized)
    return _layout_of_serialized(serialized)


@functools.lru_cache(maxsize=64)
def _layout_of_serialized(serialized: bytes) -> SectionLayout:
    meta = pb.SectionMeta.FromString(serialized)
    names = tuple(t.name for t in meta.tensors)
    if len(set(names)) != len(names):
        duplicate = next(n for i, n in enumerate(names) if n in names[:i])
        raise WireError(f"section {meta.name!r}: duplicate tensor {duplicate!r}")
    dtypes = tuple(torch_dtype(t.dtype) for t in meta.tensors)
    shapes = tuple(_checked_shape(t) for t in meta.tensors)
    counts = tuple(math.prod(shape) for shape in shapes)
    nbytes = sum(n * d.itemsize for n, d in zip(counts, dtypes, strict=True))
    return SectionLayout(names, dtypes, shapes, counts, nbytes)


def section_sizes(manifest: pb.PayloadManifest) -> list[int]:
    """Byte length of each section as the manifest declares it (validated)."""
    return [section_layout(s).nbytes for s in manifest.sections]


@dataclass
class EncodedPayload:
    """A payload laid out for sending: its manifest and each section's raw bytes."""

    manifest: pb.PayloadManifest
    section_kinds: list[Kind]
    section_views: list[list[memoryview]]

    @property
    def total_bytes(self) -> int:
        return self.manifest.total_bytes

    def body_mac(self, key: bytes, iv: bytes) -> bytes:
        """GMAC tag of the data as sent (all chunks in order), read from tensor memory."""
        mac = BodyMac(key, iv)
        for views in self.section_views:
            for view in views:
                mac.update(view)
        return mac.tag()


def _raw_view(tensor: torch.Tensor) -> memoryview:
    if tensor.numel() == 0:
        return memoryview(b"")  # a cast refuses zeros in the shape
    flat = tensor.detach()
    # Each conversion only when needed: a model has hundreds of tensors, and every torch
    # call costs microseconds of Python per tensor per upload.
    if flat.device.type != "cpu":
        flat = flat.cpu()
    if not flat.is_contiguous():
        flat = flat.contiguous()
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    elif flat.dtype not in _NUMPY_NATIVE:  # bfloat16 has no numpy type: read its bytes
        flat = flat.reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy()).cast("B")


@functools.lru_cache(maxsize=64)
def _section_meta(kind: int, name: str,
                  tensors: tuple[tuple[str, torch.dtype, tuple[int, ...]], ...]) -> pb.SectionMeta:
    """A section's manifest entry (hundreds of protobuf appends for a model, the same
    every round: built once). Callers copy it (``append``), never change it."""
    meta = pb.SectionMeta(kind=kind, name=name)
    for tensor_name, dtype, shape in tensors:
        meta.tensors.add(name=tensor_name, dtype=wire_dtype(dtype), shape=list(shape))
    return meta


def _flat_of(section: Section) -> torch.Tensor | None:
    """The section's tensors as one vector, when they are laid out as one (a view per
    tensor costs ~8 us of Python, hundreds per model per upload)."""
    if isinstance(section.tensors, TensorViews):
        return section.tensors.flat
    return contiguous_run(section.tensors.values())


def encode(payload: Payload, checksum: bool = True) -> EncodedPayload:
    """``checksum=False`` leaves the manifest's CRC-32 at 0: for uploads, whose bytes the
    edge's signed body MAC already binds (the server checks that instead)."""
    manifest = pb.PayloadManifest()
    crc = 0
    total = 0
    kinds: list[Kind] = []
    views: list[list[memoryview]] = []
    for section in payload.sections:
        manifest.sections.append(_section_meta(int(section.kind), section.name,
                                               tensor_entries(section.tensors)))
        flat = _flat_of(section)
        section_views = []
        for tensor in (section.tensors.values() if flat is None else (flat,)):
            view = _raw_view(tensor)
            if checksum:
                crc = crc32(view, crc)
            total += len(view)
            section_views.append(view)
        kinds.append(Kind(section.kind))
        views.append(section_views)
    manifest.total_bytes = total
    manifest.crc32 = crc
    return EncodedPayload(manifest=manifest, section_kinds=kinds, section_views=views)


def decode(manifest: pb.PayloadManifest, data: bytes | bytearray) -> Payload:
    """Tensors view ``data`` without copying when it is a writable buffer (a bytearray or
    a writable memory map)."""
    buffer = data if isinstance(data, (bytearray, mmap.mmap)) else bytearray(data)
    payload = Payload()
    offset = 0
    for meta in manifest.sections:
        section = Section(kind=Kind(meta.kind), name=meta.name)
        layout = section_layout(meta)
        if offset + layout.nbytes > len(buffer):
            raise WireError(f"section {meta.name!r} runs past the end of the data")
        dtype = layout.single_dtype
        if dtype is not None:
            # One view of the section's bytes, tensors as views of it made by one split
            # (per-tensor slicing costs ~10 us of Python each, hundreds per model).
            count = sum(layout.counts)
            flat = (torch.frombuffer(buffer, dtype=dtype, count=count, offset=offset)
                    if count else torch.empty(0, dtype=dtype))
            section.tensors = TensorViews(flat, layout)
            section.flat = flat
        else:
            start = offset
            for name, dtype, shape, count in zip(layout.names, layout.dtypes, layout.shapes,
                                                 layout.counts, strict=True):
                if count:
                    read_as = torch.uint8 if dtype == torch.bool else dtype
                    tensor = torch.frombuffer(buffer, dtype=read_as, count=count, offset=start)
                    if dtype == torch.bool:
                        tensor = tensor.to(torch.bool)
                else:
                    tensor = torch.empty(0, dtype=dtype)
                section.tensors[name] = tensor.reshape(shape)
                start += count * dtype.itemsize
        offset += layout.nbytes
        payload.sections.append(section)
    if offset != len(buffer):
        raise WireError(f"{len(buffer) - offset} bytes of data beyond the declared tensors")
    return payload
