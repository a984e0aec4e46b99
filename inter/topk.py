"""The sparse codec ``topk``'s bytes: each chunk's largest values, their positions packed.

Payload (before the lossless stage): one float32 step per chunk; then every
chunk's k positions (ascending within the chunk, log2(chunk) bits each), packed
as one bit stream; then their values (``bits`` each), packed the same way. A
value is ``(q - L + 0.5) * step`` for its code q in 0..2L-1 (L = 2**(bits-1)):
mid-rise levels, none of them zero, since every value sent is one of its chunk's
largest. The settings are :class:`~isthmus.job.compressor.SparseSettings`; the
codec around it (:class:`~isthmus.inter.codecs.Codec`) stages the bytes and adds
the lossless stage.
"""

from __future__ import annotations

import torch

from isthmus.inter.staging import Staging
from isthmus.job.compressor import SparseSettings


def _half_levels(bits: int) -> int:
    """Half the number of levels: values are (q - L + 0.5) * step for q in 0..2L-1."""
    return 1 << (bits - 1)


def _section_bytes(chunks: int, settings: SparseSettings) -> tuple[int, int]:
    """Bytes of the packed positions and of the packed values."""
    sent = chunks * settings.per_chunk
    return -(-sent * settings.index_bits // 8), -(-sent * settings.bits // 8)


def encode(
    blocks: torch.Tensor, settings: SparseSettings, staging: Staging
) -> tuple[torch.Tensor, int]:
    """The payload of ``blocks`` (the values as (chunks, chunk), the last chunk
    zero-padded) into a buffer of ``staging``, and its scales' length."""
    k = settings.per_chunk
    chunks = blocks.shape[0]
    # The k largest magnitudes of each chunk, positions ascending. Among values
    # equal to the k-th largest the earliest go (topk's own choice between equals
    # differs between devices), so a GPU writes the CPU's bytes: every value above
    # the k-th largest, then as many of those equal to it as are still wanted.
    magnitude = blocks.abs()
    kth = magnitude.topk(k, dim=1).values[:, -1:]
    above = magnitude > kth
    equal = magnitude == kth
    wanted = k - above.sum(dim=1, keepdim=True)
    chosen_mask = above | (equal & (equal.cumsum(dim=1) <= wanted))
    positions = chosen_mask.nonzero()[:, 1].view(chunks, k)
    chosen = blocks.gather(1, positions)
    levels = _half_levels(settings.bits)
    absmax = chosen.abs().amax(dim=1)
    step = torch.div(absmax, torch.full_like(absmax, levels - 0.5))
    inverse = step.reciprocal().nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
    q = torch.floor(chosen * inverse[:, None]).add_(levels).clamp_(0, 2 * levels - 1)
    index_len, value_len = _section_bytes(chunks, settings)
    scales_len = 4 * chunks
    raw = staging.empty(scales_len + index_len + value_len)
    raw[:scales_len].view(torch.float32).copy_(step)
    raw[scales_len : scales_len + index_len].copy_(
        _pack_bits(positions.reshape(-1), settings.index_bits)
    )
    raw[scales_len + index_len :].copy_(_pack_bits(q.to(torch.int64).reshape(-1), settings.bits))
    return raw, scales_len


def decode(
    raw: torch.Tensor, step: torch.Tensor, settings: SparseSettings, out: torch.Tensor
) -> torch.Tensor:
    """``out`` from a payload's packed positions and values (``raw``, after the scales)
    and its steps: the values sent, zero elsewhere. ValueError if ``raw`` is not the
    size the settings give."""
    chunk, k = settings.chunk, settings.per_chunk
    chunks = step.numel()
    index_len, value_len = _section_bytes(chunks, settings)
    if raw.numel() != index_len + value_len:
        raise ValueError(
            f"a topk payload of {chunks} chunks holds {index_len + value_len} bytes after "
            f"its scales, got {raw.numel()}"
        )
    data = raw.view(torch.uint8)
    positions = _unpack_bits(data[:index_len], settings.index_bits, chunks * k).view(chunks, k)
    q = _unpack_bits(data[index_len:], settings.bits, chunks * k).view(chunks, k)
    levels = _half_levels(settings.bits)
    sent = (q.to(torch.float32) - (levels - 0.5)).mul_(step[:, None])
    dense = torch.zeros((chunks, chunk), dtype=torch.float32, device=out.device)
    dense.scatter_(1, positions, sent)
    return out.copy_(dense.view(-1)[: out.numel()])


def max_error(values: torch.Tensor, blocks: torch.Tensor, settings: SparseSettings) -> torch.Tensor:
    """A sent value: step / 2; one not sent: itself (``blocks``: ``values`` as for
    :func:`encode`). At or below the chunk's k-th largest magnitude the bound is
    the larger of the two, so it holds whichever of the tied values are sent."""
    blocks = blocks.abs().double()
    kth = blocks.topk(settings.per_chunk, dim=1).values[:, -1:]
    half_step = blocks.amax(dim=1, keepdim=True) / (2 * _half_levels(settings.bits) - 1)
    bound = torch.where(blocks > kth, half_step, torch.maximum(blocks, half_step))
    # Plus float32's rounding of the step and of q * step.
    return bound.view(-1)[: values.numel()] + values.double().abs() * 2.0**-22


def _pack_bits(values: torch.Tensor, width: int) -> torch.Tensor:
    """Non-negative integers below 2**width, ``width`` bits each, lowest bit first,
    as one stream of bytes (the last byte zero-padded)."""
    shifts = torch.arange(width, device=values.device)
    bits = ((values[:, None] >> shifts) & 1).to(torch.uint8).view(-1)
    pad = -bits.numel() % 8
    if pad:
        bits = torch.cat((bits, bits.new_zeros(pad)))
    weights = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8, device=values.device)
    return (bits.view(-1, 8) * weights).sum(dim=1, dtype=torch.uint8)


def _unpack_bits(data: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """The ``count`` integers of :func:`_pack_bits`, as int64."""
    shifts = torch.arange(8, device=data.device, dtype=torch.uint8)
    bits = ((data.view(torch.uint8)[:, None] >> shifts) & 1).view(-1)[: count * width]
    weights = torch.tensor([1 << i for i in range(width)], dtype=torch.int64, device=data.device)
    return (bits.view(count, width).to(torch.int64) * weights).sum(dim=1)
