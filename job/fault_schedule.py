"""The fault schedule of an emulated WAN, as the job file's ``wan.faults`` gives it.

Plain data and its check: the emulator (:mod:`isthmus.sim.fault_runner`) runs it, the
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
    """One scheduled fault on a link.

    When it starts, one of: ``at_s`` seconds after the emulator started, or
    ``at_round``: once a site has completed that many rounds (``rounds_of``: that
    site; else whichever site gets there first), as reported to the emulator's
    :class:`~isthmus.sim.fault_runner.Progress` (``isthmus run`` reports every site's
    rounds). A round trigger holds on a machine of any speed: the fault falls at
    the same point of training, however late the sites started.

    ``partition``: the link stops carrying bytes (``mode`` blackhole:
    connections hang; reset: they are torn down and new ones refused).
    ``flap``: partitions of ``down_s`` every ``period_s``.
    ``brownout``: the link settings in ``changes`` apply, then revert.
    ``corrupt``: a fraction ``rate`` of bytes get a bit flipped.

    How long it lasts, one of: ``for_s`` seconds from when it started, or
    ``for_rounds``: until the site (``rounds_of``, else any) has completed that
    many more rounds than when it started. Neither means until changed by hand
    (not allowed for flap).
    """

    at_s: float | None = None
    at_round: int | None = None
    link: tuple[str, str]
    action: str
    for_s: float | None = None
    for_rounds: int | None = None
    rounds_of: str | None = None
    mode: str = "blackhole"
    period_s: float | None = None
    down_s: float | None = None
    rate: float | None = None
    changes: dict[str, Any] = field(default_factory=dict)

    def describe_start(self) -> str:
        """When it starts, in words: ``20 s`` or ``round 4 of b``."""
        if self.at_round is None:
            return f"{self.at_s:g} s"
        return f"round {self.at_round}" + (f" of {self.rounds_of}" if self.rounds_of else "")

    def describe_length(self) -> str:
        """How long it lasts, in words (empty: until changed by hand)."""
        if self.for_s is not None:
            return f"for {self.for_s:g} s"
        if self.for_rounds is not None:
            whose = f" of {self.rounds_of}" if self.rounds_of else ""
            return f"for {self.for_rounds} round{'s' if self.for_rounds != 1 else ''}{whose}"
        return ""


SLOWDOWN_MAX = 100.0
"""The largest slowdown factor: beyond it a site is as good as stopped (a fault
the partition and kill faults model better)."""


@dataclass(frozen=True, kw_only=True)
class Slowdown:
    """A site that computes ``factor`` times slower for a while (a GPU that throttles,
    a cluster shared with another job: fail-slow). Applied inside the site's
    training loop: after each step it waits ``factor - 1`` times the step's compute,
    so the time is real and counted as its compute, under every strategy.

    When it starts: ``at_s`` seconds after the site started training, or once the
    site has completed ``at_round`` rounds. How long: ``for_s`` seconds or
    ``for_rounds`` rounds (neither: to the end)."""

    slow: str
    factor: float
    at_s: float | None = None
    at_round: int | None = None
    for_s: float | None = None
    for_rounds: int | None = None

    def describe(self) -> str:
        """In words: ``d 4x slower from round 5 for 5 rounds``."""
        start = f"{self.at_s:g} s" if self.at_s is not None else f"round {self.at_round}"
        if self.for_s is not None:
            length = f" for {self.for_s:g} s"
        elif self.for_rounds is not None:
            length = f" for {self.for_rounds} round{'s' if self.for_rounds != 1 else ''}"
        else:
            length = " to the end"
        return f"{self.slow} {self.factor:g}x slower from {start}{length}"

    def active(self, seconds: float, rounds: int, began: tuple[float, int] | None) -> bool:
        """Whether it holds for a site ``seconds`` into its training with ``rounds``
        completed; ``began``: (seconds, rounds) when it started holding, if it has."""
        started = (
            seconds >= self.at_s if self.at_s is not None else rounds >= (self.at_round or 0)
        )
        if not started:
            return False
        if began is None:
            return True
        if self.for_s is not None:
            return seconds < began[0] + self.for_s
        if self.for_rounds is not None:
            return rounds < began[1] + self.for_rounds
        return True


def validate_slowdown(slowdown: Slowdown, site_names: list[str]) -> None:
    """Raise :class:`LinkConfigError` naming the field of ``slowdown`` that is wrong."""
    if slowdown.slow not in site_names:
        raise LinkConfigError(
            "slow", f"unknown site {slowdown.slow!r}; sites: {', '.join(site_names)}"
        )
    factor = slowdown.factor
    if not (isinstance(factor, int | float) and not isinstance(factor, bool)):
        raise LinkConfigError("factor", f"must be a number, got {factor!r}")
    if not 1 <= factor <= SLOWDOWN_MAX:
        why = " (a factor below 1 would make the site faster)" if 0 < factor < 1 else ""
        raise LinkConfigError(
            "factor",
            f"must be from 1 to {SLOWDOWN_MAX:g} (times slower), got {factor:g}{why}",
        )
    if (slowdown.at_s is None) == (slowdown.at_round is None):
        raise LinkConfigError(
            "at_s", "give one of at_s (seconds after the site started training) or at_round"
        )
    if slowdown.at_s is not None and slowdown.at_s < 0:
        raise LinkConfigError("at_s", f"must be >= 0 seconds, got {slowdown.at_s}")
    if slowdown.for_s is not None and slowdown.for_rounds is not None:
        raise LinkConfigError("for_rounds", "give one of for_s or for_rounds, not both")
    if slowdown.for_s is not None and slowdown.for_s <= 0:
        raise LinkConfigError("for_s", f"must be > 0 seconds, got {slowdown.for_s}")


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
    if (fault.at_s is None) == (fault.at_round is None):
        both = fault.at_s is not None
        raise LinkConfigError(
            "at_s",
            ("give one of at_s" if both else "give at_s")
            + " (seconds after the emulator started) or at_round (once a site has "
            "completed that many rounds)" + (", not both" if both else ""),
        )
    if fault.at_s is not None and fault.at_s < 0:
        raise LinkConfigError("at_s", f"must be >= 0 seconds after start, got {fault.at_s}")
    if fault.at_round is not None and not _positive_int(fault.at_round):
        raise LinkConfigError(
            "at_round", f"must be a whole number of rounds >= 1, got {fault.at_round!r}"
        )
    if fault.for_s is not None and fault.for_rounds is not None:
        raise LinkConfigError(
            "for_rounds", "give one of for_s (seconds) or for_rounds (rounds), not both"
        )
    if fault.for_s is not None and fault.for_s <= 0:
        raise LinkConfigError("for_s", f"must be > 0 seconds, got {fault.for_s}")
    if fault.for_rounds is not None and not _positive_int(fault.for_rounds):
        raise LinkConfigError(
            "for_rounds", f"must be a whole number of rounds >= 1, got {fault.for_rounds!r}"
        )
    if fault.rounds_of is not None:
        if fault.rounds_of not in site_names:
            raise LinkConfigError(
                "rounds_of", f"unknown site {fault.rounds_of!r}; sites: {', '.join(site_names)}"
            )
        if fault.at_round is None and fault.for_rounds is None:
            raise LinkConfigError(
                "rounds_of", "names whose rounds at_round or for_rounds count; give one of them"
            )
    if fault.mode not in PARTITION_MODES:
        raise LinkConfigError(
            "mode", f"unknown partition mode {fault.mode!r}; use blackhole or reset"
        )
    if fault.action == "flap":
        if fault.for_s is None and fault.for_rounds is None:
            raise LinkConfigError(
                "for_s", "a flap needs for_s or for_rounds, how long the flapping lasts"
            )
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


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
