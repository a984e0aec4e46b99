"""Chunks: a shard of values cut into pieces that are encoded, checked and decoded one by one.

Every chunk is encoded on its own (its own scales, its own lossless stage), so
the sender encodes chunk k+1 while chunk k is on the wire and the receiver
decodes chunk k while k+1 arrives. A chunk carries its position (``offset``,
in values), a CRC-32 of its payload and fields, and everything needed to
decode it. A chunk that fails verification is refused with the reason, never
applied; the sender sends it again.

Values and buffers may live on any device: a chunk is encoded where its values
are and decoded where its buffer is, and only its payload, host bytes, goes
through here (``staging``: how those bytes cross to and from the device, see
:mod:`isthmus.inter.staging`; None takes the device's shared one).
"""

from __future__ import annotations

import random
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import zstandard

from isthmus.inter.codecs import VALUE_BYTES, Codec, CodecError, Encoded, parse_codec
from isthmus.inter.staging import Staging
from isthmus.proto import wire_pb2


class ChunkError(ValueError):
    """A chunk was refused; ``code`` is the wire ErrorCode, the message says why."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


_HEADER = struct.Struct("<QIIIQIQQIdQI")
"""The numeric fields a chunk's checksum covers besides its payload, in field order."""


def checksum(chunk: wire_pb2.Chunk, payload: bytes | bytearray | memoryview) -> int:
    """CRC-32 of ``payload`` and of every other field of ``chunk`` (but the checksum):
    a bit flipped in the offset or the codec would place or decode good bytes
    wrongly, so the fields are as protected as the values."""
    header = _HEADER.pack(
        chunk.round,
        chunk.shard,
        chunk.index,
        chunk.count,
        chunk.elements,
        chunk.block_size,
        chunk.scales_bytes,
        chunk.values_bytes,
        chunk.element_bytes,
        chunk.weight,
        chunk.offset,
        chunk.lane,
    )
    names = f"{chunk.codec}\0{chunk.dtype}".encode()
    return zlib.crc32(names, zlib.crc32(header, zlib.crc32(payload))) & 0xFFFFFFFF


def chunk_ranges(count: int, values_per_chunk: int) -> list[tuple[int, int]]:
    """[start, stop) of each chunk of a ``count``-value shard (one empty chunk if empty)."""
    if count == 0:
        return [(0, 0)]
    return [(a, min(a + values_per_chunk, count)) for a in range(0, count, values_per_chunk)]


def values_per_chunk(codec: Codec, max_chunk_bytes: int) -> int:
    """How many values fit in a chunk of ``max_chunk_bytes`` before the lossless stage,
    a multiple of the codec's block size so no block straddles two chunks."""
    block = codec.block_size
    # topk: sized for its densest result (every value of a chunk sent), so an owner's
    # result, which carries the union of the sites' positions, fits too.
    if codec.sparse is not None:
        per_value = codec.for_sum_of(block).bytes_per_value()
    else:
        per_value = VALUE_BYTES[codec.name] + 4.0 / block
    values = int(max_chunk_bytes / per_value)
    return max(block, values // block * block)


def encode_chunk(
    codec: Codec,
    values: torch.Tensor,
    *,
    round: int,
    shard: int,
    offset: int,
    index: int,
    count: int,
    weight: float,
    lane: int = 0,
    staging: Staging | None = None,
) -> wire_pb2.Chunk:
    """One chunk message holding ``values`` (which start at ``offset`` in the shard),
    encoded on their device."""
    return _message(
        codec.encode(values, staging=staging),
        round=round,
        shard=shard,
        offset=offset,
        index=index,
        count=count,
        weight=weight,
        lane=lane,
    )


def _message(
    encoded: Encoded,
    *,
    round: int,
    shard: int,
    offset: int,
    index: int,
    count: int,
    weight: float,
    lane: int = 0,
) -> wire_pb2.Chunk:
    meta = encoded.meta
    chunk = wire_pb2.Chunk(
        round=round,
        shard=shard,
        index=index,
        count=count,
        codec=encoded.codec,
        elements=encoded.count,
        dtype="float32",
        payload=bytes(encoded.payload),
        block_size=encoded.block_size,
        scales_bytes=meta.get("scales", 0),
        values_bytes=meta.get("values", 0),
        element_bytes=meta.get("element", 0),
        weight=weight,
        offset=offset,
        lane=lane,
    )
    chunk.checksum = checksum(chunk, encoded.payload)
    return chunk


def encode_chunks(
    codec: Codec,
    values: torch.Tensor,
    *,
    round: int,
    shard: int,
    max_chunk_bytes: int,
    weight: float = 1.0,
) -> Iterator[wire_pb2.Chunk]:
    """The chunks of a shard, encoded lazily: a consumer that sends each as it comes
    overlaps encoding with the network."""
    flat = values.reshape(-1)
    ranges = chunk_ranges(flat.numel(), values_per_chunk(codec, max_chunk_bytes))
    for index, (a, b) in enumerate(ranges):
        yield encode_chunk(
            codec,
            flat[a:b],
            round=round,
            shard=shard,
            offset=a,
            index=index,
            count=len(ranges),
            weight=weight,
        )


def flip_payload_bit(chunk: wire_pb2.Chunk, rng: random.Random) -> wire_pb2.Chunk:
    """A copy of ``chunk`` with one random bit of its payload flipped, the checksum
    left as it was: corruption the receiver must catch (a fault for tests)."""
    bad = wire_pb2.Chunk()
    bad.CopyFrom(chunk)
    payload = bytearray(chunk.payload)
    if payload:
        payload[rng.randrange(len(payload))] ^= 1 << rng.randrange(8)
        bad.payload = bytes(payload)
    else:
        bad.checksum ^= 1 << rng.randrange(32)
    return bad


def verify(chunk: wire_pb2.Chunk, payload: bytes) -> Codec:
    """Raise :class:`ChunkError` if ``chunk`` must not be used; return its codec.
    ``payload`` is ``chunk.payload``, read once by the caller (each read copies)."""
    if checksum(chunk, payload) != chunk.checksum:
        raise ChunkError(
            wire_pb2.CHECKSUM_MISMATCH,
            f"chunk {chunk.index}/{chunk.count} of round {chunk.round} shard {chunk.shard}: "
            "does not match its checksum (corrupted in transit); send it again",
        )
    if chunk.dtype != "float32":
        raise ChunkError(wire_pb2.WRONG_SHAPE, f"dtype {chunk.dtype!r} is not float32")
    if not chunk.count or chunk.index >= chunk.count:
        raise ChunkError(wire_pb2.WRONG_SHAPE, f"chunk index {chunk.index} of {chunk.count}")
    try:
        return parse_codec(chunk.codec, block_size=chunk.block_size or 256)
    except ValueError as exc:
        raise ChunkError(wire_pb2.UNKNOWN_CODEC, str(exc)) from None


def to_encoded(chunk: wire_pb2.Chunk, payload: bytes) -> Encoded:
    """The chunk's payload as the codec's :class:`Encoded`."""
    meta = {"values": chunk.values_bytes, "element": chunk.element_bytes}
    if chunk.scales_bytes:
        meta["scales"] = chunk.scales_bytes
    return Encoded(
        codec=chunk.codec,
        count=chunk.elements,
        payload=payload,
        block_size=chunk.block_size,
        meta=meta,
    )


@dataclass(frozen=True)
class ReceivedChunk:
    """A verified chunk from a peer, ready to decode into its place."""

    site: str
    rank: int
    round: int
    shard: int
    index: int
    count: int
    offset: int
    weight: float
    codec: Codec
    encoded: Encoded
    lane: int = 0

    @classmethod
    def from_wire(
        cls, chunk: wire_pb2.Chunk, payload: bytes, codec: Codec, site: str, rank: int
    ) -> ReceivedChunk:
        """``chunk`` as sent by ``site``'s rank ``rank`` (``payload``: its bytes, read once)."""
        return cls(
            site,
            rank,
            chunk.round,
            chunk.shard,
            chunk.index,
            chunk.count,
            chunk.offset,
            chunk.weight,
            codec,
            to_encoded(chunk, payload),
            chunk.lane,
        )

    def decode_into(
        self, shard_buffer: torch.Tensor, staging: Staging | None = None
    ) -> torch.Tensor:
        """Decode into ``shard_buffer[offset : offset + elements]``, on the buffer's
        device; return that slice."""
        target = shard_buffer[self.offset : self.offset + self.encoded.count]
        if target.numel() != self.encoded.count:
            raise ChunkError(
                wire_pb2.WRONG_SHAPE,
                f"chunk at offset {self.offset} with {self.encoded.count} values overruns a "
                f"shard of {shard_buffer.numel()}",
            )
        try:
            return self.codec.decode(self.encoded, out=target, staging=staging)
        except (CodecError, zstandard.ZstdError, RuntimeError, ValueError) as exc:
            # The checksum held, so the sender built a payload its own fields do
            # not describe (torch says so with a RuntimeError on mismatched
            # sizes): a broken or hostile peer, refused like a bad shape.
            raise ChunkError(
                wire_pb2.WRONG_SHAPE,
                f"chunk {self.index}/{self.count}: payload does not decode: {exc}",
            ) from None


def to_wire(chunk: ReceivedChunk) -> wire_pb2.Chunk:
    """A received chunk as a message again, to forward it unchanged (same bytes)."""
    return _message(
        chunk.encoded,
        round=chunk.round,
        shard=chunk.shard,
        offset=chunk.offset,
        index=chunk.index,
        count=chunk.count,
        weight=chunk.weight,
        lane=chunk.lane,
    )
