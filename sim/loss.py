"""Segment-loss processes: which TCP segments of a link's byte stream are lost.

The proxy backend carries a byte stream, not packets, so a loss cannot drop
bytes: TCP would retransmit them. What the application feels is a stall of the
stream until the retransmission arrives. These processes decide *which*
segments are lost; the link turns each loss event into a stall.

Both processes are sampled by gaps (segments until the next loss), so their
cost is per loss, not per segment, and a 1 Gbit/s link stays cheap.
"""

from __future__ import annotations

import math
import random


class SegmentLoss:
    """Counts lost segments in a stream, independently (Bernoulli) or in bursts.

    With ``mean_burst_segments`` = 1 every segment is lost independently with
    probability ``loss``. Above 1 it is a Gilbert-Elliott chain (the simple
    Gilbert form: the bad state loses every segment, the good state none) with
    stationary loss rate ``loss`` and mean burst length ``mean_burst_segments``.
    """

    def __init__(self, rng: random.Random, *, loss: float, mean_burst_segments: float = 1.0):
        if not 0 <= loss < 1:
            raise ValueError(f"loss must be in [0, 1), got {loss}")
        if mean_burst_segments < 1:
            raise ValueError(f"mean_burst_segments must be >= 1, got {mean_burst_segments}")
        self._rng = rng
        self._loss = loss
        self._burst = mean_burst_segments
        # Segments of the stream not yet examined, in the current run:
        # `_good_left` segments of no loss, then `_bad_left` lost ones.
        self._good_left = 0
        self._bad_left = 0
        if loss > 0:
            self._start_cycle()

    @property
    def loss(self) -> float:
        return self._loss

    def _geometric(self, p: float) -> int:
        """Trials up to and including the first success, success probability ``p``."""
        if p >= 1:
            return 1
        u = 1.0 - self._rng.random()  # in (0, 1]
        return 1 + int(math.log(u) / math.log1p(-p))

    def _start_cycle(self) -> None:
        if self._burst <= 1:
            # Bernoulli: failures before a loss, then exactly one lost segment.
            self._good_left = self._geometric(self._loss) - 1
            self._bad_left = 1
            return
        # Gilbert: leave the bad state with p_bg = 1/burst; enter it with p_gb
        # such that the stationary bad share p_gb / (p_gb + p_bg) equals `loss`.
        p_bg = 1.0 / self._burst
        p_gb = p_bg * self._loss / (1.0 - self._loss)
        self._good_left = self._geometric(p_gb)
        self._bad_left = self._geometric(p_bg)

    def lost_positions(self, segments: int) -> list[int]:
        """Advance the stream by ``segments`` segments; return the indices of the lost ones."""
        if self._loss == 0 or segments <= 0:
            return []
        lost: list[int] = []
        position = 0
        while position < segments:
            remaining = segments - position
            if self._good_left >= remaining:
                self._good_left -= remaining
                break
            position += self._good_left
            self._good_left = 0
            take = min(self._bad_left, segments - position)
            lost.extend(range(position, position + take))
            position += take
            self._bad_left -= take
            if self._bad_left == 0:
                self._start_cycle()
        return lost

    def lost_in(self, segments: int) -> int:
        """Advance the stream by ``segments`` segments; return how many were lost."""
        if self._loss == 0 or segments <= 0:
            return 0
        lost = 0
        while segments > 0:
            if self._good_left >= segments:
                self._good_left -= segments
                break
            segments -= self._good_left
            self._good_left = 0
            take = min(self._bad_left, segments)
            lost += take
            self._bad_left -= take
            segments -= take
            if self._bad_left == 0:
                self._start_cycle()
        return lost
