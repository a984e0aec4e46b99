"""Running a scheduled fault against a link, for every backend of the emulator.

A link of any backend offers the same controls (:class:`ControllableLink`):
change settings, cut, heal. A fault of the topology's schedule is a small
coroutine over those controls, so the TCP proxy and the packet router replay
the same schedule the same way.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from isthmus.sim.link import LinkParams
from isthmus.sim.topology import Fault


class ControllableLink(Protocol):
    """What the emulator's controls (and the fault schedule) need of a link."""

    @property
    def params(self) -> LinkParams: ...

    def update(self, *, source: str | None = None, **changes: Any) -> None: ...

    def cut(self, mode: str = "blackhole") -> None: ...

    def heal(self) -> None: ...

    def stats(self) -> dict[str, Any]: ...


async def run_fault(fault: Fault, link: ControllableLink, *, started_at: float) -> None:
    """Sleep until ``started_at + fault.at_s`` (loop time), then play the fault."""
    loop = asyncio.get_running_loop()
    await asyncio.sleep(max(0.0, started_at + fault.at_s - loop.time()))
    if fault.action == "partition":
        link.cut(fault.mode)
        if fault.for_s is not None:
            await asyncio.sleep(fault.for_s)
            link.heal()
    elif fault.action == "flap":
        assert fault.for_s and fault.period_s and fault.down_s
        end = loop.time() + fault.for_s
        while loop.time() < end:
            link.cut(fault.mode)
            await asyncio.sleep(min(fault.down_s, end - loop.time()))
            link.heal()
            await asyncio.sleep(max(0.0, min(fault.period_s - fault.down_s, end - loop.time())))
    elif fault.action in ("brownout", "corrupt"):
        changes = dict(fault.changes) if fault.action == "brownout" else {"corrupt": fault.rate}
        before = current_values(link.params, changes)
        link.update(**changes)
        if fault.for_s is not None:
            await asyncio.sleep(fault.for_s)
            link.update(**before)


def current_values(params: LinkParams, changes: dict[str, Any]) -> dict[str, Any]:
    """The present values of the settings a temporary fault is about to change."""
    return {
        name: params.rtt_ms if name == "rtt_ms" else getattr(params.a_to_b, name)
        for name in changes
    }
