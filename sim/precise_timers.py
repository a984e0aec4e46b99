"""Sub-millisecond timers for an asyncio loop, backed by one timerfd.

asyncio's own ``call_at`` waits in epoll, whose timeout is rounded up to whole
milliseconds: an emulated one-way delay would come out up to a millisecond
late, depending on where the deadline falls. The proxy schedules deliveries
here instead: a heap of deadlines and a timerfd armed for the earliest one,
watched by the loop like any other file descriptor.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable

from isthmus.sim.timerfd import TimerFD

# The timerfd wakes the loop ~0.1 ms after a deadline, and a hop through the
# proxy process costs another ~0.2 ms; callbacks due within this slack run on a
# wake-up, which centres the emulated delay's error on zero (`isthmus bench wan`).
SLACK_S = 0.0003


class TimerHandle:
    """A scheduled callback; :meth:`cancel` stops it from running."""

    __slots__ = ("callback", "cancelled", "when")

    def __init__(self, when: float, callback: Callable[[], None]) -> None:
        self.when = when
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class PreciseTimers:
    """``call_at`` with ~0.1 ms precision on ``loop`` (whose clock is time.monotonic)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._timer = TimerFD()
        self._heap: list[tuple[float, int, TimerHandle]] = []
        self._order = itertools.count()
        self._closed = False
        loop.add_reader(self._timer.fd, self._fire)

    def call_at(self, when: float, callback: Callable[[], None]) -> TimerHandle:
        handle = TimerHandle(when, callback)
        heapq.heappush(self._heap, (when, next(self._order), handle))
        if self._heap[0][2] is handle:
            self._timer.arm(when - SLACK_S)
        return handle

    def _fire(self) -> None:
        self._timer.clear()
        heap = self._heap
        horizon = self._loop.time() + SLACK_S
        while heap and heap[0][0] <= horizon:
            _, _, handle = heapq.heappop(heap)
            if not handle.cancelled:
                handle.callback()
        while heap and heap[0][2].cancelled:
            heapq.heappop(heap)
        if heap:
            self._timer.arm(heap[0][0] - SLACK_S)

    def close(self) -> None:
        """Stop watching the timer (idempotent); pending callbacks never run."""
        if self._closed:
            return
        self._closed = True
        self._loop.remove_reader(self._timer.fd)
        self._timer.close()
        self._heap.clear()
