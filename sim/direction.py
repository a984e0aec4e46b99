"""One direction of an emulated link, independent of what carries its bytes.

Both backends (the TCP proxy, the packet router) build on :class:`DirectionModel`:
the settings in force, the shared rate limiters, and the seeded processes that
turn settings into departure times, delays and losses. Each backend adds only
how it applies them to its unit (byte-stream batches, or packets).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any, Generic, TypeVar

from isthmus.job.link import DirectionParams, LinkParams, link_changes_to_direction
from isthmus.sim.jitter import JitterSampler
from isthmus.sim.loss import SegmentLoss
from isthmus.sim.token_bucket import TokenBucket
from isthmus.sim.topology import SharedLimits, direction_rng

log = logging.getLogger(__name__)


class DirectionModel:
    """Settings, rate limiters and random processes of the direction src -> dst."""

    def __init__(
        self,
        *,
        src: str,
        dst: str,
        params: DirectionParams,
        seed: int,
        shared: Sequence[TokenBucket] = (),
    ) -> None:
        """``shared``: the limiters this direction shares with other links (uplinks
        of src and dst, region egress; see :class:`~isthmus.sim.topology.SharedLimits`)."""
        self.src = src
        self.dst = dst
        self.blackholed = False
        self.rng = direction_rng(seed, src, dst)
        self._bucket = TokenBucket(params.rate_bytes_per_s)
        self.buckets = [self._bucket, *shared]
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
        # What a retransmission timeout costs: Linux's RTO is srtt + rttvar, and
        # rttvar (about 4 x the RTT's deviation) is at least min_rto (tcp_rtt_estimator).
        rtt_s = 2 * params.delay_ms / 1e3
        self.rto_s = rtt_s + max(params.min_rto_ms / 1e3, 4 * params.jitter_ms / 1e3)

    def reserve(self, nbytes: int, now: float) -> float:
        """Departure time of ``nbytes`` offered at ``now`` (the slowest limiter decides)."""
        if len(self.buckets) == 1:
            return self.buckets[0].reserve(nbytes, now)
        return max(b.reserve(nbytes, now) for b in self.buckets)

    def backlog_s(self, now: float) -> float:
        """Seconds of bytes already waiting for the slowest limiter."""
        if len(self.buckets) == 1:
            return self.buckets[0].backlog_s(now)
        return max(b.backlog_s(now) for b in self.buckets)

    def stats(self) -> dict[str, Any]:
        raise NotImplementedError


D = TypeVar("D", bound=DirectionModel)


class LinkModel(Generic[D]):
    """Both directions of the link between sites ``a`` and ``b``, and its controls.

    A backend subclasses it with its direction class and says how a partition
    and a change of settings reach the bytes in flight (``_cut``, ``_heal``,
    ``_apply``); validation, addressing, events and counters are shared.
    """

    direction_class: type[D]

    def __init__(
        self,
        a: str,
        b: str,
        params: LinkParams,
        *,
        seed: int,
        limits: SharedLimits,
    ) -> None:
        self.a, self.b = a, b
        self.name = f"{a}<->{b}"
        self.a_to_b: D = self.direction_class(
            src=a, dst=b, params=params.a_to_b, seed=seed, shared=limits.on_the_way(a, b)
        )
        self.b_to_a: D = self.direction_class(
            src=b, dst=a, params=params.b_to_a, seed=seed, shared=limits.on_the_way(b, a)
        )
        self.events: list[tuple[float, str]] = []
        """(time.monotonic(), what happened) for every change, cut and heal."""

    def direction(self, src: str) -> D:
        if src == self.a:
            return self.a_to_b
        if src == self.b:
            return self.b_to_a
        raise KeyError(f"site {src!r} is not an end of link {self.name}")

    def other(self, direction: D) -> D:
        return self.b_to_a if direction is self.a_to_b else self.a_to_b

    @property
    def params(self) -> LinkParams:
        return LinkParams(self.a_to_b.params, self.b_to_a.params)

    @property
    def state(self) -> str:
        return "blackhole" if self.a_to_b.blackholed else "up"

    def update(self, *, source: str | None = None, **changes: Any) -> None:
        """Change settings while traffic flows (both directions, or those leaving ``source``).

        Link-level names are accepted (``rtt_ms`` sets each direction's delay to rtt / 2).
        Raises :class:`~isthmus.job.link.LinkConfigError` and changes nothing if any is invalid.
        """
        changes = link_changes_to_direction(changes)
        targets = [self.direction(source)] if source else [self.a_to_b, self.b_to_a]
        new = [t.params.replace(**changes) for t in targets]  # validate all first
        self._apply(list(zip(targets, new, strict=True)))
        self._event(f"set {changes}" + (f" from {source}" if source else ""))

    def cut(self, mode: str = "blackhole") -> None:
        """Partition the link (``mode``: blackhole or reset) until :meth:`heal`."""
        if mode not in ("blackhole", "reset"):
            raise ValueError(f"unknown partition mode {mode!r}; use blackhole or reset")
        self._cut(mode)
        self._event(f"cut ({mode})")

    def heal(self) -> None:
        """End a partition."""
        self._heal()
        self._event("heal")

    def _apply(self, changes: list[tuple[D, DirectionParams]]) -> None:
        for direction, params in changes:
            direction.apply(params)

    def _cut(self, mode: str) -> None:
        self.a_to_b.blackholed = self.b_to_a.blackholed = True

    def _heal(self) -> None:
        self.a_to_b.blackholed = self.b_to_a.blackholed = False

    def _event(self, what: str) -> None:
        self.events.append((time.monotonic(), what))
        log.info("link %s: %s", self.name, what)

    def stats(self) -> dict[str, Any]:
        return {
            "between": [self.a, self.b],
            "state": self.state,
            "rtt_ms": self.params.rtt_ms,
            f"{self.a}->{self.b}": self.a_to_b.stats(),
            f"{self.b}->{self.a}": self.b_to_a.stats(),
        }
