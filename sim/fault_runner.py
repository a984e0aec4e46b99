"""Running a scheduled fault against a link, for every backend of the emulator.

A link of any backend offers the same controls (:class:`ControllableLink`):
change settings, cut, heal. A fault of the topology's schedule is a small
coroutine over those controls, so the TCP proxy and the packet router replay
the same schedule the same way. A fault starts at a time or at a point of
training (:class:`Progress`, the rounds the sites report), and ends after a
time or after more rounds.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

from isthmus.job.link import LinkParams
from isthmus.sim.topology import Fault

log = logging.getLogger(__name__)


class ControllableLink(Protocol):
    """What the emulator's controls (and the fault schedule) need of a link."""

    @property
    def params(self) -> LinkParams: ...

    def update(self, *, source: str | None = None, **changes: Any) -> None: ...

    def cut(self, mode: str = "blackhole") -> None: ...

    def heal(self) -> None: ...

    def stats(self) -> dict[str, Any]: ...


class Progress:
    """How far training has got, as the sites' rounds: what ``at_round`` and
    ``for_rounds`` faults wait on.

    The emulator knows nothing of training; whoever follows the sites reports
    their rounds (``isthmus run``'s launcher does, through the control service's
    ``progress`` request). Counts only grow: a late or repeated report changes
    nothing. Lives on the emulator's event loop.
    """

    def __init__(self) -> None:
        self._rounds: dict[str, int] = {}
        self._changed = asyncio.Event()

    def report(self, site: str, rounds: int) -> None:
        """``site`` has completed ``rounds`` rounds."""
        if rounds > self._rounds.get(site, 0):
            self._rounds[site] = rounds
            changed, self._changed = self._changed, asyncio.Event()
            changed.set()

    def rounds(self, site: str | None = None) -> int:
        """Rounds ``site`` has completed; without one, the most any site has."""
        if site is not None:
            return self._rounds.get(site, 0)
        return max(self._rounds.values(), default=0)

    async def reached(self, rounds: int, site: str | None = None) -> None:
        """Return once ``site`` (else any site) has completed ``rounds`` rounds."""
        while self.rounds(site) < rounds:
            await self._changed.wait()

    def as_dict(self) -> dict[str, int]:
        return dict(self._rounds)


async def run_fault(
    fault: Fault, link: ControllableLink, *, started_at: float, progress: Progress
) -> None:
    """Wait for the fault's start (``started_at + at_s``, loop time, or its round),
    then play it until its end (``for_s`` or ``for_rounds``)."""
    loop = asyncio.get_running_loop()
    if fault.at_round is not None:
        await progress.reached(fault.at_round, fault.rounds_of)
    else:
        assert fault.at_s is not None
        await asyncio.sleep(max(0.0, started_at + fault.at_s - loop.time()))
    log.info(
        "fault %s on %s<->%s starts (%s)%s",
        fault.action,
        *fault.link,
        fault.describe_start(),
        f"; progress: {progress.as_dict()}" if progress.as_dict() else "",
    )
    lasting = fault.for_s is not None or fault.for_rounds is not None
    # Its end, counted from now: a duration or more rounds.
    ending = asyncio.ensure_future(_end(fault, progress))
    try:
        if fault.action == "partition":
            link.cut(fault.mode)
            if lasting:
                await ending
                link.heal()
        elif fault.action == "flap":
            assert lasting and fault.period_s and fault.down_s
            while not ending.done():
                link.cut(fault.mode)
                await asyncio.wait([ending], timeout=fault.down_s)
                link.heal()
                if not ending.done():
                    await asyncio.wait([ending], timeout=fault.period_s - fault.down_s)
        elif fault.action in ("brownout", "corrupt"):
            changes = dict(fault.changes) if fault.action == "brownout" else {"corrupt": fault.rate}
            before = current_values(link.params, changes)
            link.update(**changes)
            if lasting:
                await ending
                link.update(**before)
    finally:
        ending.cancel()


async def _end(fault: Fault, progress: Progress) -> None:
    """Return when ``fault``, started now, is over; never without for_s or for_rounds."""
    if fault.for_s is not None:
        await asyncio.sleep(fault.for_s)
    elif fault.for_rounds is not None:
        await progress.reached(progress.rounds(fault.rounds_of) + fault.for_rounds, fault.rounds_of)
    else:
        await asyncio.Event().wait()


def current_values(params: LinkParams, changes: dict[str, Any]) -> dict[str, Any]:
    """The present values of the settings a temporary fault is about to change."""
    return {
        name: params.rtt_ms if name == "rtt_ms" else getattr(params.a_to_b, name)
        for name in changes
    }
