"""Who takes part in the rounds: views, the leader's decision, and the reports that feed it.

A *view* is the set of member sites and the round from which it holds. Every
round runs among the members of one view, so sites that apply the same view
at the same round can never disagree on who counted. Views are numbered
(``epoch``); the first, epoch 0, is every site of the job from round 0 on.

How a view changes:

* every site reports itself in its control-plane status: its phase
  (``training``, ``stuck`` after a round failed, ``joining``, ``leaving``,
  ``done`` once its training is over), how
  many rounds it completed, the engine round it is at, and which sites it could
  not reach; a site that dies is reported by its Last Will (``offline``);
* the *leader*, the first live site in the job file's order, decides the next
  view from those reports (:func:`decide`) and publishes it, retained, on the
  control plane's membership topic; the broker's one ordered topic makes it
  the sequence every site follows;
* every site applies a view when it starts the view's ``start_round``: a site
  still running an earlier round under the old view abandons it and runs it
  again under the new one (the survivors' redo after a loss); a site named in
  ``catch_up`` (a joiner, or a survivor that fell a round behind) first pulls
  the global state after ``start_round`` rounds from ``donor`` over gRPC.

The rule for a partial partition, stated once: sites are taken in the job
file's order, and a site joins the view only if it and every site already in
it can reach each other (by their reports). So of two sites that cannot reach
each other, the later one is left out, by everyone alike.

Below ``min_sites`` members, the view is still published, and sites wait at
its start round, saying why, until enough sites are back (the quorum).

A member stuck in a round names only the members it cannot reach itself; when
the fault lies between two others (a reaches b and c, b and c cannot reach each
other), its report alone would give a view with the same members, and the round
would fail again under it. So before the leader publishes a view that changes
nothing but the round's numbers, it waits for the members still in that round
to report too (each fails it by its own deadline, or completes it), for at most
``stuck_settle_s`` (the round deadline): the later of a cut pair is then left
out in one view, whichever member's round failed first.

Liveness hints only feed the decision: nothing but a published view changes
who takes part in a round.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

log = logging.getLogger(__name__)

PHASES = ("training", "stuck", "joining", "leaving", "done")
PROBE_EVERY_S = 2.0
"""How often a site waiting to be let in checks which members it can reach."""
ENGINE_MARGIN = 8
"""A new view's engine rounds start this far above any engine round reported: chunks
of abandoned rounds can never be taken for the new ones."""
PROPOSAL_WAIT_S = 5.0
"""How long the leader waits for its published view to come back from the broker
before it decides (and publishes) again: a publish can be lost with the connection."""


class MembershipError(RuntimeError):
    """This site cannot go on as a member (no usable view came, or the others stopped)."""


class LeftTheRun(Exception):
    """This site asked to leave and the view that lets it go has come: stop training."""


@dataclass(frozen=True)
class View:
    epoch: int
    members: tuple[str, ...]
    """In the job file's order."""
    start_round: int
    """The first round (counted from 0) this view holds for."""
    engine_round: int
    """The engine round number the view's first round uses (then counting up)."""
    catch_up: tuple[str, ...] = ()
    """Members that must pull the global state after ``start_round`` rounds first."""
    donor: str | None = None
    """The member they pull it from (one that completed exactly ``start_round``)."""
    reason: str = ""
    leader: str | None = None
    newcomers: Mapping[str, Any] = field(default_factory=dict)
    """Members that are not in the job file: name -> how the site describes itself
    (see :mod:`isthmus.inter.newcomers`), for sites that have not heard of it yet."""

    def to_message(self) -> dict[str, Any]:
        message = asdict(self)
        message["members"] = list(self.members)
        message["catch_up"] = list(self.catch_up)
        message["newcomers"] = dict(self.newcomers)
        return message

    @classmethod
    def from_message(cls, message: Mapping[str, Any], sites: Sequence[str]) -> View | str:
        """The view in ``message``, or why it is not one of this job's."""

        def count(key: str) -> int | str:
            value = message.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                return value
            return f"{key!r} must be an integer >= 0, got {value!r}"

        numbers = {k: count(k) for k in ("epoch", "start_round", "engine_round")}
        for problem in numbers.values():
            if isinstance(problem, str):
                return problem
        lists = {}
        for key in ("members", "catch_up"):
            value = message.get(key, [])
            if not (isinstance(value, list) and all(v in sites for v in value)):
                return f"{key!r} must be a list of the job's sites {list(sites)}, got {value!r}"
            lists[key] = tuple(s for s in sites if s in value)
        if not lists["members"]:
            return "'members' is empty"
        if not set(lists["catch_up"]) <= set(lists["members"]):
            return "'catch_up' names sites that are not members"
        donor = message.get("donor")
        if lists["catch_up"] and donor not in lists["members"]:
            return f"'donor' must be a member when some catch up, got {donor!r}"
        newcomers = message.get("newcomers") or {}
        if not (isinstance(newcomers, Mapping) and set(newcomers) <= set(lists["members"])):
            return f"'newcomers' must map members to their descriptions, got {newcomers!r}"
        return cls(
            epoch=numbers["epoch"],  # type: ignore[arg-type]
            members=lists["members"],
            start_round=numbers["start_round"],  # type: ignore[arg-type]
            engine_round=numbers["engine_round"],  # type: ignore[arg-type]
            catch_up=lists["catch_up"],
            donor=donor if isinstance(donor, str) else None,
            reason=str(message.get("reason", "")),
            leader=message.get("leader") if isinstance(message.get("leader"), str) else None,
            newcomers=dict(newcomers),
        )


def first_view(sites: Sequence[str]) -> View:
    return View(epoch=0, members=tuple(sites), start_round=0, engine_round=0, reason="start")


@dataclass(frozen=True)
class Report:
    """What a site says of itself (its status's ``membership`` object)."""

    online: bool = True
    phase: str = "training"
    epoch: int = 0
    """The newest view it applied."""
    rounds: int = 0
    """Rounds it completed."""
    engine_round: int = 0
    """The next engine round number it would use."""
    unreachable: tuple[str, ...] = ()
    conflict: int | None = None
    """The epoch of a view it could not apply: it had completed more rounds than the
    view's start."""

    def to_message(self) -> dict[str, Any]:
        message = asdict(self)
        del message["online"]  # the status's own state says that
        message["unreachable"] = list(self.unreachable)
        return message

    @classmethod
    def from_status(cls, status: Mapping[str, Any], sites: Sequence[str]) -> Report | str | None:
        """The report in a status message: None when it carries none (a site that
        has not joined yet), a string when it is malformed."""
        online = status.get("state") == "online"
        body = status.get("membership")
        if body is None:
            return None if online else cls(online=False)
        if not isinstance(body, Mapping):
            return f"'membership' must be an object, got {body!r}"
        phase = body.get("phase")
        if phase not in PHASES:
            return f"'membership.phase' must be one of {PHASES}, got {phase!r}"
        numbers = {}
        for key in ("epoch", "rounds", "engine_round"):
            value = body.get(key)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
                return f"'membership.{key}' must be an integer >= 0, got {value!r}"
            numbers[key] = value
        unreachable = body.get("unreachable", [])
        if not (isinstance(unreachable, list) and all(isinstance(s, str) for s in unreachable)):
            return f"'membership.unreachable' must be a list of site names, got {unreachable!r}"
        conflict = body.get("conflict")
        if conflict is not None and not (isinstance(conflict, int) and conflict >= 0):
            return f"'membership.conflict' must be an epoch or null, got {conflict!r}"
        return cls(
            online=online,
            phase=phase,
            unreachable=tuple(s for s in unreachable if s in sites),
            conflict=conflict,
            **numbers,
        )


def leader_of(sites: Sequence[str], reports: Mapping[str, Report | None], current: View) -> str:
    """The first live site in the job's order. A member not heard from yet counts
    as live (it may still be starting); a site whose status is offline does not."""
    for site in sites:
        if _live(site, reports, current):
            return site
    return current.members[0]


def _live(site: str, reports: Mapping[str, Report | None], current: View) -> bool:
    report = reports.get(site)
    if report is None:
        return site in current.members
    return report.online and report.phase not in ("leaving", "done")


def stuck_in(current: View, reports: Mapping[str, Report | None]) -> list[str]:
    """The members whose round under ``current`` failed (they ask for a new view)."""
    return [
        m
        for m in current.members
        if (r := reports.get(m)) is not None and r.phase == "stuck" and r.epoch == current.epoch
    ]


def decide(
    sites: Sequence[str],
    reports: Mapping[str, Report | None],
    current: View,
    min_sites: int = 1,
) -> View | None:
    """The next view, or None while the current one stands. Pure: the same reports
    give the same view on any site (only the leader publishes it).

    The current view stands unless a member went offline, got stuck in a round
    of this view, asks to leave, could not apply it (``conflict``), or a site
    asks to join. ``min_sites``: the quorum; below it the members wait at the
    round they are in, so a joiner comes in at that round."""

    def report(site: str) -> Report:
        return reports.get(site) or Report()

    def unreachable(site: str) -> tuple[str, ...]:
        return report(site).unreachable

    live = [s for s in sites if _live(s, reports, current)]
    candidates = [s for s in live if s in current.members or report(s).phase == "joining"]
    members: list[str] = []
    for site in candidates:
        if any(site in unreachable(m) or m in unreachable(site) for m in members):
            continue
        members.append(site)
    stuck = [m for m in stuck_in(current, reports) if m in members]
    conflicts = [m for m in members if report(m).conflict == current.epoch]
    # A member that asks to leave takes part in the round under way and is left
    # out from the next; one that is done training has left already.
    leaving = [
        m
        for m in current.members
        if m not in members
        and (r := reports.get(m)) is not None
        and r.online
        and r.phase == "leaving"
    ]
    # A member that finished its training ends with the others: no new view for it.
    finished = [m for m in current.members if m not in members and report(m).phase == "done"]
    lost = [m for m in current.members if m not in members + leaving + finished]
    # A member that says it is joining restarted before anyone noticed it was gone:
    # it has lost its state, and must catch up like any joiner.
    joining = [
        m
        for m in members
        if m not in current.members or (report(m).phase == "joining" and m not in current.catch_up)
    ]
    if not (lost or leaving or joining or stuck or conflicts):
        return None
    staying = [m for m in members if m not in joining] or members
    if not members:
        return None
    rounds = {m: report(m).rounds for m in members}
    # Its old self was in the round under way and will never finish it.
    restarted = [m for m in joining if m in current.members]
    if lost or restarted or stuck or conflicts or len(current.members) < min_sites:
        # The round under way cannot finish as it is: everyone runs it again with
        # the new members, from the furthest any member got.
        start = max(rounds[m] for m in staying)
        behind = [m for m in staying if rounds[m] < start]
    else:
        if any(m in current.catch_up and rounds[m] < current.start_round for m in staying):
            # A member is still pulling the state the current view gave it. A view
            # decided now would not name it (it is not stuck, only behind), so it
            # would stay under the view before, whose round the others have left,
            # until its deadline. Let it catch up first; its report decides again.
            return None
        # Only joiners and leavers: the members finish the round under way (the
        # leavers with them), the joiners come in at the next.
        start = max([rounds[m] for m in staying] + [report(m).rounds for m in leaving]) + 1
        behind = []
    catch_up = tuple(m for m in members if m in joining or m in behind)
    donor = next((m for m in staying if m not in catch_up), None) if catch_up else None
    engine = max((r.engine_round for r in reports.values() if r is not None), default=0)
    why = []
    if lost:
        why.append(f"left out {lost}")
    if restarted:
        why.append(f"restarted {restarted}")
    if joining:
        why.append(f"joining {joining}")
    if leaving:
        why.append(f"leaving {leaving}")
    if stuck:
        why.append(f"stuck {stuck}")
    if conflicts:
        why.append(f"ahead of the last view {conflicts}")
    return View(
        epoch=current.epoch + 1,
        members=tuple(members),
        start_round=start,
        engine_round=max(engine, current.engine_round) + ENGINE_MARGIN,
        catch_up=catch_up,
        donor=donor,
        reason="; ".join(why),
    )


@dataclass
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
            if view.epoch <= self.latest.epoch:
                return None
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
            view = decide(self.sites, reports, current, self.min_sites)
            if view is None:
                return
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
                    raise MembershipError(
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
