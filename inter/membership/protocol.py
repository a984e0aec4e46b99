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

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

PHASES = ("training", "stuck", "joining", "leaving", "done")
ENGINE_MARGIN = 8
"""A new view's engine rounds start this far above any engine round reported: chunks
of abandoned rounds can never be taken for the new ones."""


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
    give the same view on any site (only the leader publishes it). See
    :func:`consider` for why the current view may stand although a site asks for a
    change."""
    outcome = consider(sites, reports, current, min_sites)
    return outcome if isinstance(outcome, View) else None


def consider(
    sites: Sequence[str],
    reports: Mapping[str, Report | None],
    current: View,
    min_sites: int = 1,
) -> View | str | None:
    """The next view; None when nothing asks for one; or, when a site asks for a
    change that cannot be made yet, why the current view stands (a *hold*).

    The current view stands unless a member went offline, got stuck in a round
    of this view, asks to leave, could not apply it (``conflict``), or a site
    asks to join. ``min_sites``: the quorum; below it the members wait at the
    round they are in, so a joiner comes in at that round.

    Every view returned names a donor for its ``catch_up``: a member that does not
    catch up itself and completes exactly ``start_round`` rounds. A joining site
    holds no state of the run (it starts from scratch), so when only joining sites
    are left to be members, nobody could give them the state, and the view
    stands: the joiners wait, until a member comes back, the others are done
    (each joiner then learns so and stops), or ``train.rejoin_timeout_s``."""

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
    staying = [m for m in members if m not in joining]
    # Who holds the run's state: a staying member that still says it is joining is
    # one the current view let in, still pulling the state it was given.
    holders = [m for m in staying if report(m).phase != "joining"]
    if not holders:
        # Only sites that start from scratch are left: none of them can give the
        # others the run's state, and a view of them alone would start the run over
        # in some sites while the finished ones keep theirs.
        waiting = joining + [m for m in staying if m not in joining]
        if finished:
            return f"{waiting} ask to join, but the other sites are done training"
        return (
            f"{waiting} ask to join, but no member holds the run's state to give them; "
            "they wait for a member to come back"
        )
    rounds = {m: report(m).rounds for m in members}
    # Its old self was in the round under way and will never finish it.
    restarted = [m for m in joining if m in current.members]
    if lost or restarted or stuck or conflicts or len(current.members) < min_sites:
        # The round under way cannot finish as it is: everyone runs it again with
        # the new members, from the furthest any member got.
        start = max(rounds[m] for m in holders)
        behind = [m for m in staying if rounds[m] < start or m not in holders]
    else:
        pulling = [m for m in staying if m in current.catch_up and rounds[m] < current.start_round]
        if pulling:
            # A member is still pulling the state the current view gave it. A view
            # decided now would not name it (it is not stuck, only behind), so it
            # would stay under the view before, whose round the others have left,
            # until its deadline. Let it catch up first; its report decides again.
            return f"{pulling} still catch up under view {current.epoch}; the next view waits"
        # Only joiners and leavers: the members finish the round under way (the
        # leavers with them), the joiners come in at the next.
        start = max([rounds[m] for m in holders] + [report(m).rounds for m in leaving]) + 1
        behind = []
    catch_up = tuple(m for m in members if m in joining or m in behind)
    # The furthest holder is never behind, so a donor always exists here.
    donor = next(m for m in holders if m not in catch_up) if catch_up else None
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
