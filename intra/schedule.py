"""The inner learning-rate schedules of the built-in training: warm-up, then cosine or held."""

from __future__ import annotations

import math

from isthmus.job.setting_groups import SCHEDULES

WSD_DECAY_FRACTION = 0.2


def warmup_cosine(peak: float, step: int, warmup_steps: int, steps: int) -> float:
    """Linear warm-up to ``peak`` over ``warmup_steps``, then cosine decay to 10% of it
    at ``steps`` (the floor keeps the last steps of short runs useful)."""
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, steps - warmup_steps))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def learning_rate_at(schedule: str, peak: float, step: int, warmup_steps: int, steps: int) -> float:
    """The rate at ``step`` under ``schedule`` (one of :data:`SCHEDULES`)."""
    if schedule == "cosine":
        return warmup_cosine(peak, step, warmup_steps, steps)
    held = peak * min(1.0, (step + 1) / max(1, warmup_steps))  # warm-up, then the peak
    if schedule == "constant":
        return held
    if schedule == "wsd":
        decay_start = max(warmup_steps, round(steps * (1 - WSD_DECAY_FRACTION)))
        if step < decay_start:
            return held
        progress = min(1.0, (step - decay_start) / max(1, steps - decay_start))
        return peak * (1 - 0.9 * progress)
    raise ValueError(f"unknown learning-rate schedule {schedule!r}; use one of {SCHEDULES}")
