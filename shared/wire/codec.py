"""Tensor payloads <-> protobuf manifests plus raw little-endian bytes, in chunks.

A payload is an ordered list of sections; each section has one kind and an ordered set
of named tensors. On the wire a payload is a manifest (kinds, names, dtypes, shapes,
total size, CRC-32) followed by the tensors' raw bytes in manifest order, cut into data
chunks that never span two sections (so every chunk's bytes are attributable to one
kind). Receiving is bounded: the manifest is checked against a byte cap before any
buffer is allocated, each chunk against the declared layout, and the CRC at the end.
"""

from __future__ import annotations

import enum
import functools
import math
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch
from zlib_ng import zlib_ng

from . import fedattn_pb2 as pb
from .signing import BodyMac

# The payload checksum: zlib's CRC-32, computed by zlib-ng's (4x faster on 1 MiB chunks;
# the CRC costs more than the copy of every received chunk). Same values as zlib.crc32.
crc32 = zlib_ng.crc32

if sys.byteorder != "little":  # pragma: no cover - every supported edge is little-endian
    raise ImportError("fedattn's wire codec assumes a little-endian host")

DEFAULT_CHUNK_BYTES = 1 << 20
MAX_TENSOR_DIMS = 8
# A manifest entry is ~50 bytes per tensor: 256 KiB covers models of thousands of tensors.
MAX_REMEMBERED_LAYOUT_BYTES = 256 << 10


class WireError(ValueError):
    """A payload or message that does not match what was declared or expected."""


class Kind(enum.IntEnum):
    SHARED_TENSORS = pb.SHARED_TENSORS
    STAT_VECTORS = pb.STAT_VECTORS
    SCALAR_SUMMARY = pb.SCALAR_SUMMARY
    PROTOTYPES = pb.PROTOTYPES
    CONTROL = pb.CONTROL
    SECAGG = pb.SECAGG

    @property
    def label(self) -> str:
        return self.name.lower()


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


@dataclass
class Section:
    kind: Kind
    name: str = ""
    # A dict, or for a decoded section the lazily made views of ``flat`` (TensorViews).
    tensors: Mapping[str, torch.Tensor] = field(default_factory=dict)
    # Set by ``decode`` when every tensor of the section has one dtype: a 1-D view of all
    # of them in order, so whole-section checks and sums take one operation, not one per
    # tensor.
    flat: torch.Tensor | None = field(default=None, compare=False, repr=False)

    @property
    def raw_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


@dataclass
class Payload:
    sections: list[Section] = field(default_factory=list)

    def get(self, kind: Kind, name: str = "") -> Section | None:
        for section in self.sections:
            if section.kind == kind and section.name == name:
                return section
        return None

    def tensors(self, kind: Kind, name: str = "") -> dict[str, torch.Tensor]:
        section = self.get(kind, name)
        return section.tensors if section is not None else {}

    @property
    def raw_bytes(self) -> int:
        return sum(s.raw_bytes for s in self.sections)


def _checked_shape(meta: pb.TensorMeta) -> tuple[int, ...]:
    shape = tuple(meta.shape)
    if len(shape) > MAX_TENSOR_DIMS:
        raise WireError(f"tensor {meta.name!r}: {len(shape)} dims (max {MAX_TENSOR_DIMS})")
    if shape and min(shape) < 0:
        raise WireError(f"tensor {meta.name!r}: negative dimension in shape {list(shape)}")
    return shape


@dataclass(frozen=True)
class SectionLayout:
    """A section's tensors as its manifest declares them, validated: names unique, dtypes
    known, shapes of at most MAX_TENSOR_DIMS non-negative dimensions."""

    names: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...]
    shapes: tuple[tuple[int, ...], ...]
    counts: tuple[int, ...]  # elements per tensor
    nbytes: int

    @property
    def single_dtype(self) -> torch.dtype | None:
        """The dtype of every tensor, when they share one that can be viewed in place
        (bool travels as bytes and is converted)."""
        if self.dtypes and self.dtypes[0] != torch.bool and len(set(self.dtypes)) == 1:
            return self.dtypes[0]
        return None


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


class TensorViews(Mapping[str, torch.Tensor]):
    """A decoded section's tensors: views of its flat vector, made on first use. A model's
    hundreds of views cost ~1 ms of Python per payload, and a server that sums whole
    sections, or an edge that loads them whole, never needs them. Names (iteration,
    ``len``) come from the layout without making any."""

    __slots__ = ("flat", "layout", "_views")

    def __init__(self, flat: torch.Tensor, layout: SectionLayout):
        self.flat = flat
        self.layout = layout
        self._views: dict[str, torch.Tensor] | None = None

    def _made(self) -> dict[str, torch.Tensor]:
        if self._views is None:
            # One split, not a slice per tensor (~10 us of Python each).
            self._views = {
                name: piece.view(shape) for name, shape, piece in zip(
                    self.layout.names, self.layout.shapes,
                    self.flat.split_with_sizes(self.layout.counts), strict=True)}
        return self._views

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._made()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.layout.names)

    def __len__(self) -> int:
        return len(self.layout.names)

    def __contains__(self, name: object) -> bool:
        return name in self._made()

    def items(self):
        return self._made().items()

    def values(self):
        return self._made().values()

    def to(self, device: torch.device) -> TensorViews:
        """The same views on ``device``: one copy of the flat vector, not one per tensor."""
        return self if self.flat.device == device else TensorViews(self.flat.to(device),
                                                                    self.layout)

    def __repr__(self) -> str:
        return f"TensorViews({len(self)} tensors, {self.flat.dtype}, {self.flat.numel()} elements)"


def tensor_entries(tensors: Mapping[str, torch.Tensor]
                   ) -> tuple[tuple[str, torch.dtype, tuple[int, ...]], ...]:
    """(name, dtype, shape) of each tensor, in order: for a decoded section, from its
    layout, without making its views."""
    if isinstance(tensors, TensorViews):
        layout = tensors.layout
        return tuple(zip(layout.names, layout.dtypes, layout.shapes, strict=True))
    return tuple((name, t.dtype, tuple(t.shape)) for name, t in tensors.items())


def contiguous_run(tensors: Iterable[torch.Tensor]) -> torch.Tensor | None:
    """A 1-D view spanning ``tensors`` when they lie back to back, in this order, in one
    storage (one dtype, each contiguous); None otherwise. Such tensors are read or written
    as one (an edge keeps its shared parameters that way; a mean's tensors are views of
    one vector). About 1 us a tensor: four attribute reads each, no more."""
    first: torch.Tensor | None = None
    dtype = None
    end = 0
    for tensor in tensors:
        if dtype is None:
            dtype = tensor.dtype
        elif tensor.dtype is not dtype:
            return None
        nbytes = tensor.nbytes
        if not nbytes:
            continue
        if first is None:
            first, end = tensor, tensor.data_ptr()
        if tensor.data_ptr() != end or not tensor.is_contiguous():
            return None
        end += nbytes
    if first is None:
        return None
    storage = first.untyped_storage()
    # The chain must stay inside the first tensor's storage: it could otherwise run on
    # into a neighbouring allocation (another storage, or another device's memory).
    if end > storage.data_ptr() + storage.nbytes():
        return None
    return torch.empty(0, dtype=first.dtype, device=first.device).set_(
        storage, first.storage_offset(), ((end - first.data_ptr()) // first.element_size(),),
        (1,))


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

    def chunk_views(self, chunk_bytes: int = DEFAULT_CHUNK_BYTES
                    ) -> Iterator[tuple[Kind, list[memoryview]]]:
        """Each data chunk as the views of tensor memory it spans (at most ``chunk_bytes``,
        inside one section), so a sender copies the bytes once, into its frame."""
        if chunk_bytes < 1:  # 0 would yield empty chunks forever
            raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        for kind, views in zip(self.section_kinds, self.section_views, strict=True):
            pending: list[memoryview] = []
            size = 0
            for view in views:
                offset = 0
                while offset < len(view):
                    take = min(chunk_bytes - size, len(view) - offset)
                    pending.append(view[offset : offset + take])
                    size += take
                    offset += take
                    if size == chunk_bytes:
                        yield kind, pending
                        pending, size = [], 0
            if size:
                yield kind, pending

    def chunks(self, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[tuple[Kind, bytes]]:
        """Data chunks of at most ``chunk_bytes``, each inside one section."""
        for kind, views in self.chunk_views(chunk_bytes):
            yield kind, b"".join(views)

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


class BufferPool:
    """Receive buffers kept for reuse. A fresh buffer of tens of MB costs a page fault per
    4 KiB on first touch, for every upload; a server reuses a few instead. Not thread-safe:
    use it from one thread (the server's event loop)."""

    def __init__(self, keep: int):
        self.keep = keep
        self._free: dict[int, list[bytearray]] = {}

    def take(self, size: int) -> bytearray:
        free = self._free.get(size)
        return free.pop() if free else bytearray(size)

    def give(self, buffer: bytearray) -> None:
        free = self._free.setdefault(len(buffer), [])
        if len(free) < self.keep:
            free.append(buffer)


class PayloadAssembler:
    """Receives one payload chunk by chunk, refusing anything off the declared layout."""

    def __init__(self, manifest: pb.PayloadManifest, max_bytes: int, max_chunk_bytes: int,
                 pool: BufferPool | None = None, sizes: list[int] | None = None,
                 checksum: bool = True):
        """``sizes``: each section's byte length, when the caller has already checked the
        manifest's shapes against a schema (walking a large manifest again costs ~1 ms).
        ``checksum=False`` skips the CRC-32: for uploads, checked by their body MAC."""
        seen_sections = set()
        for section in manifest.sections:
            if section.kind not in Kind._value2member_map_:
                raise WireError(f"section {section.name!r}: unknown kind {section.kind}")
            if (section.kind, section.name) in seen_sections:
                raise WireError(f"section {Kind(section.kind).label}:{section.name!r} appears twice")
            seen_sections.add((section.kind, section.name))
        # Sizing validates each section's tensor entries (unique names, known dtypes).
        self.sizes = section_sizes(manifest) if sizes is None else sizes
        declared = sum(self.sizes)
        if declared != manifest.total_bytes:
            raise WireError(
                f"manifest total_bytes {manifest.total_bytes} != {declared} implied by shapes"
            )
        if declared > max_bytes:
            raise WireError(f"payload of {declared} bytes exceeds the cap of {max_bytes}")
        self.manifest = manifest
        self.max_chunk_bytes = max_chunk_bytes
        self.buffer = pool.take(declared) if pool is not None else bytearray(declared)
        self._bytes = np.frombuffer(self.buffer, dtype=np.uint8)
        self.received = 0  # bytes booked by ``reserve``
        self.written = 0  # bytes copied in by ``write``
        self.checksum = checksum
        self.crc = 0
        self._section = 0
        self._section_end = self.sizes[0] if self.sizes else 0
        self._skip_empty_sections()

    def _skip_empty_sections(self) -> None:
        while self._section < len(self.sizes) and self.received == self._section_end:
            self._section += 1
            if self._section < len(self.sizes):
                self._section_end += self.sizes[self._section]

    def current_kind(self) -> Kind:
        if self._section >= len(self.sizes):
            raise WireError("data chunk after the declared payload ended")
        return Kind(self.manifest.sections[self._section].kind)

    def add(self, chunk: bytes) -> Kind:
        """Append one chunk; returns the kind of the section it belongs to."""
        kind, offset = self.reserve(chunk)
        self.write(offset, chunk)
        return kind

    def reserve(self, chunk: bytes) -> tuple[Kind, int]:
        """Checks one chunk against the declared layout and books its place: returns the
        kind of its section and its offset. Its bytes go in with ``write``."""
        kind = self.current_kind()
        if len(chunk) == 0:
            raise WireError("empty data chunk")
        if len(chunk) > self.max_chunk_bytes:
            raise WireError(f"chunk of {len(chunk)} bytes exceeds {self.max_chunk_bytes}")
        end = self.received + len(chunk)
        if end > self._section_end:
            raise WireError(
                f"chunk crosses the end of section {self._section} "
                f"({self.manifest.sections[self._section].name!r})"
            )
        offset = self.received
        self.received = end
        self._skip_empty_sections()
        return kind, offset

    def write(self, offset: int, chunk: bytes) -> None:
        """Copies a reserved chunk into place and folds it into the CRC-32, in the order
        the chunks were reserved. The copy (numpy's) and the CRC (zlib-ng's) release the
        GIL, so a server runs this on a worker thread while its event loop goes on."""
        if offset != self.written:
            raise WireError(f"chunk written at {offset}, expected {self.written}")
        end = offset + len(chunk)
        self._bytes[offset:end] = np.frombuffer(chunk, dtype=np.uint8)
        if self.checksum:
            self.crc = crc32(chunk, self.crc)
        self.written = end

    @property
    def complete(self) -> bool:
        """Every declared byte has been reserved."""
        return self.received == len(self.buffer)

    def finish(self) -> Payload:
        if not self.complete or self.written != len(self.buffer):
            raise WireError(f"payload truncated: {self.written} of {len(self.buffer)} bytes")
        if self.checksum and self.crc != self.manifest.crc32:
            raise WireError(f"payload CRC-32 mismatch ({self.crc:#010x} != {self.manifest.crc32:#010x})")
        return decode(self.manifest, self.buffer)


def decode(manifest: pb.PayloadManifest, data: bytes | bytearray) -> Payload:
    """Tensors view ``data`` without copying when it is a writable buffer."""
    buffer = data if isinstance(data, bytearray) else bytearray(data)
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


def nonfinite_tensors(payload: Payload) -> list[str]:
    """Names (section/tensor) of floating tensors holding NaN or Inf."""
    bad = []
    for section in payload.sections:
        flat = section.flat
        # NaN and Inf survive a sum, and a sum allocates nothing: a finite section sum
        # proves every element finite. A non-finite sum may still be an overflow of finite
        # values, so only then is each tensor checked element by element.
        if flat is not None and flat.is_floating_point() and bool(torch.isfinite(flat.sum())):
            continue
        for name, tensor in section.tensors.items():
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                bad.append(f"{section.kind.label}:{section.name}/{name}" if section.name
                           else f"{section.kind.label}/{name}")
    return bad
