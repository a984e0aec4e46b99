"""The sparse codec's settings: which values of each chunk cross the WAN, and how finely.

``topk`` sends, of every chunk of ``chunk`` values, the ``density`` share of
largest magnitude (their positions and ``bits``-bit values); the rest stays
behind in the site's error feedback and goes in a later round. A job file
names the codec and gives its settings apart::

    train:
      codec: topk
      error_feedback: true
      compressor: {density: 0.02, bits: 2}

On the wire and to the engine the codec is one string that carries them, so a
receiver decodes a chunk from the chunk alone: ``topk:bits=2,chunk=4096,density=0.02``
(optionally ``+zstd``). ``feedback_decay`` rides along too: the engine's error
feedback reads it from the codec it encodes with. This module reads and writes
that string and checks the settings, for every layer (``sim`` may not import
``inter``, so it lives here).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from isthmus.job.basics import FieldError, is_number

SPARSE = "topk"
"""The sparse codec's name, as ``train.codec`` and the codec string start."""
BITS = (2, 4)
"""Value widths the sparse codec offers."""
DEFAULT_DENSITY = 0.02
DEFAULT_BITS = 2
DEFAULT_CHUNK = 4096
MIN_CHUNK, MAX_CHUNK = 256, 65536
KEYS = ("density", "bits", "chunk", "feedback_decay")


@dataclass(frozen=True)
class SparseSettings:
    """``train.compressor``: the sparse codec's density, value width and chunk."""

    density: float = DEFAULT_DENSITY
    """Share of each chunk's values sent, in (0, 1]: 0.02 sends the 2% of largest
    magnitude (at least one value a chunk)."""
    bits: int = DEFAULT_BITS
    """Width of each sent value: 2 (four levels) or 4 (sixteen), with one float32
    scale per chunk."""
    chunk: int = DEFAULT_CHUNK
    """Values among which the largest are chosen: a power of two from 256 to 65536;
    a position takes log2(chunk) bits."""
    feedback_decay: float = 1.0
    """What the error feedback keeps of its residual from one round to the next, in
    (0, 1]. 1: all of it (plain error feedback). Below 1 the residual is a decaying
    sum of the pseudo-gradients not yet sent, which stands in for the outer
    optimizer's momentum (SparseLoCo: 0.95 with ``outer_momentum: 0``)."""

    def __post_init__(self) -> None:
        if not (is_number(self.density) and 0 < self.density <= 1):
            raise FieldError(
                "compressor.density",
                f"must be a share in (0, 1], e.g. 0.02 for the 2% largest values, "
                f"got {self.density!r}",
            )
        if self.bits not in BITS or isinstance(self.bits, bool):
            raise FieldError(
                "compressor.bits",
                f"the topk codec offers {' or '.join(map(str, BITS))}-bit values, "
                f"got {self.bits!r}",
            )
        if not (is_number(self.feedback_decay) and 0 < self.feedback_decay <= 1):
            raise FieldError(
                "compressor.feedback_decay",
                f"must be in (0, 1] (1: plain error feedback; SparseLoCo uses 0.95), "
                f"got {self.feedback_decay!r}",
            )
        chunk = self.chunk
        if not (
            isinstance(chunk, int)
            and not isinstance(chunk, bool)
            and MIN_CHUNK <= chunk <= MAX_CHUNK
            and chunk & (chunk - 1) == 0
        ):
            raise FieldError(
                "compressor.chunk",
                f"must be a power of two from {MIN_CHUNK} to {MAX_CHUNK}, got {chunk!r}",
            )

    @classmethod
    def from_mapping(cls, value: Any) -> SparseSettings:
        """``train.compressor`` as the job file gives it (a mapping, or null)."""
        if value is None:
            return cls()
        if not isinstance(value, dict):
            raise FieldError(
                "compressor",
                f"must be a mapping such as {{density: 0.02, bits: 2}}, got {value!r}",
            )
        unknown = sorted(set(value) - set(KEYS))
        if unknown:
            raise FieldError(
                f"compressor.{unknown[0]}",
                f"unknown setting; the topk codec takes {', '.join(KEYS)}",
            )
        return cls(**value)

    @property
    def per_chunk(self) -> int:
        """Values sent of every chunk."""
        return selected_per_chunk(self.density, self.chunk)

    @property
    def index_bits(self) -> int:
        return int(math.log2(self.chunk))

    def bytes_per_value(self) -> float:
        """Encoded bytes per float32 value, before any lossless stage: positions,
        values and the chunk's scale."""
        return (self.per_chunk * (self.index_bits + self.bits) / 8 + 4) / self.chunk

    def spec(self) -> str:
        """The codec string: ``topk:bits=B,chunk=C,density=D`` (``,feedback_decay=F``
        unless 1)."""
        spec = f"{SPARSE}:bits={self.bits},chunk={self.chunk},density={self.density!r}"
        if self.feedback_decay != 1:
            spec += f",feedback_decay={self.feedback_decay!r}"
        return spec


def selected_per_chunk(density: float, chunk: int) -> int:
    return max(1, min(chunk, math.ceil(density * chunk - 1e-9)))


def is_sparse(spec: str) -> bool:
    """Whether a codec string names the sparse codec (``topk``, with or without
    settings or ``+zstd``)."""
    return isinstance(spec, str) and spec.partition("+")[0].partition(":")[0] == SPARSE


def parse_sparse(spec: str) -> tuple[SparseSettings, bool]:
    """``topk[:bits=B,chunk=C,density=D][+zstd]`` -> its settings and whether zstd
    follows. A setting left out takes its default."""
    body, plus, stage = spec.partition("+")
    if plus and stage != "zstd":
        raise FieldError("codec", f"unknown lossless stage {stage!r} in {spec!r}; use +zstd")
    name, _, options = body.partition(":")
    if name != SPARSE:
        raise FieldError("codec", f"{spec!r} is not the {SPARSE} codec")
    given: dict[str, Any] = {}
    for item in filter(None, options.split(",")):
        key, eq, text = item.partition("=")
        if not eq or key not in KEYS:
            raise FieldError(
                "codec", f"{item!r} in {spec!r}: write key=value with a key of {', '.join(KEYS)}"
            )
        try:
            given[key] = int(text) if key in ("bits", "chunk") else float(text)
        except ValueError:
            raise FieldError("codec", f"{item!r} in {spec!r}: {text!r} is not a number") from None
    return SparseSettings(**given), bool(plus)
