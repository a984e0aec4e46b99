"""The leader's decision as a pure function, over every small case.

Every combination of member states (training, a round behind, stuck, joining,
leaving, done, offline, silent, ahead of the view) for 2-4 sites, under three
current views (everyone, one site left out, one site catching up), with and
without a cut pair and at both ends of the quorum: whatever :func:`decide`
returns must be a view every site accepts, name a donor that holds the state for
everyone it makes catch up, and leave every member with a defined next step.
"""

from __future__ import annotations

import itertools

import pytest

from isthmus.inter.membership import Report, View, consider, decide, first_view

R = 10
"""The round the members are at."""

STATES = (
    "training",
    "behind",
    "stuck",
    "joining",
    "leaving",
    "done",
    "offline",
    "silent",
    "ahead",
)


def current_views(sites: list[str]) -> dict[str, View]:
    *rest, last = sites
    return {
        "everyone": first_view(sites),
        "left-out": View(
            epoch=2, members=tuple(rest), start_round=R - 3, engine_round=20, reason="left out"
        ),
        "catching-up": View(
            epoch=2,
            members=tuple(sites),
            start_round=R - 1,
            engine_round=20,
            catch_up=(last,),
            donor=sites[0],
            reason="joining",
        ),
    }


def report_for(state: str, current: View, unreachable: tuple[str, ...]) -> Report | None:
    epoch = current.epoch
    if state == "silent":
        return None
    if state == "offline":
        return Report(online=False)
    if state == "joining":
        # A fresh process: no rounds, no state, no view applied yet.
        return Report(phase="joining", epoch=0, rounds=0, engine_round=0, unreachable=unreachable)
    rounds = {"behind": R - 1, "ahead": R + 1}.get(state, R)
    return Report(
        phase={"behind": "training", "ahead": "training"}.get(state, state),
        epoch=epoch,
        rounds=rounds,
        engine_round=30,
        unreachable=unreachable,
        conflict=epoch if state == "ahead" else None,
    )


def cases():
    for n in (2, 3, 4):
        sites = "abcd"[:n]
        for (_view, current), cut, quorum, states in itertools.product(
            current_views(list(sites)).items(),
            (False, True),
            (1, n),
            itertools.product(STATES, repeat=n),
        ):
            reports = {}
            for site, state in zip(sites, states, strict=True):
                # The cut pair: the first site cannot reach the last one.
                unreachable = (sites[-1],) if cut and site == sites[0] else ()
                reports[site] = report_for(state, current, unreachable)
            yield list(sites), current, reports, quorum, dict(zip(sites, states, strict=True))


def live(report: Report | None, site: str, current: View) -> bool:
    if report is None:
        return site in current.members
    return report.online and report.phase not in ("leaving", "done")


def check_view(view: View, sites, current: View, reports, states) -> None:
    def rounds(site: str) -> int:
        r = reports[site]
        return r.rounds if r is not None else 0

    # Every site accepts it as published (the message, not the object, travels).
    assert View.from_message(view.to_message(), sites) == view
    assert view.epoch == current.epoch + 1
    assert view.members, "a view of nobody"
    engines = [r.engine_round for r in reports.values() if r is not None]
    assert view.engine_round > max([*engines, current.engine_round])
    for m in view.members:
        assert live(reports[m], m, current), f"{m} ({states[m]}) is not live"
    # The donor holds the state everyone it names needs.
    if view.catch_up:
        donor = view.donor
        assert donor in view.members and donor not in view.catch_up
        assert states[donor] != "joining", "a fresh site cannot give the state"
        assert rounds(donor) <= view.start_round
    else:
        assert view.donor is None
    # Members that do not catch up run from their own state to the start round.
    for m in view.members:
        if m in view.catch_up:
            continue
        assert states[m] != "joining", f"{m} starts from scratch but is not told to catch up"
        if states[m] == "silent":
            continue  # not heard from yet: counted as at the round the view starts from
        assert rounds(m) <= view.start_round, (m, states[m], view)
    # Every current member has a next step: in the view, or gone, or left out
    # because of a cut (it then asks to be let back in).
    cut = {(s, u) for s in sites if reports[s] is not None for u in reports[s].unreachable}
    for m in current.members:
        if m in view.members or not live(reports[m], m, current):
            continue
        assert any((m, o) in cut or (o, m) in cut for o in view.members), (
            f"{m} ({states[m]}) was left out though it reaches every member"
        )


def check_standing(outcome: str | None, sites, current: View, reports, states) -> None:
    """The current view stands: only where that cannot leave the members hanging."""
    members_live = [m for m in current.members if live(reports[m], m, current)]
    healthy = [m for m in members_live if states[m] in ("training", "behind", "stuck", "ahead")]
    if not healthy or any(states[m] == "joining" for m in current.members):
        return  # nobody holds the state to go on with, or a restart to sort out first
    if not any(reports[s] is not None and reports[s].unreachable for s in sites):
        lost = [m for m in current.members if states[m] == "offline"]
        stuck = [m for m in current.members if states[m] == "stuck"]
        assert not lost, f"{lost} went offline but the view stands ({outcome})"
        assert not stuck, f"{stuck} are stuck but the view stands ({outcome})"
    if isinstance(outcome, str):
        assert any(repr(s) in outcome for s in sites), f"a hold that names nobody: {outcome}"


@pytest.mark.parametrize("n", [2, 3, 4])
def test_every_view_decided_is_accepted_names_a_donor_and_defines_every_member_s_next_step(n):
    seen = {"views": 0, "holds": 0, "stands": 0}
    for sites, current, reports, quorum, states in cases():
        if len(sites) != n:
            continue
        outcome = consider(sites, reports, current, quorum)
        assert decide(sites, reports, current, quorum) == (
            outcome if isinstance(outcome, View) else None
        )
        if isinstance(outcome, View):
            seen["views"] += 1
            check_view(outcome, sites, current, reports, states)
        else:
            seen["holds" if outcome else "stands"] += 1
            check_standing(outcome, sites, current, reports, states)
    assert all(seen.values()), seen  # each kind of outcome was exercised


def test_a_joiner_is_not_let_in_once_the_others_are_done_training():
    """The view that once named no donor: c was left out, and by the time it asked
    to join, a and b were done; a view of c alone would have had nobody to give it
    the state (and every receiver refused it)."""
    sites = ["a", "b", "c"]
    current = View(epoch=1, members=("a", "b"), start_round=39, engine_round=400)
    reports = {
        "a": Report(phase="done", epoch=1, rounds=60, engine_round=460),
        "b": Report(phase="done", epoch=1, rounds=60, engine_round=460),
        "c": Report(phase="joining", rounds=0),
    }
    outcome = consider(sites, reports, current)
    assert outcome == "['c'] ask to join, but the other sites are done training"
    assert decide(sites, reports, current) is None


def test_when_every_member_restarted_the_joiners_wait_for_one_that_holds_the_state():
    sites = ["a", "b"]
    current = View(epoch=3, members=("a", "b"), start_round=12, engine_round=90)
    reports = {"a": Report(phase="joining"), "b": Report(phase="joining")}
    outcome = consider(sites, reports, current)
    assert isinstance(outcome, str) and "no member holds the run's state" in outcome
    # One comes back with its state (a member that was only cut off): it gives it.
    reports["a"] = Report(phase="training", epoch=3, rounds=12, engine_round=90)
    view = consider(sites, reports, current)
    assert isinstance(view, View)
    assert (view.members, view.catch_up, view.donor) == (("a", "b"), ("b",), "a")
