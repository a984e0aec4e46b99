"""One site's side of the membership protocol: the views it applies, the reports it
sends, and, where it is the leader, the views it publishes.

The protocol itself (what a view and a report are, and how the leader decides)
is pure and lives in :mod:`isthmus.inter.membership.protocol`; this module adds
the threads, the waiting and the timing around it.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from isthmus.inter.membership.protocol import (
    Report,
    View,
    consider,
    first_view,
    leader_of,
    stuck_in,
)

log = logging.getLogger(__name__)

PROBE_EVERY_S = 2.0
"""How often a site waiting to be let in checks which members it can reach."""
PROPOSAL_WAIT_S = 5.0
"""How long the leader waits for its published view to come back from the broker
before it decides (and publishes) again: a publish can be lost with the connection."""


class MembershipError(RuntimeError):
    """This site cannot go on as a member (no usable view came, or the others stopped)."""


class RunOver(MembershipError):
    """Every other site finished training while this one was coming back (restarted,
    or let back in too late): the run is over for it, with the model it had."""


class LeftTheRun(Exception):
    """This site asked to leave and the view that lets it go has come: stop training."""


@dataclasses.dataclass
class _Mine:
    """This site's own report, as it last said it."""

    phase: str = "training"
    rounds: int = 0
    engine_round: int = 0
    unreachable: tuple[str, ...] = ()
    conflict: int | None = None


class Membership:
    """One site's side of the membership protocol (thread-safe).

    The control plane's thread feeds it statuses and views; the training thread
    asks it which view a round runs under, whether the round under way must be
    abandoned, and tells it how its rounds went. Where this site is the leader,
    status changes make it decide and publish the next view."""

    def __init__(
        self,
        sites: Sequence[str],
        me: str,
        *,
        min_sites: int,
        joining: bool = False,
        stuck_settle_s: float = 0.0,
    ) -> None:
        if me not in sites:
            raise ValueError(f"site {me!r} is not one of {list(sites)}")
        if not 1 <= min_sites <= len(sites):
            raise ValueError(f"min_sites must be in [1, {len(sites)}], got {min_sites}")
        self.sites = list(sites)
        self.me = me
        self.min_sites = min_sites
        self.stuck_settle_s = stuck_settle_s
        """How long the leader waits for the members still in a round to report before it
        runs the round again with the same members (see the module's docstring)."""
        self._stuck_since: tuple[int, float] | None = None
        """(epoch, when) the leader first held back a view for the members' reports."""
        self._settle_timer: threading.Timer | None = None
        self.applied = first_view(sites)
        """The view this site's rounds run under now."""
        self.latest = self.applied
        """The newest view published (applied when its start round comes)."""
        self.history: list[View] = []
        """Every view this site applied after the first, in order."""
        self._proposed: View | None = None
        self._held: str | None = None
        """Why the leader last let the view stand though a site asked for a change (said once)."""
        self._proposed_at = 0.0
        self._reports: dict[str, Report | None] = {}
        self._mine = _Mine(phase="joining" if joining else "training")
        self._admitted = not joining
        """False until a view lets this (joining) site in: the views it finds are the
        members' before it came back."""
        self._changed = threading.Condition()
        self.publish_report: Callable[[dict[str, Any]], None] = lambda report: None
        """Set by the control plane: sends this site's report in its status."""
        self.publish_view: Callable[[View], None] | None = None
        """Set by the control plane: publishes a view (retained); None: cannot lead."""
        self.probe: Callable[[Sequence[str]], list[str]] | None = None
        """Set by the strategy: which of these sites this one cannot reach now (asked
        while it waits to be let in)."""
        self.take_in: Callable[[str, Any], str | None] | None = None
        """Set by the strategy: make ready to exchange with a site that is not in the
        job file (added to a newer one), given how it describes itself; returns why
        it cannot be taken in. None: this site takes in no new sites."""
        self._job_sites = list(sites)
        self._newcomers: dict[str, Any] = {}
        """Sites taken in that are not in the job file -> their descriptions."""
        self._refused: set[str] = set()
        self.stale_views = 0
        """Views older than the one in force, or others under its number: ignored."""

    # -- what the control plane feeds in (its own thread) ---------------------------
    def on_status(self, site: str, status: Mapping[str, Any]) -> str | None:
        """A site's status arrived; returns why it was ignored, if it was."""
        if site not in self.sites:
            if status.get("state") != "online":
                return None  # a site never taken in went away: nothing to forget
            problem = self._take_in(site, status.get("spec"))
            if problem:
                return problem
        report = Report.from_status(status, self.sites)
        if isinstance(report, str):
            return report
        with self._changed:
            previous = self._reports.get(site)
            if (
                previous is not None
                and previous.phase == "done"
                and not report.online
                and report.phase != "done"
            ):
                # The Last Will is the status from when the site connected (training,
                # a few rounds), and a broker may send it after the site's own
                # goodbye (amqtt does, now and then, although the client sent a
                # DISCONNECT). A site that said it finished stays finished until it
                # comes online again: taken for lost, it would start a view that
                # leaves it out of the round the others still run with it.
                report = dataclasses.replace(previous, online=False)
            self._reports[site] = report
            self._changed.notify_all()
        self._lead()
        return None

    def on_view(self, message: Mapping[str, Any]) -> str | None:
        newcomers = message.get("newcomers")
        if isinstance(newcomers, Mapping):
            for name, description in newcomers.items():
                if isinstance(name, str) and name not in self.sites:
                    problem = self._take_in(name, description)
                    if problem:
                        return problem
        view = View.from_message(message, self.sites)
        if isinstance(view, str):
            return view
        with self._changed:
            if view.epoch < self.latest.epoch or (
                view.epoch == self.latest.epoch and view != self.latest
            ):
                # A replay of an older view, or another view under the number in
                # force: never applied (the epoch orders views), and counted.
                self.stale_views += 1
                return (
                    f"view {view.epoch} ({view.reason}) is not the view in force, "
                    f"{self.latest.epoch}: a replay, or a leader out of date; not applied"
                )
            if view.epoch == self.latest.epoch:
                return None  # the view in force, again (a retained message, a reconnect)
            self.latest = view
            self._changed.notify_all()
        log.warning(
            "site %s: view %d from round %d: members %s%s (%s)",
            self.me,
            view.epoch,
            view.start_round,
            list(view.members),
            f", {list(view.catch_up)} catch up from {view.donor}" if view.catch_up else "",
            view.reason,
        )
        self._lead()
        return None

    def _take_in(self, site: str, description: Any) -> str | None:
        """Make a site the job file does not name one of the sites; say why not (once
        per site: a refused one keeps sending its status)."""
        if site in self._refused:
            return None
        problem = (
            f"site {site!r} is not in the job file, and this site takes in no new sites"
            if self.take_in is None
            else self.take_in(site, description)
        )
        if problem:
            self._refused.add(site)
            log.warning("site %s: not taking in site %r: %s", self.me, site, problem)
            return problem
        with self._changed:
            self._newcomers[site] = description
            # Job order, then the newcomers by name: the same on every site.
            self.sites = self._job_sites + sorted(self._newcomers)
            self._changed.notify_all()
        log.info("site %s: site %r is not in the job file; taken in", self.me, site)
        return None

    def _lead(self) -> None:
        if self.publish_view is None:
            return
        with self._changed:
            reports = dict(self._reports)
            reports[self.me] = self._my_report()
            current = self.latest
            if (
                self._proposed is not None
                and self._proposed.epoch > current.epoch
                and time.monotonic() - self._proposed_at < PROPOSAL_WAIT_S
            ):
                return  # ours is on its way: decide again once it is back
            if leader_of(self.sites, reports, current) != self.me:
                return
            view = consider(self.sites, reports, current, self.min_sites)
            if not isinstance(view, View):
                if view is not None and view != self._held:
                    log.info("site %s leads: view %d stands: %s", self.me, current.epoch, view)
                self._held = view
                return
            self._held = None
            if self._hold_back(view, current, reports):
                return
            newcomers = {m: self._newcomers[m] for m in view.members if m in self._newcomers}
            view = dataclasses.replace(view, leader=self.me, newcomers=newcomers)
            self._proposed = view
            self._proposed_at = time.monotonic()
        log.info("site %s leads: publishing view %d (%s)", self.me, view.epoch, view.reason)
        self.publish_view(view)

    def _hold_back(self, view: View, current: View, reports: Mapping[str, Report | None]) -> bool:
        """(Lock held.) Whether the leader waits before publishing ``view``: it only runs
        the round again with the same members while members that could name a
        culprit are still in the round (see the module's docstring). Schedules a
        decision for when the wait is over."""
        if view.members != current.members or view.catch_up or self.stuck_settle_s <= 0:
            return False
        stuck = stuck_in(current, reports)
        if not stuck:
            return False
        failed_round = max(reports[m].rounds for m in stuck)  # type: ignore[union-attr]
        in_round = [
            m
            for m in current.members
            if m not in stuck
            and (r := reports.get(m)) is not None
            and r.online
            and r.phase == "training"
            and r.epoch == current.epoch
            and r.rounds <= failed_round
        ]
        if not in_round:
            return False
        now = time.monotonic()
        if self._stuck_since is None or self._stuck_since[0] != current.epoch:
            self._stuck_since = (current.epoch, now)
            log.info(
                "site %s leads: %s stuck in round %d but %s still in it; waiting up to %g s "
                "for their reports before running it again",
                self.me,
                stuck,
                failed_round,
                in_round,
                self.stuck_settle_s,
            )
        remaining = self._stuck_since[1] + self.stuck_settle_s - now
        if remaining <= 0:
            return False
        if self._settle_timer is None or not self._settle_timer.is_alive():
            self._settle_timer = threading.Timer(remaining, self._lead)
            self._settle_timer.daemon = True
            self._settle_timer.start()
        return True

    # -- what the training thread reports ------------------------------------------
    def _my_report(self) -> Report:
        mine = self._mine
        return Report(
            phase=mine.phase,
            epoch=self.applied.epoch,
            rounds=mine.rounds,
            engine_round=mine.engine_round,
            unreachable=mine.unreachable,
            conflict=mine.conflict,
        )

    def report_message(self) -> dict[str, Any]:
        """This site's report as its status carries it."""
        with self._changed:
            return self._my_report().to_message()

    def report(self, **fields: Any) -> None:
        """Update this site's report (phase, rounds, engine_round, unreachable,
        conflict) and send it."""
        with self._changed:
            for key, value in fields.items():
                setattr(self._mine, key, tuple(value) if key == "unreachable" else value)
            message = self._my_report().to_message()
        self.publish_report(message)
        self._lead()

    # -- what the training thread asks ---------------------------------------------
    def newer_view(self, rounds: int) -> View | None:
        """The newest view if the round this site is running (after ``rounds``
        completed) must be abandoned for it: it starts at or before this round, or
        makes this site catch up or leaves it out. :meth:`view_for` applies a view
        by the same rule."""
        latest = self.latest
        if latest.epoch <= self.applied.epoch:
            return None
        if latest.start_round <= rounds:
            return latest
        if self.me in latest.catch_up:
            return latest  # it pulls the state after a later round: this one is moot
        if self.me not in latest.members and self._mine.phase != "leaving":
            return latest  # left out: the others will not finish this round with it
        return None

    def view_for(self, rounds: int, timeout_s: float, on_wait: Callable[[str], None]) -> View:
        """The view that round ``rounds`` (counted from 0) runs under, applied: waits
        while this site is left out or the members are below quorum (calling
        ``on_wait`` with why, now and then). Raises :class:`MembershipError` if no
        usable view comes within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        said = ""
        next_probe = 0.0
        with self._changed:
            while True:
                latest = self.latest
                # The rule that abandons a round is the rule that applies a view: a
                # view that leaves this site out or makes it catch up holds for it at
                # once, whatever round it starts at (a site behind it would otherwise
                # wait under an older view that names it, which the others have left).
                if self.newer_view(rounds) is not None:
                    self.applied = latest
                    self.history.append(latest)
                    if self._mine.phase == "stuck":
                        # This view answers it: stuck in it would ask for yet another.
                        self._mine.phase = "training"
                        self._send_report()
                    if self.me in latest.catch_up and self._mine.phase == "joining":
                        # Let in: no longer asking (a site still saying "joining" when a
                        # later view does not name it restarted unnoticed).
                        self._admitted = True
                        self._mine.phase = "training"
                        self._mine.unreachable = ()
                        self._send_report()
                    if self.me not in latest.members and self._mine.phase != "leaving":
                        # Left out while alive (cut off): ask to be let back in, which
                        # takes the state of those that went on.
                        self._admitted = False
                        self._mine.phase = "joining"
                        self._send_report()
                view = self.applied
                why = self._why_waiting(view)
                if not why:
                    return view
                if not self._admitted and time.monotonic() >= next_probe:
                    next_probe = time.monotonic() + PROBE_EVERY_S
                    self._probe_members(latest)
                if self._members_gone(latest):
                    raise RunOver(
                        f"site {self.me}: every other site is done training (view "
                        f"{latest.epoch}) while this site was {why}"
                    )
                if why != said:
                    said = why
                    self._changed.release()
                    try:
                        on_wait(why)
                    finally:
                        self._changed.acquire()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise MembershipError(
                        f"site {self.me}: {why}; still so after {timeout_s:g} s "
                        "(train.rejoin_timeout_s): giving up"
                    )
                self._changed.wait(min(remaining, 1.0))

    def _probe_members(self, view: View) -> None:
        """(Lock held.) Say which members this waiting site cannot reach: the leader
        lets it in only once it and the members reach each other."""
        if self.probe is None:
            return
        others = [m for m in view.members if m != self.me]
        self._changed.release()
        try:
            unreachable = self.probe(others)
        finally:
            self._changed.acquire()
        if tuple(unreachable) != self._mine.unreachable:
            self._mine.unreachable = tuple(unreachable)
            self._send_report()

    def _send_report(self) -> None:
        """(Lock held.) Send this site's report as it stands."""
        message = self._my_report().to_message()
        self._changed.release()
        try:
            self.publish_report(message)
        finally:
            self._changed.acquire()

    def others_done(self) -> bool:
        """Whether every other site of the job is done training (so nothing this site
        waits for from them will come)."""
        with self._changed:
            return self._members_gone(self.latest)

    def _members_gone(self, view: View) -> bool:
        """Whether every other site of the job is done training (a site that died may
        come back; one that is done will not)."""
        reports = self._reports
        return all(
            (r := reports.get(m)) is not None and r.phase == "done"
            for m in self.sites
            if m != self.me
        )

    def _why_waiting(self, view: View) -> str:
        if self.me not in view.members and self._mine.phase == "leaving":
            raise LeftTheRun(f"site {self.me} left the run at round {view.start_round}")
        if not self._admitted:
            return f"joining: waiting for the leader to let this site in (view {view.epoch} holds)"
        if self.me not in view.members:
            return (
                f"left out of view {view.epoch} ({view.reason}); waiting to be let back in "
                "(the leader admits a site once it and the members reach each other)"
            )
        if len(view.members) < self.min_sites:
            return (
                f"view {view.epoch} has {len(view.members)} of the {self.min_sites} sites the "
                f"quorum needs (train.min_sites); training paused until more sites are back"
            )
        return ""

    def wait_for_newer(self, epoch: int, timeout_s: float) -> View | None:
        """Block until a view newer than ``epoch`` is published (None on timeout)."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while self.latest.epoch <= epoch:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._changed.wait(remaining)
            return self.latest
