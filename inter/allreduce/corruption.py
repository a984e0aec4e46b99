"""Faults for tests and the fault benchmark, passed to the engine as its chunk filter.

The engine knows nothing of faults: it applies a :data:`.sending.ChunkFilter`,
if it was given one, to each chunk as it goes on the wire. The tests, the
all-reduce worker (``--corrupt-payloads``) and ``benchmarks/faults.py corrupt``
build a :class:`CorruptPayloads` and pass it in.
"""

from __future__ import annotations

import random

from isthmus.inter.chunks import flip_payload_bit
from isthmus.proto import wire_pb2


class CorruptPayloads:
    """Flip one bit of a ``fraction`` of outgoing chunks after their checksum was
    computed: corruption every receiver must refuse (and the sender send again).
    Seeded, so a run is reproducible; the all-reduce worker seeds it with
    ``site/rank/lane``."""

    def __init__(self, fraction: float, *, seed: str) -> None:
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"corrupt_payloads must be in [0, 1], got {fraction}")
        self.fraction = fraction
        self.corrupted = 0
        """Chunks corrupted so far."""
        self._random = random.Random(seed)

    def __call__(self, site: str, chunk: wire_pb2.Chunk) -> wire_pb2.Chunk:
        if self.fraction and self._random.random() < self.fraction:
            self.corrupted += 1
            return flip_payload_bit(chunk, self._random)
        return chunk
