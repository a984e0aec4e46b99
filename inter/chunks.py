"""Cutting an encoded tensor into checksummed chunk messages, and putting it back together.

A chunk is verified before anything uses it: its checksum (CRC-32 of the
payload), its codec, and that its sizes agree with its siblings. A chunk that
fails is refused with the reason, never applied (the sender re-sends it).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

from isthmus.inter.codecs import Encoded, parse_codec
from isthmus.proto import wire_pb2


class ChunkError(ValueError):
    """A chunk was refused; ``code`` is the wire ErrorCode, the message says why."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def checksum(payload: bytes | bytearray | memoryview) -> int:
    return zlib.crc32(payload) & 0xFFFFFFFF


def to_chunks(
    encoded: Encoded, *, round: int, shard: int, max_chunk_bytes: int, weight: float = 1.0
) -> list[wire_pb2.Chunk]:
    """``encoded`` as chunk messages of at most ``max_chunk_bytes`` payload each."""
    payload = memoryview(encoded.payload)
    count = max(1, -(-len(payload) // max_chunk_bytes))
    meta = encoded.meta
    chunks = []
    for index in range(count):
        piece = bytes(payload[index * max_chunk_bytes : (index + 1) * max_chunk_bytes])
        chunks.append(
            wire_pb2.Chunk(
                round=round,
                shard=shard,
                index=index,
                count=count,
                codec=encoded.codec,
                elements=encoded.count,
                dtype="float32",
                payload=piece,
                checksum=checksum(piece),
                block_size=encoded.block_size,
                scales_bytes=meta.get("scales", 0),
                values_bytes=meta.get("values", 0),
                element_bytes=meta.get("element", 0),
                weight=weight,
            )
        )
    return chunks


def verify(chunk: wire_pb2.Chunk) -> None:
    """Raise :class:`ChunkError` if ``chunk`` must not be used."""
    if checksum(chunk.payload) != chunk.checksum:
        raise ChunkError(
            wire_pb2.CHECKSUM_MISMATCH,
            f"chunk {chunk.index}/{chunk.count} of round {chunk.round} shard {chunk.shard}: "
            "payload does not match its checksum (corrupted in transit); send it again",
        )
    if chunk.dtype != "float32":
        raise ChunkError(wire_pb2.WRONG_SHAPE, f"dtype {chunk.dtype!r} is not float32")
    if not chunk.count or chunk.index >= chunk.count:
        raise ChunkError(wire_pb2.WRONG_SHAPE, f"chunk index {chunk.index} of {chunk.count}")
    try:
        parse_codec(chunk.codec, block_size=chunk.block_size or 256)
    except ValueError as exc:
        raise ChunkError(wire_pb2.UNKNOWN_CODEC, str(exc)) from None


@dataclass
class Assembly:
    """Collects the verified chunks of one (round, shard) until the tensor is whole."""

    first: wire_pb2.Chunk
    pieces: dict[int, bytes]

    @classmethod
    def start(cls, chunk: wire_pb2.Chunk) -> Assembly:
        return cls(first=chunk, pieces={})

    def add(self, chunk: wire_pb2.Chunk) -> None:
        verify(chunk)
        f = self.first
        same = (chunk.round, chunk.shard, chunk.count, chunk.codec, chunk.elements) == (
            f.round,
            f.shard,
            f.count,
            f.codec,
            f.elements,
        )
        if not same:
            raise ChunkError(
                wire_pb2.WRONG_SHAPE,
                f"chunk {chunk.index} disagrees with chunk {f.index} of round {f.round} "
                f"shard {f.shard} about its count, codec or size",
            )
        self.pieces[chunk.index] = chunk.payload

    @property
    def complete(self) -> bool:
        return len(self.pieces) == self.first.count

    def encoded(self) -> Encoded:
        if not self.complete:
            raise ChunkError(wire_pb2.WRONG_SHAPE, "tensor is not complete yet")
        f = self.first
        meta = {"values": f.values_bytes, "element": f.element_bytes}
        if f.scales_bytes:
            meta["scales"] = f.scales_bytes
        payload = b"".join(self.pieces[i] for i in range(f.count))
        return Encoded(
            codec=f.codec, count=f.elements, payload=payload, block_size=f.block_size, meta=meta
        )
