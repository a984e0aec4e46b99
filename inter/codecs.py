"""Codecs: how a float32 tensor is turned into bytes for the WAN, and back.

Every codec maps a flat float32 tensor to an :class:`Encoded` (host bytes plus
what is needed to decode them) and back. The lossy part is one of

* ``none``  exact float32;
* ``fp16``  IEEE half: relative error <= 2**-11 (values beyond +-65504 are refused);
* ``bf16``  bfloat16: relative error <= 2**-8, the float32 range;
* ``int8``  blockwise absmax: each block of ``block_size`` values shares a float32
  scale = absmax / 127; |error| <= absmax / 254 per element;
* ``int4``  blockwise absmax, levels -7..7, two per byte; |error| <= absmax / 14;
* ``int2``  blockwise absmax, ternary levels -1..1, four per byte; |error| <= absmax / 2
  (a value is sent as 0 or as its block's absmax with its sign: coarse, so meant
  for pseudo-gradients with error feedback, which sends what it lost next time),
* ``topk``  sparse: of every chunk of ``chunk`` values, the ``density`` share of
  largest magnitude, as their positions (log2(chunk) bits each) and values of
  ``bits`` = 2 or 4 bits (2**bits levels, mid-rise: none is zero) times one float32
  step per chunk. A sent value is off by at most step / 2 = absmax / (2**bits - 1)
  (absmax: the chunk's largest magnitude); a value not sent is off by itself, at
  most the chunk's k-th largest magnitude. Meant for pseudo-gradients with error
  feedback, which sends the rest in later rounds (SparseLoCo's recipe); of equal
  magnitudes the earlier go first. Its settings ride in the codec string
  (:mod:`isthmus.job.compressor`), and its bytes are :mod:`isthmus.inter.topk`'s,

optionally followed by a lossless stage (``+zstd``): byte-shuffle (the values'
bytes regrouped into planes, so exponent bytes sit together) then zstd at
``zstd_level``. Bounds are per encode: an algorithm that encodes a value k
times accumulates up to k bounds (see the collective engine).

:class:`ErrorFeedback` carries each site's residual (what the codec lost) into
its next encode, so quantisation error does not accumulate over rounds.

The lossy stage runs as torch ops on the values' device (a GPU's values are
quantised there); only its bytes go to the host (:mod:`isthmus.inter.staging`),
where the lossless stage runs. Decoding is the way back: host bytes, once
decompressed, go to the ``out`` tensor's device and are dequantised there. The
same input gives the same bytes on every device, so sites on GPUs and on CPUs
end a round bitwise identical: every step is one IEEE operation, rounded to
nearest, that CPU and CUDA kernels compute alike (see :func:`_quantize`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch
import zstandard

from isthmus.inter import topk
from isthmus.inter.staging import Buffer, Staging, staging_for
from isthmus.job.basics import CODECS, FieldError
from isthmus.job.compressor import SPARSE, SparseSettings, is_sparse, parse_sparse

LOSSY = (*CODECS, SPARSE)
"""The lossy stages: the dense ones most precise first (the job model's one list of
codec names), then the sparse one."""
VALUE_BYTES = {"none": 4.0, "fp16": 2.0, "bf16": 2.0, "int8": 1.0, "int4": 0.5, "int2": 0.25}
"""Bytes of one encoded value before the lossless stage (blockwise codecs: scales
apart; ``topk``: :meth:`Codec.bytes_per_value`)."""
BLOCKWISE_LEVELS = {"int8": 127, "int4": 7, "int2": 1}
"""The blockwise codecs: values are rounded to -levels..levels times a per-block scale."""
FP16_MAX = 65504.0
DEFAULT_BLOCK_SIZE = 256
DEFAULT_ZSTD_LEVEL = 3


class CodecError(ValueError):
    """A tensor or setting the codec cannot take; the message says why and the fix."""


@dataclass(frozen=True)
class Encoded:
    """A tensor on its way across the WAN."""

    codec: str
    """The codec's spec, e.g. ``int8`` or ``bf16+zstd``."""
    count: int
    """Number of float32 values encoded."""
    payload: Buffer
    """Host bytes (never device memory: they go on the wire)."""
    block_size: int = 0
    """Values per scale (int8, int4, int2); 0 otherwise."""
    meta: dict[str, int] = field(default_factory=dict)
    """Sizes of the payload's sections before the lossless stage (for decoding)."""


@dataclass(frozen=True)
class Codec:
    """One codec: a lossy stage (:data:`LOSSY`) and optionally byte-shuffle + zstd."""

    name: str = "none"
    zstd: bool = False
    zstd_level: int = DEFAULT_ZSTD_LEVEL
    block_size: int = DEFAULT_BLOCK_SIZE
    """Values per scale: a blockwise codec's block; ``topk``'s chunk (its settings')."""
    sparse: SparseSettings | None = None
    """``topk``'s settings (None for every other codec)."""

    def __post_init__(self) -> None:
        if self.name not in LOSSY:
            raise CodecError(f"unknown codec {self.name!r}; use one of {', '.join(LOSSY)}")
        if self.name == SPARSE:
            settings = self.sparse or SparseSettings()
            object.__setattr__(self, "sparse", settings)
            object.__setattr__(self, "block_size", settings.chunk)
        elif self.sparse is not None:
            raise CodecError(f"sparse settings are the {SPARSE} codec's, not {self.name!r}'s")
        size = self.block_size
        if not (isinstance(size, int) and size >= 2 and size % 2 == 0):
            raise CodecError(
                f"block_size must be an even integer >= 2 (int4 packs pairs), got {size!r}"
            )
        if self.name == "int2" and size % 4:
            raise CodecError(
                f"block_size must be a multiple of 4 for int2 (it packs four values a "
                f"byte), got {size}"
            )
        if not -7 <= self.zstd_level <= 22:
            raise CodecError(f"zstd_level must be in -7..22, got {self.zstd_level}")

    @property
    def spec(self) -> str:
        name = self.sparse.spec() if self.sparse is not None else self.name
        return f"{name}+zstd" if self.zstd else name

    def bytes_per_value(self) -> float:
        """Encoded bytes per float32 value before the lossless stage, scales included."""
        if self.sparse is not None:
            return self.sparse.bytes_per_value()
        if self.name in BLOCKWISE_LEVELS:
            return VALUE_BYTES[self.name] + 4.0 / self.block_size
        return VALUE_BYTES[self.name]

    def for_sum_of(self, contributions: int) -> Codec:
        """The codec of an owner's result, the sum of ``contributions`` encoded
        contributions. The same codec, except ``topk``: its density times the
        contributions (at most 1), so the result can carry the union of the
        positions the sites sent (re-selecting only ``density`` of the sum would drop
        values that every site's error feedback counts as sent), with 4-bit values."""
        if self.sparse is None or contributions <= 1:
            return self
        # Exactly contributions * k values a chunk (density * chunk rounds up).
        density = min(1.0, contributions * self.sparse.per_chunk / self.sparse.chunk)
        # 4-bit values: the sum's, re-quantised with no feedback to carry the loss,
        # cost the most (2-bit results: +13.2% of sync's held-out loss on the
        # convergence protocol; 4-bit: +4.8%, for 11% more bytes; 8-bit no better).
        return replace(self, sparse=replace(self.sparse, density=density, bits=4))

    def max_error(self, values: torch.Tensor) -> torch.Tensor:
        """The bound on |decode(encode(values)) - values|, per element, for one encode."""
        x = values.double()
        if self.name == "none":
            return torch.zeros_like(x)
        if self.name == "fp16":
            return x.abs() * 2.0**-11 + 2.0**-25  # relative, or half the smallest subnormal
        if self.name == "bf16":
            return x.abs() * 2.0**-8 + 2.0**-134
        if self.sparse is not None:
            return topk.max_error(values, _blocks(values, self.block_size), self.sparse)
        levels = BLOCKWISE_LEVELS[self.name]
        absmax = _blocks(values, self.block_size).abs().amax(dim=1).double()
        per_block = absmax / (2 * levels)
        # Plus float32's own rounding of the scale and of q * scale.
        return per_block.repeat_interleave(self.block_size)[: values.numel()] + x.abs() * 2.0**-22

    # -- encode ----------------------------------------------------------------------
    def encode(self, values: torch.Tensor, *, staging: Staging | None = None) -> Encoded:
        """``values``, on any device, as host bytes. ``staging``: how the encoded bytes
        reach the host (default: the shared one of the values' device)."""
        values = _check(values)
        staging = _staging(staging, values.device)
        if self.name in ("none", "fp16", "bf16"):
            raw = self._encode_float(values, staging)
            sections = {"values": raw.numel(), "element": _ELEMENT[self.name]}
            scales_len = 0
        elif self.sparse is not None:
            raw, scales_len = topk.encode(_blocks(values, self.block_size), self.sparse, staging)
            sections = {"scales": scales_len, "values": raw.numel() - scales_len, "element": 1}
        else:
            raw, scales_len = self._encode_blocks(values, staging)
            sections = {"scales": scales_len, "values": raw.numel() - scales_len, "element": 1}
        payload = staging.to_host(raw)  # only the encoded bytes leave the device
        if self.zstd:
            view = memoryview(payload)
            body = byte_shuffle(bytes(view[scales_len:]), sections["element"])
            compressed = zstandard.ZstdCompressor(level=self.zstd_level).compress(body)
            payload = bytes(view[:scales_len]) + compressed
        return Encoded(
            codec=self.spec,
            count=values.numel(),
            payload=payload,
            block_size=self.block_size if self.name in _SCALED else 0,
            meta=sections,
        )

    def _encode_float(self, values: torch.Tensor, staging: Staging) -> torch.Tensor:
        """The values as float32, fp16 or bf16 (rounded to nearest even, on any
        device), written straight into the payload's bytes."""
        raw = staging.empty(values.numel() * _ELEMENT[self.name])
        if self.name == "none":
            raw.view(torch.float32).copy_(values)
            return raw
        if self.name == "fp16":
            peak = float(torch.maximum(values.amax(), -values.amin())) if values.numel() else 0.0
            if peak > FP16_MAX:
                raise CodecError(
                    f"a value of magnitude {peak:.3g} exceeds fp16's range (65504); "
                    "use bf16 or int8 for this tensor"
                )
            raw.view(torch.float16).copy_(values)
            return raw
        raw.view(torch.bfloat16).copy_(values)
        return raw

    def _encode_blocks(self, values: torch.Tensor, staging: Staging) -> tuple[torch.Tensor, int]:
        """Payload = float32 scale per block, then the int8 (or packed int4, int2) values.
        Written straight into one buffer: no intermediate copies of the values (int8
        is quantised in place there; int4 and int2 go through a packing step)."""
        levels = BLOCKWISE_LEVELS[self.name]
        per_byte = _PER_BYTE[self.name]
        parts = _block_views(values, self.block_size)
        blocks = sum(part.shape[0] for part in parts)
        scales_len = 4 * blocks
        raw = staging.empty(scales_len + blocks * self.block_size // per_byte)
        scale_out = raw[:scales_len].view(torch.float32)
        value_out = raw[scales_len:].view(torch.int8)
        row = at = 0
        for part in parts:
            rows = part.shape[0]
            size = rows * self.block_size // per_byte
            scales, target = scale_out[row : row + rows], value_out[at : at + size]
            if per_byte == 1:
                _quantize(part, levels, scales, target)
            else:
                q = torch.empty(part.numel(), dtype=torch.int8, device=part.device)
                _quantize(part, levels, scales, q)
                target.copy_(_pack_nibbles(q) if per_byte == 2 else _pack_crumbs(q))
            row += rows
            at += size
        return raw, scales_len

    # -- decode -----------------------------------------------------------------------
    def decode(
        self,
        encoded: Encoded,
        out: torch.Tensor | None = None,
        *,
        device: torch.device | str | None = None,
        staging: Staging | None = None,
    ) -> torch.Tensor:
        """The values of ``encoded`` as float32; into ``out`` (``count`` values, on any
        device) when given: a buffer reused across rounds saves the page faults of a
        fresh one. Without ``out``, a new tensor on ``device`` (default: the CPU).
        The received bytes go to that device (``staging``: how; default the shared
        one of the device) and are dequantised there."""
        if out is not None and (out.dtype != torch.float32 or out.numel() != encoded.count):
            raise CodecError(
                f"out must be float32 with {encoded.count} values, got {out.dtype} "
                f"with {out.numel()}"
            )
        if encoded.codec != self.spec:
            raise CodecError(f"payload was encoded with {encoded.codec!r}, not {self.spec!r}")
        where = out.device if out is not None else torch.device(device or "cpu")
        staging = _staging(staging, where)
        meta = encoded.meta
        scales_len = meta.get("scales", 0)
        view = memoryview(encoded.payload)
        body: Buffer = view[scales_len:]
        if self.zstd:
            body = byte_unshuffle(
                zstandard.ZstdDecompressor().decompress(body, max_output_size=meta["values"]),
                meta["element"],
            )
        if len(body) != meta["values"]:
            raise CodecError(f"payload holds {len(body)} value bytes, expected {meta['values']}")
        n = encoded.count
        result = torch.empty(n, dtype=torch.float32, device=where) if out is None else out.view(-1)
        if self.name in _FLOAT_DTYPE:
            (raw,) = staging.to_device([body])
            return result.copy_(raw.view(_FLOAT_DTYPE[self.name])[:n])
        scales, raw = staging.to_device([view[:scales_len], body])
        scale = scales.view(torch.float32)
        if self.sparse is not None:
            try:
                return topk.decode(raw, scale, self.sparse, result)
            except ValueError as exc:
                raise CodecError(str(exc)) from None
        q = raw.view(torch.int8)
        if self.name == "int4":
            packed = q.view(torch.uint8)
            q = torch.stack((packed & 0x0F, packed >> 4), dim=1).view(-1).view(torch.int8) - 8
        elif self.name == "int2":
            packed = q.view(torch.uint8)
            crumbs = [(packed >> shift) & 0x03 for shift in (0, 2, 4, 6)]
            q = torch.stack(crumbs, dim=1).view(-1).view(torch.int8) - 1
        _dequantize(q.view(-1, encoded.block_size), scale, result)
        return result


def _staging(staging: Staging | None, device: torch.device) -> Staging:
    if staging is None:
        return staging_for(device)
    if staging.device != device:
        raise CodecError(f"a staging for {staging.device} cannot move a tensor on {device}")
    return staging


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """Values -7..7, two per byte: the first in the low nibble (as value + 8)."""
    nibbles = (q + 8).view(torch.uint8).view(-1, 2)
    return (nibbles[:, 0] | (nibbles[:, 1] << 4)).view(torch.int8)


def _pack_crumbs(q: torch.Tensor) -> torch.Tensor:
    """Values -1..1, four per byte (as value + 1, two bits each): the first lowest."""
    crumbs = (q + 1).view(torch.uint8).view(-1, 4)
    packed = crumbs[:, 0] | (crumbs[:, 1] << 2) | (crumbs[:, 2] << 4) | (crumbs[:, 3] << 6)
    return packed.view(torch.int8)


_ELEMENT = {"none": 4, "fp16": 2, "bf16": 2}
_FLOAT_DTYPE = {"none": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_PER_BYTE = {"int8": 1, "int4": 2, "int2": 4}
"""Blockwise codecs: values packed into one byte."""
_SCALED = (*BLOCKWISE_LEVELS, SPARSE)
"""Codecs with a float32 scale per ``block_size`` values."""


def parse_codec(spec: str, **options: int) -> Codec:
    """``int8``, ``bf16+zstd``, ``topk:bits=2,chunk=4096,density=0.02`` ... ->
    :class:`Codec` (options: zstd_level, block_size; ``topk`` takes its chunk from
    its own settings)."""
    if is_sparse(spec):
        try:
            settings, zstd = parse_sparse(spec)
        except FieldError as exc:
            raise CodecError(exc.reason) from None
        options.pop("block_size", None)
        return Codec(name=SPARSE, zstd=zstd, sparse=settings, **options)
    name, plus, stage = spec.partition("+")
    if plus and stage != "zstd":
        raise CodecError(f"unknown lossless stage {stage!r} in {spec!r}; the only one is +zstd")
    return Codec(name=name, zstd=bool(plus), **options)


def _check(values: torch.Tensor) -> torch.Tensor:
    if not isinstance(values, torch.Tensor):
        raise CodecError(f"expected a torch.Tensor, got {type(values).__name__}")
    if values.dtype != torch.float32:
        raise CodecError(f"expected float32 values, got {values.dtype}; convert with .float()")
    return values.reshape(-1).contiguous()


def _block_views(values: torch.Tensor, block_size: int) -> list[torch.Tensor]:
    """The values as (blocks, block_size): a view of the whole blocks (no copy: this
    is the hot path), and the last partial block zero-padded, if any."""
    flat = values.reshape(-1)
    whole = flat.numel() // block_size * block_size
    parts = [flat[:whole].view(-1, block_size)] if whole else []
    if whole < flat.numel() or not parts:
        tail = torch.zeros(block_size, dtype=torch.float32, device=flat.device)
        tail[: flat.numel() - whole] = flat[whole:]
        parts.append(tail.view(1, block_size))
    return parts


# Values quantised per step. On the CPU ~1 MiB of float32, so the scratch buffer
# stays in cache and is reused, instead of a fresh 4x-sized temporary whose page
# faults alone cost more than the arithmetic. On a GPU each step is a few kernel
# launches (~10 us each) and there is no cache to fit: 1 MiB steps made int8
# encode + decode of 2^28 values take 90 ms on an H200 (12 GB/s, 1,024 steps of
# launches), so a GPU takes 128 MiB steps: a handful of launches per tensor.
_QUANTIZE_CHUNK_VALUES = 1 << 18
_QUANTIZE_CHUNK_VALUES_ACCELERATOR = 1 << 25


def _chunk_values(device: torch.device) -> int:
    return _QUANTIZE_CHUNK_VALUES if device.type == "cpu" else _QUANTIZE_CHUNK_VALUES_ACCELERATOR


def _quantize(blocks: torch.Tensor, levels: int, scale: torch.Tensor, q: torch.Tensor) -> None:
    """Blockwise absmax quantisation to -levels..levels: ``scale`` per block (float32)
    and ``q`` (int8, one per value), written into the tensors given.

    Written for speed on one core: max and min instead of abs().amax(), multiply
    by the reciprocal, no clamp (|x| * levels / absmax <= levels already), and
    the work done in cache-sized chunks through one scratch buffer.

    The same bytes on every device: max/min are exact in any order; ``abs_`` makes
    an all-zero block's absmax +0 whichever zero a kernel picks (a -0 scale
    would decode to -0); the scale divides by a tensor, not a Python number (CUDA
    turns ``x / 127`` into ``x * (1/127)``, one rounding more); the inverse is
    ``reciprocal() * levels``, what ``levels / absmax`` always meant on the CPU;
    products, round-half-even and the int8 cast are exact IEEE steps everywhere.
    An inverse that overflows (absmax below ~1e-37, or 0) quantises its block to
    0: ``x * inf`` would make NaN, whose cast to int8 is undefined."""
    absmax = torch.maximum(blocks.amax(dim=1), blocks.amin(dim=1).neg_()).abs_()
    torch.div(absmax, torch.full_like(absmax, levels), out=scale)
    inverse = absmax.reciprocal_().mul_(levels).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
    q = q.view(blocks.shape)
    rows = max(1, _chunk_values(blocks.device) // blocks.shape[1])
    scratch = torch.empty((rows, blocks.shape[1]), dtype=torch.float32, device=blocks.device)
    for start in range(0, blocks.shape[0], rows):
        stop = min(start + rows, blocks.shape[0])
        out = scratch[: stop - start]
        torch.mul(blocks[start:stop], inverse[start:stop, None], out=out)
        out.round_()
        q[start:stop].copy_(out)


def _dequantize(blocks: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> None:
    """out[:] = blocks * scale per block, in chunks (cache-sized on the CPU), one pass
    over out."""
    size = blocks.shape[1]
    rows = max(1, _chunk_values(out.device) // size)
    n = out.numel()
    for start in range(0, blocks.shape[0], rows):
        stop = min(start + rows, blocks.shape[0])
        first, last = start * size, min(stop * size, n)
        if first >= last:
            break
        target = out[first:last]
        whole = (last - first) // size
        if whole:
            chunk = target[: whole * size].view(whole, size)
            chunk.copy_(blocks[start : start + whole]).mul_(scale[start : start + whole, None])
        if whole * size < last - first:  # the last, partial block
            tail = target[whole * size :]
            tail.copy_(blocks[start + whole, : tail.numel()]).mul_(scale[start + whole])


def _blocks(values: torch.Tensor, block_size: int) -> torch.Tensor:
    flat = values.reshape(-1)
    blocks = max(1, math.ceil(flat.numel() / block_size))
    padded = torch.zeros(blocks * block_size, dtype=torch.float32, device=flat.device)
    padded[: flat.numel()] = flat
    return padded.view(blocks, block_size)


def byte_shuffle(data: bytes, element: int) -> bytes:
    """Regroup the bytes of ``element``-byte values into planes (all first bytes, ...)."""
    if element <= 1 or not data:
        return data
    planes = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(-1, element)
    return planes.t().contiguous().numpy().tobytes()


def byte_unshuffle(data: bytes, element: int) -> bytes:
    if element <= 1 or not data:
        return data
    planes = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(element, -1)
    return planes.t().contiguous().numpy().tobytes()


class ErrorFeedback:
    """A site's residual: what the codec lost last time is added before the next encode.

    ``encode`` returns what to send and keeps ``(values + residual) - decoded`` for
    the next call, so over rounds the sum of what was sent tracks the sum of the
    true values instead of drifting by the codec's bias.
    """

    def __init__(self, codec: Codec) -> None:
        self.codec = codec
        self.residual: torch.Tensor | None = None

    def encode(self, values: torch.Tensor) -> Encoded:
        values = _check(values)
        corrected = values if self.residual is None else values + self.residual
        encoded = self.codec.encode(corrected)
        self.residual = corrected - self.codec.decode(encoded, device=corrected.device)
        return encoded
