"""Random one-way delay variation (jitter) for an emulated link.

``jitter_ms`` is the standard deviation of the one-way delay for ``normal`` and
``uniform``; for ``pareto`` it is the scale of a heavy-tailed *extra* delay, the
way a path with occasional queueing spikes behaves. The delay line that uses
these samples keeps the byte stream in order (a sample that would overtake the
previous segment waits for it), as TCP's in-order delivery would.
"""

from __future__ import annotations

import math
import random


class JitterSampler:
    """Draws one-way delays in seconds around a base delay, never below zero."""

    def __init__(
        self,
        rng: random.Random,
        *,
        delay_ms: float,
        jitter_ms: float,
        distribution: str = "normal",
        pareto_shape: float = 3.0,
    ) -> None:
        self._rng = rng
        self._delay_s = delay_ms / 1e3
        self._jitter_s = jitter_ms / 1e3
        self._distribution = distribution
        self._pareto_shape = pareto_shape

    def sample_s(self) -> float:
        if self._jitter_s == 0:
            return self._delay_s
        if self._distribution == "normal":
            extra = self._rng.gauss(0.0, self._jitter_s)
        elif self._distribution == "uniform":
            # U(-a, a) has standard deviation a / sqrt(3).
            half_width = self._jitter_s * math.sqrt(3)
            extra = self._rng.uniform(-half_width, half_width)
        elif self._distribution == "pareto":
            # Pareto(scale=jitter, shape) shifted to start at 0: always an extra delay.
            extra = self._jitter_s * (self._rng.paretovariate(self._pareto_shape) - 1.0)
        else:
            raise ValueError(f"unknown jitter distribution {self._distribution!r}")
        return max(0.0, self._delay_s + extra)
