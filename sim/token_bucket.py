"""A rate limiter on a virtual clock (GCRA), shared by every connection that crosses it.

The emulator does not sleep per byte: each batch of bytes *reserves* its slot on
the link and learns when its last byte has left. Because slots are computed
from the virtual clock, not from when a timer actually fired, late timers never
lower the long-run rate, and many connections sharing one bucket share the rate
in arrival order, as a drop-tail queue does.
"""

from __future__ import annotations


class TokenBucket:
    """Bytes leave at ``rate_bytes_per_s`` after an initial burst of ``burst_bytes``.

    ``rate_bytes_per_s=None`` is an uncapped bucket: every reservation departs at once.
    """

    def __init__(self, rate_bytes_per_s: float | None, *, burst_bytes: int = 0) -> None:
        if rate_bytes_per_s is not None and rate_bytes_per_s <= 0:
            raise ValueError(f"rate_bytes_per_s must be > 0 or None, got {rate_bytes_per_s}")
        if burst_bytes < 0:
            raise ValueError(f"burst_bytes must be >= 0, got {burst_bytes}")
        self._rate = rate_bytes_per_s
        self._burst_bytes = burst_bytes
        # Theoretical arrival time: when the link would be idle again if every
        # byte reserved so far left at exactly the rate.
        self._tat = 0.0

    @property
    def rate(self) -> float | None:
        return self._rate

    def set_rate(self, rate_bytes_per_s: float | None) -> None:
        """Change the rate from now on; bytes already reserved keep their slots."""
        if rate_bytes_per_s is not None and rate_bytes_per_s <= 0:
            raise ValueError(f"rate_bytes_per_s must be > 0 or None, got {rate_bytes_per_s}")
        self._rate = rate_bytes_per_s

    def reserve(self, nbytes: int, now: float) -> float:
        """Reserve ``nbytes`` at time ``now``; return when their last byte has left."""
        if self._rate is None:
            return now
        tolerance = self._burst_bytes / self._rate
        start = max(self._tat, now)
        self._tat = start + nbytes / self._rate
        return max(now, self._tat - tolerance)

    def backlog_s(self, now: float) -> float:
        """Seconds of reserved bytes still waiting to leave (0 when idle)."""
        if self._rate is None:
            return 0.0
        return max(0.0, self._tat - now - self._burst_bytes / self._rate)
