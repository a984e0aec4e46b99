"""One direction of an emulated link, independent of what carries its bytes.

Both backends (the TCP proxy, the packet router) build on :class:`DirectionModel`:
the settings in force, the shared rate limiters, and the seeded processes that
turn settings into departure times, delays and losses. Each backend adds only
how it applies them to its unit (byte-stream batches, or packets).
"""

from __future__ import annotations

from isthmus.sim.jitter import JitterSampler
from isthmus.sim.link import DirectionParams
from isthmus.sim.loss import SegmentLoss
from isthmus.sim.token_bucket import TokenBucket
from isthmus.sim.topology import direction_rng


class DirectionModel:
    """Settings, rate limiters and random processes of the direction src -> dst."""

    def __init__(
        self,
        *,
        src: str,
        dst: str,
        params: DirectionParams,
        seed: int,
        egress: TokenBucket | None = None,
        ingress: TokenBucket | None = None,
    ) -> None:
        """``egress``/``ingress``: the uplink limiters of src and dst, when capped."""
        self.src = src
        self.dst = dst
        self.blackholed = False
        self.rng = direction_rng(seed, src, dst)
        self._bucket = TokenBucket(params.rate_bytes_per_s)
        self.buckets = [b for b in (self._bucket, egress, ingress) if b is not None]
        self.apply(params)

    def apply(self, params: DirectionParams) -> None:
        """Switch to new settings; what was already scheduled keeps its times."""
        self.params = params
        self._bucket.set_rate(params.rate_bytes_per_s)
        self.jitter = JitterSampler(
            self.rng,
            delay_ms=params.delay_ms,
            jitter_ms=params.jitter_ms,
            distribution=params.jitter_distribution,
            pareto_shape=params.jitter_pareto_shape,
        )
        self.loss = SegmentLoss(
            self.rng, loss=params.loss, mean_burst_segments=params.loss_burst_segments
        )
        self.queue_s = params.queue_ms / 1e3
        self.delayed = params.delay_ms > 0 or params.jitter_ms > 0
        rates = [b.rate for b in self.buckets if b.rate is not None]
        self.slowest_rate = min(rates) if rates else None
        # What a retransmission timeout costs: Linux's RTO is srtt + 4 * rttvar,
        # at least min_rto.
        rtt_s = 2 * params.delay_ms / 1e3
        self.rto_s = max(params.min_rto_ms / 1e3, rtt_s + 4 * params.jitter_ms / 1e3)

    def reserve(self, nbytes: int, now: float) -> float:
        """Departure time of ``nbytes`` offered at ``now`` (the slowest limiter decides)."""
        if len(self.buckets) == 1:
            return self.buckets[0].reserve(nbytes, now)
        return max(b.reserve(nbytes, now) for b in self.buckets)

    def backlog_s(self, now: float) -> float:
        """Seconds of bytes already waiting for the slowest limiter."""
        return max(b.backlog_s(now) for b in self.buckets)
