"""The inner learning-rate schedule of the built-in training: warm-up, then cosine."""

from __future__ import annotations

import math


def warmup_cosine(peak: float, step: int, warmup_steps: int, steps: int) -> float:
    """Linear warm-up to ``peak`` over ``warmup_steps``, then cosine decay to 10% of it
    at ``steps`` (the floor keeps the last steps of short runs useful)."""
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, steps - warmup_steps))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
