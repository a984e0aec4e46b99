"""A TCP sender's congestion window under loss, as Linux's default CUBIC moves it.

The proxy backend carries a byte stream, so it has no real TCP between the
emulated hosts to back off when a segment is lost. On a lossy link the
sender's congestion window is what sets the throughput, so each proxied
connection keeps one, and this module moves it as Linux does (RFC 9438 and
``net/ipv4/tcp_cubic.c``), in segments:

* Slow start from 10 segments, one segment per segment acknowledged, up to
  ssthresh (HyStart is left out: it only matters on lossless ramps, where the
  proxy applies no window at all).
* On a loss: the sender learns of it one round trip after the lost segment
  left (duplicate ACKs or SACKs), then cuts the window to beta = 0.7 of what
  it was, and keeps it there until the retransmission is acknowledged, a
  round trip later (fast recovery). Losses of segments sent before the loss
  was detected are repaired in the same recovery, as with SACK.
* Congestion avoidance: the window follows the cubic curve
  ``C (t - K)^3 + W_max`` from the last reduction, but never grows slower than
  Reno would with the same beta (CUBIC's "TCP-friendly" estimate, which adds
  ``3 (1 - beta) / (1 + beta)`` segments per round trip). On links of tens of
  milliseconds and windows of tens of segments the friendly estimate is what
  governs; the cubic curve takes over on long fat links.
* Fast convergence: a loss below the last maximum lowers W_max further.
* A timeout (too few segments in flight for duplicate ACKs) restarts from one
  segment.

``isthmus bench wan --hosts`` compares the proxy built on this window with
real Linux TCP (cubic) through the packet-level backend, under the same loss.
"""

from __future__ import annotations

import math

BETA = 0.7
"""Multiplicative decrease: the window after a loss, as a share of the one before."""
CUBIC_C = 0.4
"""Scale of the cubic curve, segments / s^3."""
FRIENDLY_ALPHA = 3 * (1 - BETA) / (1 + BETA)
"""Segments per round trip that Reno with this beta adds: what CUBIC never falls below."""
INITIAL_SEGMENTS = 10
"""Linux's initial congestion window (RFC 6928)."""
MIN_SEGMENTS = 2.0
"""The least the window is cut to by a loss (Linux's floor for ssthresh)."""
MAX_GROWTH_PER_SEGMENT = 0.5
"""Linux grows the window by at most one segment per two acknowledged (1.5x per RTT)."""


class CubicWindow:
    """The congestion window of one TCP sender, in segments, driven by ACKs and losses.

    Times are the caller's clock, in seconds. ``rtt_s`` is the path's round trip.
    """

    def __init__(self, *, rtt_s: float, limit_segments: float = math.inf) -> None:
        self.rtt_s = rtt_s
        self.limit = limit_segments
        self.cwnd = float(min(INITIAL_SEGMENTS, limit_segments))
        self.ssthresh = math.inf
        self.w_max = 0.0
        self._epoch_start: float | None = None
        self._k = 0.0
        self._origin = 0.0
        self._friendly = 0.0
        # The pending reduction: when the sender learns of the loss.
        self._reduce_at: float | None = None
        # Segments sent before this time belong to the recovery under way; it is
        # also when that recovery was detected, from which the window does not
        # grow until the retransmission is acknowledged (``_frozen_until``).
        self._recovery_sent_before = -math.inf
        self._frozen_until = -math.inf

    def segments(self, now: float) -> float:
        """The window at ``now`` (a loss detected by then has cut it)."""
        self._settle(now)
        return self.cwnd

    # -- events ---------------------------------------------------------------
    def on_ack(self, acked_segments: float, now: float) -> None:
        """``acked_segments`` (may be fractional) were acknowledged at ``now``."""
        self._settle(now)
        if self._recovery_sent_before <= now < self._frozen_until or acked_segments <= 0:
            return
        if self.cwnd < self.ssthresh:
            slow = min(acked_segments, self.ssthresh - self.cwnd)
            self.cwnd += slow
            acked_segments -= slow
        if acked_segments > 0:
            self._avoid(acked_segments, now)
        self.cwnd = min(self.cwnd, self.limit)

    def on_loss(self, sent_at: float) -> bool:
        """A segment sent at ``sent_at`` was lost and is repaired by fast retransmit.

        Returns whether it starts a new recovery (False: an earlier loss's
        recovery repairs it too)."""
        if sent_at < self._recovery_sent_before:
            return False
        if self._reduce_at is not None:
            # The previous loss's cut is still pending (departures can be
            # booked ahead of the clock on a queued link): make it now, not never.
            self._settle(self._reduce_at)
        detected = sent_at + self.rtt_s
        self._reduce_at = detected
        self._recovery_sent_before = detected
        self._frozen_until = detected + self.rtt_s
        return True

    def on_timeout(self, now: float) -> None:
        """A retransmission timeout at ``now``: restart from one segment in slow start."""
        self._reduce_at = None
        self._cut()
        self.cwnd = 1.0
        self._recovery_sent_before = now
        self._frozen_until = -math.inf

    # -- internals --------------------------------------------------------------
    def _settle(self, now: float) -> None:
        if self._reduce_at is not None and now >= self._reduce_at:
            self._reduce_at = None
            self._cut()
            self.cwnd = self.ssthresh

    def _cut(self) -> None:
        """Linux's bictcp_recalc_ssthresh: remember W_max and set ssthresh."""
        self._epoch_start = None
        if self.cwnd < self.w_max:
            # Fast convergence: a flow that lost below its last maximum is
            # probably sharing with a newcomer; leave it room.
            self.w_max = self.cwnd * (1 + BETA) / 2
        else:
            self.w_max = self.cwnd
        self.ssthresh = max(self.cwnd * BETA, MIN_SEGMENTS)

    def _avoid(self, acked: float, now: float) -> None:
        if self._epoch_start is None:
            self._epoch_start = now
            self._friendly = self.cwnd
            if self.w_max > self.cwnd:
                self._k = ((self.w_max - self.cwnd) / CUBIC_C) ** (1 / 3)
                self._origin = self.w_max
            else:
                self._k = 0.0
                self._origin = self.cwnd
        # Aim where the curve will be one round trip from now.
        t = now - self._epoch_start + self.rtt_s
        target = self._origin + CUBIC_C * (t - self._k) ** 3
        per_segment = (target - self.cwnd) / self.cwnd if target > self.cwnd else 0.01 / self.cwnd
        self._friendly += FRIENDLY_ALPHA * acked / self.cwnd
        if self._friendly > self.cwnd:
            per_segment = max(per_segment, (self._friendly - self.cwnd) / self.cwnd)
        self.cwnd += acked * min(per_segment, MAX_GROWTH_PER_SEGMENT)
