"""What every all-reduce algorithm shares: one round's plan, its outcome, its checks.

The engine (:mod:`.engine`) checks a round's arguments once and hands the
algorithm (:mod:`.direct`, :mod:`.ring`) a :class:`Round`: the participants in
their fixed order, their weights, the slices, the codec and the deadline, all
fixed for the round. A codec or a deadline changed on the engine while a
round runs applies from the next round on.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from isthmus.inter.chunks import ReceivedChunk
from isthmus.inter.codecs import Codec
from isthmus.inter.staging import HOST, Staging
from isthmus.proto import wire_pb2

EXACT = Codec()
"""float32 as it is: the codec of an ``exact`` round, and of what the two-level
algorithm passes on unchanged."""


class RoundError(RuntimeError):
    """A round could not complete; ``site`` names the site at fault."""

    def __init__(self, site: str, message: str) -> None:
        super().__init__(message)
        self.site = site


@dataclass(frozen=True)
class RoundStats:
    """What one all-reduce moved over the WAN from this rank."""

    bytes_sent: int
    bytes_received: int
    seconds: float
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds from the round's start to each milestone this site passed, in order.
    The direct algorithm: ``contributions``, every other site's share of this
    site's slice in place; ``results``, every other slice's result in place, the
    average ready and the round over here. Gather: ``contributions``, every
    site's whole contribution in and the average ready."""


@dataclass(frozen=True)
class Round:
    """One round as the engine set it up for an algorithm."""

    number: int
    sites: list[str]
    """The participants, sorted: every site reduces in this order, so every site
    computes the same bits whatever order chunks arrive in."""
    me: str
    weights: Mapping[str, float]
    bounds: list[tuple[int, int]]
    """Slice j of the flat tensor, one per site (see :func:`slice_bounds`)."""
    codec: Codec
    max_chunk_bytes: int
    started: float
    """The event loop's time when the round began."""
    deadline: float
    """The event loop's time by which every peer must have delivered."""
    deadline_s: float
    addresses: Mapping[str, str]
    """Site -> this rank's counterpart there, for messages naming a late peer."""
    staging: Staging = HOST
    """How encoded bytes move between the values' device and the host: every
    buffer of the round lives on ``staging.device``, the device of the values."""
    shard_base: int = 0
    """The first wire shard number this round's chunks use: an algorithm made of
    several exchanges in one round (:mod:`.two_level`) gives each its own range,
    so chunks of one phase never land in another's buffers."""

    @property
    def total_weight(self) -> float:
        return sum(self.weights[s] for s in self.sites)


def all_finite(values: torch.Tensor) -> bool:
    """No NaN or Inf in ``values``. One reduction on the common path: a finite sum
    means every value is finite (NaN and Inf propagate into it); only an
    infinite sum, which finite values can also reach by overflow, is checked
    value by value."""
    if values.numel() == 0:
        return True
    if math.isfinite(float(values.sum())):
        return True
    return bool(torch.isfinite(values).all())


def slice_bounds(count: int, parts: int) -> list[tuple[int, int]]:
    """Split ``count`` values into ``parts`` contiguous slices, sizes differing by <= 1."""
    base, extra = divmod(count, parts)
    bounds, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def own_chunk(chunk: wire_pb2.Chunk, codec: Codec) -> ReceivedChunk:
    """This site's own chunk, taken exactly as a peer would take it."""
    return ReceivedChunk.from_wire(chunk, chunk.payload, codec, "", 0)


def payload_size(chunk: wire_pb2.Chunk) -> int:
    """Bytes of a chunk's payload. Reading the field copies it, so take the sizes of
    its sections when no lossless stage changed them."""
    if chunk.codec.endswith("+zstd"):
        return len(chunk.payload)
    return chunk.scales_bytes + chunk.values_bytes
