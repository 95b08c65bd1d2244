"""The run's codecs applied to whole payloads, the same way on both daemons.

``UplinkCompression`` is what the edge's ``Compression`` middleware encodes with and what
the server's ``Compressed`` driver checks and decodes with: one object, built from the
method and the run's ``up`` codec on each side, so the rule for every section (the
method's ``compression`` constant: delta, values or exact) cannot differ between them.

``DownlinkReference`` is the downlink's bookkeeping (``--compress down=``): the global as
the edges reconstruct it (R). The server codes each new global as its change against R,
D = codec(G - R), and moves R by exactly what an edge applying D computes, R + decode(D);
so an edge holding R gets D, any other edge gets R whole, and no error accumulates
between the server's global and what the edges hold. The edge keeps its own R the same
way. Both sides compute R + decode(D) with the same float32 operations on CPU, so their R
are bit-identical.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..schema import Kind, Payload, Section, SectionSpec, TensorSpec, UploadContract
from ..wire.payload import WireError
from .codec import CodecChoice
from .section import compressible, decode_section, encode_section, encoded_spec, vector_length


def kind_base(common: Payload, kind: Kind) -> dict[str, torch.Tensor]:
    """The common downlink's tensors of ``kind`` (every section of it), by name: the base
    an upload of that kind is coded against ("delta" rule)."""
    base: dict[str, torch.Tensor] = {}
    for section in common.sections:
        if section.kind == kind:
            base.update(section.tensors)
    return base


def section_spec(section: Section) -> SectionSpec:
    """The exact spec of a section as it is (a downlink section: every tensor required)."""
    return SectionSpec(section.kind, section.name,
                       {name: TensorSpec(t.dtype, tuple(t.shape))
                        for name, t in section.tensors.items()})


@dataclass
class Encoded:
    """One section as it leaves: its codec label and the bytes it stands for decoded."""

    label: str
    raw_bytes: int


class UplinkCompression:
    """The up codec with the method's per-kind rules (see the module doc)."""

    def __init__(self, method: UploadContract, models: dict, choice: CodecChoice,
                 changes: bool = False):
        self.method, self.models, self.choice = method, models, choice
        self.rules = dict(method.compression)
        if changes:
            # --mode async: the edge uploads its change already (fl_edge UploadChanges),
            # so a "delta" section is coded as the values it holds.
            self.rules = {kind: "values" if rule == "delta" else rule
                          for kind, rule in self.rules.items()}
        self._specs: dict[str, dict[tuple[Kind, str], SectionSpec]] = {}

    def specs(self, phase: str) -> dict[tuple[Kind, str], SectionSpec]:
        """The method's upload schema of ``phase`` by (kind, name), built once."""
        if phase not in self._specs:
            self._specs[phase] = {(s.kind, s.name): s
                                  for s in self.method.uplink_schema(phase, self.models)}
        return self._specs[phase]

    def rule(self, spec: SectionSpec) -> str:
        """"delta", "values" or "exact" for this section (exact when it cannot be coded)."""
        rule = self.rules.get(spec.kind, "exact")
        return rule if compressible(spec) else "exact"

    def schema(self, phase: str) -> list[SectionSpec]:
        """The phase's upload schema as it travels: coded sections as their codec parts."""
        return [encoded_spec(spec, self.choice.codec) if self.rule(spec) != "exact" else spec
                for spec in self.specs(phase).values()]

    def _coded(self, phase: str, section: Section, common: Payload
               ) -> tuple[SectionSpec | None, dict[str, torch.Tensor] | None]:
        """The section's spec when the codec codes it (None: it travels as it is), and the
        base it is coded against (None: its values themselves)."""
        spec = self.specs(phase).get((section.kind, section.name))
        if spec is None or self.rule(spec) == "exact":
            return None, None
        return spec, kind_base(common, spec.kind) if self.rule(spec) == "delta" else None

    def encode(self, phase: str, upload: Payload, common: Payload,
               generator: torch.Generator,
               residuals: dict[str, torch.Tensor] | None = None
               ) -> tuple[Payload, dict[tuple[Kind, str], Encoded]]:
        """The upload coded; ``residuals`` (error feedback, updated in place, keyed
        ``phase/kind/section``) when the codec has +ef. Returns the coded payload and, per
        coded section, its codec label and decoded size (what the accounting reports)."""
        sections, coded = [], {}
        for section in upload.sections:
            spec, base = self._coded(phase, section, common)
            if spec is None:
                sections.append(section)
                continue
            section = Section(section.kind, section.name,
                              {n: t.detach().cpu() for n, t in section.tensors.items()})
            residual = None
            key = f"{phase}/{spec.kind.label}/{spec.name}"
            if self.choice.feedback and residuals is not None:
                residual = residuals.get(key)
                if residual is None or residual.numel() != vector_length(spec):
                    residual = torch.zeros(vector_length(spec))
            out, residual = encode_section(section, spec, self.choice.codec, base, generator,
                                           residual)
            if residual is not None and residuals is not None:
                residuals[key] = residual
            sections.append(out)
            coded[(section.kind, section.name)] = Encoded(self.choice.label, spec.nbytes)
        return Payload(sections), coded

    def decode(self, phase: str, upload: Payload, common: Payload) -> Payload:
        """The upload as the edge's tensors (its layout already matched ``schema``).
        WireError names the part whose values no honest encoder produces."""
        sections = []
        for section in upload.sections:
            spec, base = self._coded(phase, section, common)
            if spec is None:
                sections.append(section)
                continue
            try:
                sections.append(decode_section(section, spec, self.choice.codec, base))
            except WireError as err:
                raise WireError(f"section {spec.kind.label}:{spec.name!r}: {err}") from None
        return Payload(sections)

    def coded_sizes(self, phase: str) -> dict[tuple[Kind, str], Encoded]:
        """Per coded section of the phase: its label and decoded size (accounting)."""
        return {(s.kind, s.name): Encoded(self.choice.label, s.nbytes)
                for s in self.specs(phase).values() if self.rule(s) != "exact"}


def same_layout(a: Payload, b: Payload) -> bool:
    """Whether two payloads hold the same sections and tensors (names, dtypes, shapes)."""
    if len(a.sections) != len(b.sections):
        return False
    for x, y in zip(a.sections, b.sections, strict=True):
        if (x.kind, x.name) != (y.kind, y.name) or list(x.tensors) != list(y.tensors):
            return False
        for name, t in x.tensors.items():
            u = y.tensors[name]
            if t.dtype != u.dtype or tuple(t.shape) != tuple(u.shape):
                return False
    return True


def same_values(a: Payload, b: Payload) -> bool:
    """Whether two payloads of the same layout hold the same values, bit for bit (the
    aggregator replaces tensors when it changes them, so identity settles most)."""
    for x, y in zip(a.sections, b.sections, strict=True):
        for name, t in x.tensors.items():
            u = y.tensors[name]
            if t is not u and not torch.equal(t.reshape(-1).view(torch.uint8),
                                              u.reshape(-1).view(torch.uint8)):
                return False
    return True


def apply_delta(reference: Payload, delta: Payload, choice: CodecChoice) -> Payload:
    """R + decode(D), section by section (the same operations on both daemons). WireError
    names the section and part of a delta that does not fit R or holds bad values."""
    if len(reference.sections) != len(delta.sections):
        raise WireError(f"a downlink delta of {len(delta.sections)} sections for a reference "
                        f"of {len(reference.sections)}")
    sections = []
    for ref, d in zip(reference.sections, delta.sections, strict=True):
        spec = section_spec(ref)
        label = f"{ref.kind.label}:{ref.name!r}"
        if (d.kind, d.name) != (ref.kind, ref.name):
            raise WireError(f"downlink delta section {d.kind.label}:{d.name!r}, expected {label}")
        expected = encoded_spec(spec, choice.codec)
        for name, t in expected.tensors.items():
            got = d.tensors.get(name)
            if got is None or got.dtype != t.dtype or tuple(got.shape) != tuple(t.shape):
                raise WireError(f"downlink delta section {label}: tensor {name!r} missing or "
                                f"not {t.dtype} {list(t.shape)}")
        if set(d.tensors) != set(expected.tensors):
            raise WireError(f"downlink delta section {label}: unexpected tensors")
        if not compressible(spec):
            sections.append(Section(ref.kind, ref.name, {n: t.clone() for n, t in d.tensors.items()}))
            continue
        try:
            sections.append(decode_section(d, spec, choice.codec, ref.tensors))
        except WireError as err:
            raise WireError(f"downlink delta section {label}: {err}") from None
    return Payload(sections)


def copy_payload(payload: Payload) -> Payload:
    """A payload whose tensors own their memory (a received one views a reused buffer)."""
    return Payload([Section(s.kind, s.name, {n: t.detach().clone() for n, t in s.tensors.items()})
                    for s in payload.sections])


class DownlinkReference:
    """The server's R (module doc): ``publish(G)`` returns what every edge holds after this
    version (R, whole) and, when edges holding the previous R can get there by a delta,
    (the previous R's id, D). ``published(id)`` names the id R went out under."""

    def __init__(self, choice: CodecChoice, seed: int):
        self.choice = choice
        self.seed = seed
        self.source: Payload | None = None   # the G that R was made from
        self.reference: Payload | None = None  # R
        self.reference_id = ""
        self.delta: tuple[str, Payload] | None = None
        self.versions = 0

    def publish(self, global_: Payload) -> tuple[Payload, tuple[str, Payload] | None]:
        """R for global ``global_`` and the delta that leads to it (None: none applies)."""
        if self.source is not None and same_layout(self.source, global_) \
                and same_values(self.source, global_):
            return self.reference, self.delta
        previous, previous_id = self.reference, self.reference_id
        self.source = global_
        self.versions += 1
        if previous is None or not same_layout(previous, global_):
            self.reference, self.delta = global_, None
            return self.reference, None
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.versions)
        sections = []
        for ref, new in zip(previous.sections, global_.sections, strict=True):
            spec = section_spec(new)
            coded, _ = encode_section(new, spec, self.choice.codec, ref.tensors, generator)
            sections.append(coded)
        delta = Payload(sections)
        self.reference = apply_delta(previous, delta, self.choice)
        self.delta = (previous_id, delta) if previous_id else None
        return self.reference, self.delta

    def published(self, common_id: str) -> None:
        """R went out under ``common_id``: the base id of the next delta."""
        self.reference_id = common_id


class EdgeReference:
    """The edge's R and its id: a whole common downlink replaces it, a delta moves it
    (after checking it applies to the R held), a cached id returns it."""

    def __init__(self, choice: CodecChoice):
        self.choice = choice
        self.reference: Payload | None = None
        self.reference_id = ""

    def receive(self, common_id: str, base_id: str, common: Payload) -> tuple[Payload, bool]:
        """R after this downlink, and whether it changed by a delta (the caller keeps the
        new R on disk then: what arrived was D, not R)."""
        if self.reference is not None and common_id == self.reference_id:
            return self.reference, False
        if not base_id:
            self.reference, self.reference_id = copy_payload(common), common_id
            return self.reference, False
        if self.reference is None or base_id != self.reference_id:
            held = self.reference_id or "nothing"
            self.reference, self.reference_id = None, ""
            raise WireError(f"common downlink is a delta to {base_id[:40]!r}; this edge "
                            f"holds {held[:40]!r}")
        # Non-floating tensors of D view the receive buffer, which the session reuses.
        self.reference = copy_payload(apply_delta(self.reference, common, self.choice))
        self.reference_id = common_id
        return self.reference, True


def coded_sections(reference: Payload, choice: CodecChoice) -> dict[tuple[Kind, str], Encoded]:
    """Per section of a downlink delta to ``reference`` that the codec codes: its label and
    decoded size (what the accounting reports as raw bytes)."""
    out = {}
    for section in reference.sections:
        spec = section_spec(section)
        if compressible(spec):
            out[(section.kind, section.name)] = Encoded(choice.label, spec.nbytes)
    return out
