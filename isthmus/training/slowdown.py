"""A site that computes slower for a while (the job file's ``wan.faults`` entries with
``slow:``): the fault applied where it happens, inside the site's training loop.

After each step the site waits ``factor - 1`` times what the step took, so it loses
real time, counted as its compute (as a throttled GPU's would be), under every
strategy and for scripts as for the built-in loop. Each slowdown says when it
starts and ends in the site's records (``slowdown``: ``factor``, ``state``
``started`` or ``ended``, ``round``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from isthmus.job.fault_schedule import Slowdown


class SlowSteps:
    """The slowdowns of one site, applied step by step."""

    def __init__(self, slowdowns: list[Slowdown], record: Callable[..., None]) -> None:
        self._slowdowns = slowdowns
        self._began: dict[int, tuple[float, int]] = {}
        self._over: set[int] = set()
        self._record = record

    @classmethod
    def for_site(cls, job: Any, site: str, record: Callable[..., None]) -> SlowSteps | None:
        """This site's slowdowns in ``job`` (None: it has none)."""
        mine = [s for s in (job.wan.slowdowns if job.wan is not None else ()) if s.slow == site]
        return cls(mine, record) if mine else None

    def factor(self, seconds: float, rounds: int) -> float:
        """The slowdown in force ``seconds`` into the site's training with ``rounds``
        completed (1: none); records each one's start and end."""
        factor = 1.0
        for index, slowdown in enumerate(self._slowdowns):
            if index in self._over:
                continue
            began = self._began.get(index)
            if slowdown.active(seconds, rounds, began):
                if began is None:
                    self._began[index] = (seconds, rounds)
                    self._record("slowdown", state="started", factor=slowdown.factor, round=rounds)
                factor = max(factor, slowdown.factor)
            elif began is not None:
                self._over.add(index)
                self._record("slowdown", state="ended", factor=slowdown.factor, round=rounds)
        return factor

    def slow_down(self, seconds: float, rounds: int, step_s: float) -> None:
        """Wait what a step of ``step_s`` seconds costs more under the slowdown in force."""
        factor = self.factor(seconds, rounds)
        if factor > 1 and step_s > 0:
            time.sleep((factor - 1) * step_s)
