"""The fault schedule of an emulated WAN, as the job file's ``wan.faults`` gives it.

Plain data and its check: the emulator (:mod:`isthmus.sim.faults`) runs it, the
job file validates it when it is loaded, before anything starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from isthmus.job.link import LinkConfigError, LinkParams, link_changes_to_direction

FAULT_ACTIONS = ("partition", "flap", "brownout", "corrupt")
PARTITION_MODES = ("blackhole", "reset")


@dataclass(frozen=True, kw_only=True)
class Fault:
    """One scheduled fault on a link, ``at_s`` seconds after the emulator started.

    ``partition``: the link stops carrying bytes for ``for_s`` (``mode`` blackhole:
    connections hang; reset: they are torn down and new ones refused).
    ``flap``: partitions of ``down_s`` every ``period_s``, for ``for_s`` in all.
    ``brownout``: the link settings in ``changes`` apply for ``for_s``, then revert.
    ``corrupt``: a fraction ``rate`` of bytes get a bit flipped for ``for_s``.
    ``for_s`` = None means until changed by hand (not allowed for flap).
    """

    at_s: float
    link: tuple[str, str]
    action: str
    for_s: float | None = None
    mode: str = "blackhole"
    period_s: float | None = None
    down_s: float | None = None
    rate: float | None = None
    changes: dict[str, Any] = field(default_factory=dict)


def validate_fault(fault: Fault, site_names: list[str]) -> None:
    """Raise :class:`LinkConfigError` naming the field of ``fault`` that is wrong."""
    a, b = fault.link
    for name in (a, b):
        if name not in site_names:
            raise LinkConfigError("link", f"unknown site {name!r}; sites: {', '.join(site_names)}")
    if a == b:
        raise LinkConfigError("link", f"a link joins two different sites, got [{a}, {b}]")
    if fault.action not in FAULT_ACTIONS:
        raise LinkConfigError(
            "action", f"unknown fault {fault.action!r}; use one of {', '.join(FAULT_ACTIONS)}"
        )
    if fault.at_s < 0:
        raise LinkConfigError("at_s", f"must be >= 0 seconds after start, got {fault.at_s}")
    if fault.for_s is not None and fault.for_s <= 0:
        raise LinkConfigError("for_s", f"must be > 0 seconds, got {fault.for_s}")
    if fault.mode not in PARTITION_MODES:
        raise LinkConfigError(
            "mode", f"unknown partition mode {fault.mode!r}; use blackhole or reset"
        )
    if fault.action == "flap":
        if fault.for_s is None:
            raise LinkConfigError("for_s", "a flap needs for_s, how long the flapping lasts")
        if fault.period_s is None or fault.period_s <= 0:
            raise LinkConfigError("period_s", "a flap needs period_s > 0 (seconds between cuts)")
        if fault.down_s is None or not 0 < fault.down_s < fault.period_s:
            raise LinkConfigError(
                "down_s", "a flap needs 0 < down_s < period_s (seconds each cut lasts)"
            )
    if fault.action == "corrupt" and (fault.rate is None or not 0 < fault.rate <= 1):
        raise LinkConfigError("rate", f"a corrupt fault needs 0 < rate <= 1, got {fault.rate}")
    if fault.action == "brownout":
        if not fault.changes:
            raise LinkConfigError(
                "changes", "a brownout needs link settings to apply, e.g. {bandwidth_mbit: 10}"
            )
        # Validate the settings now, not when the fault fires mid-run.
        LinkParams().a_to_b.replace(**link_changes_to_direction(fault.changes))
