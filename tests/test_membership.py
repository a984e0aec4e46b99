"""The membership protocol's pieces: the leader's decision, the messages, the
views a site waits for, and the state transfer over a real gRPC server."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from isthmus.inter import newcomers
from isthmus.inter.membership import (
    ENGINE_MARGIN,
    LeftTheRun,
    Membership,
    MembershipError,
    Report,
    View,
    decide,
    first_view,
    leader_of,
)
from isthmus.inter.peer import Identity, PeerServer
from isthmus.inter.peer_client import PeerClient
from isthmus.inter.state_transfer import (
    StateGone,
    StateUnavailable,
    fetch_state,
    pack_state,
)
from isthmus.proto import wire_pb2

SITES = ["a", "b", "c"]


def training(rounds: int, engine: int = 10, **fields) -> Report:
    return Report(phase="training", rounds=rounds, engine_round=engine, **fields)


def test_a_dead_site_is_left_out_and_the_round_under_way_is_run_again():
    reports = {"a": training(7), "b": training(7), "c": Report(online=False)}
    view = decide(SITES, reports, first_view(SITES))
    assert view is not None
    assert view.members == ("a", "b")
    assert view.start_round == 7  # the round they were in, again
    assert view.catch_up == ()
    assert view.engine_round == 10 + ENGINE_MARGIN
    assert view.epoch == 1


def test_a_survivor_a_round_behind_catches_up_from_one_that_finished_it():
    reports = {"a": training(8), "b": training(7), "c": Report(online=False)}
    view = decide(SITES, reports, first_view(SITES))
    assert view is not None
    assert (view.start_round, view.catch_up, view.donor) == (8, ("b",), "a")


def test_a_partial_partition_leaves_out_the_later_site_of_the_pair_for_everyone():
    reports = {
        "a": Report(phase="stuck", rounds=3, unreachable=("c",)),
        "b": training(3),
        "c": Report(phase="stuck", rounds=3, unreachable=("a",)),
    }
    view = decide(SITES, reports, first_view(SITES))
    assert view is not None
    assert view.members == ("a", "b")
    # The same reports give the same view wherever it is decided.
    assert decide(SITES, dict(reversed(reports.items())), first_view(SITES)) == view


def test_a_joining_site_comes_in_at_the_next_round_and_pulls_the_state_first():
    current = View(epoch=1, members=("a", "b"), start_round=4, engine_round=30)
    reports = {"a": training(6, 40), "b": training(6, 40), "c": Report(phase="joining")}
    view = decide(SITES, reports, current)
    assert view is not None
    assert view.members == ("a", "b", "c")
    assert view.start_round == 7  # the members finish round 6 without it
    assert (view.catch_up, view.donor) == (("c",), "a")


def test_a_joiner_waits_while_a_member_still_catches_up_from_the_last_view():
    # Async: b completed round 3 while a's exchange of it failed, so the view from
    # round 4 has a catch up from b. A joiner's view decided before a got there
    # would not name a, which would stay in round 3 until its deadline.
    current = View(
        epoch=2, members=("a", "b"), start_round=4, engine_round=30, catch_up=("a",), donor="b"
    )
    reports = {"a": training(3, 30), "b": training(4, 30), "c": Report(phase="joining")}
    assert decide(SITES, reports, current) is None
    reports["a"] = training(4, 30)  # caught up
    view = decide(SITES, reports, current)
    assert view is not None
    assert (view.members, view.start_round, view.catch_up) == (("a", "b", "c"), 5, ("c",))


def test_a_view_that_makes_this_site_catch_up_abandons_the_round_under_way():
    a = Membership(SITES, "a", min_sites=2)
    a.on_view(View(epoch=1, members=("a", "b"), start_round=3, engine_round=20).to_message())
    assert a.view_for(3, timeout_s=1, on_wait=lambda why: None).epoch == 1
    behind = View(
        epoch=2, members=("a", "b"), start_round=4, engine_round=30, catch_up=("a",), donor="b"
    )
    a.on_view(behind.to_message())
    assert a.newer_view(3) == behind  # round 3 is moot: a pulls the state after 4
    assert a.view_for(3, timeout_s=1, on_wait=lambda why: None) == behind


def test_a_member_restarted_before_anyone_noticed_makes_the_round_under_way_run_again():
    # b died in round 7 and is back, joining, before the leader left it out: the
    # round under way waits on b's old self, so it is run again, with b caught up.
    reports = {"a": training(7), "b": Report(phase="joining", rounds=0), "c": training(7)}
    view = decide(SITES, reports, first_view(SITES))
    assert view is not None
    assert view.members == ("a", "b", "c")
    assert (view.start_round, view.catch_up, view.donor) == (7, ("b",), "a")
    assert "restarted ['b']" in view.reason


def test_below_quorum_a_joiner_comes_in_at_the_round_the_members_wait_in():
    current = View(epoch=1, members=("a",), start_round=4, engine_round=30)
    reports = {"a": training(4, 31), "b": Report(phase="joining")}
    view = decide(["a", "b"], reports, current, min_sites=2)
    assert view is not None
    assert (view.start_round, view.catch_up, view.donor) == (4, ("b",), "a")


def test_a_leaving_member_finishes_the_round_under_way_and_is_left_out_after():
    reports = {"a": training(6, 40), "b": training(6, 40), "c": Report(phase="leaving", rounds=6)}
    view = decide(SITES, reports, first_view(SITES))
    assert view is not None
    assert view.members == ("a", "b")
    assert view.start_round == 7  # nobody runs round 6 again
    assert "leaving ['c']" in view.reason


def test_a_leaving_site_stops_when_the_view_without_it_begins():
    c = Membership(SITES, "c", min_sites=2)
    c.report(phase="leaving", rounds=6)
    c.on_view(View(epoch=1, members=("a", "b"), start_round=7, engine_round=50).to_message())
    assert c.newer_view(6) is None  # the round under way goes on with it
    with pytest.raises(LeftTheRun):
        c.view_for(7, timeout_s=1, on_wait=print)


def test_a_stuck_member_without_a_culprit_restarts_the_round_with_new_numbers():
    reports = {"a": Report(phase="stuck", rounds=2, engine_round=9), "b": training(2, 9)}
    current = first_view(["a", "b"])
    view = decide(["a", "b"], reports, current)
    assert view is not None
    assert view.members == ("a", "b")
    assert view.start_round == 2
    assert view.engine_round == 9 + ENGINE_MARGIN


def test_nothing_changes_while_every_member_trains():
    reports = {s: training(5) for s in SITES}
    assert decide(SITES, reports, first_view(SITES)) is None
    # A member not heard from yet is not taken for dead.
    assert decide(SITES, {"a": training(5)}, first_view(SITES)) is None


def test_a_member_that_finished_training_needs_no_new_view():
    done = Report(phase="done", rounds=8, engine_round=10)
    reports = {"a": training(7), "b": done, "c": Report(phase="done", online=False, rounds=8)}
    assert decide(SITES, reports, first_view(SITES)) is None
    # A site that dies while the others still train is still left out.
    reports["c"] = Report(online=False)
    view = decide(SITES, reports, first_view(SITES))
    assert view is not None and "c" not in view.members and "c" in view.reason


def test_a_member_ahead_of_the_view_makes_the_leader_decide_again():
    current = View(epoch=1, members=("a", "b"), start_round=5, engine_round=20)
    reports = {"a": training(6, 22, conflict=1), "b": training(5, 21), "c": Report(online=False)}
    view = decide(SITES, reports, current)
    assert view is not None
    assert (view.start_round, view.catch_up, view.donor) == (6, ("b",), "a")


def test_the_leader_is_the_first_live_site():
    current = first_view(SITES)
    assert leader_of(SITES, {}, current) == "a"
    assert leader_of(SITES, {"a": Report(online=False)}, current) == "b"
    assert leader_of(SITES, {"a": Report(phase="done")}, current) == "b"


def test_malformed_reports_and_views_are_refused_with_the_field():
    assert "phase" in Report.from_status({"state": "online", "membership": {"phase": "x"}}, SITES)
    bad = {"state": "online", "membership": {"phase": "training", "epoch": -1}}
    assert "membership.epoch" in Report.from_status(bad, SITES)
    assert Report.from_status({"state": "online"}, SITES) is None
    assert Report.from_status({"state": "offline"}, SITES) == Report(online=False)
    good = first_view(SITES).to_message()
    assert View.from_message(good, SITES) == first_view(SITES)
    assert "members" in View.from_message({**good, "members": ["zz"]}, SITES)
    assert "donor" in View.from_message({**good, "catch_up": ["b"], "donor": None}, SITES)
    assert "epoch" in View.from_message({**good, "epoch": "1"}, SITES)


def test_the_leader_publishes_once_and_every_site_applies_the_view_at_its_round():
    published: list[View] = []
    a = Membership(SITES, "a", min_sites=2)
    a.publish_view = published.append
    a.on_status("b", {"state": "online", "membership": training(4).to_message()})
    a.report(rounds=4, engine_round=12)
    assert published == []
    a.on_status("c", {"state": "offline"})
    a.on_status("c", {"state": "offline"})  # the same news again: no second view
    assert len(published) == 1
    view = published[0]
    assert view.members == ("a", "b") and view.leader == "a"
    assert a.newer_view(4) is None  # not back from the broker yet
    a.on_view(view.to_message())
    assert a.newer_view(4) == view  # the round under way must be run again
    assert a.view_for(4, timeout_s=1, on_wait=print) == view
    assert a.history == [view]


def test_a_site_that_said_it_is_done_is_not_taken_for_lost_by_its_last_will():
    """The Last Will is the status from when the site connected; a broker may send it
    after the site's own goodbye. The site that finished must stay finished: taken for
    lost, it would start a view that leaves it out of the round a still completes
    with it (a flake hunt's async resume run ended with a failed below the quorum)."""
    a, published = leader_a(SITES, min_sites=2, settle_s=0)
    a.report(rounds=6, engine_round=7)
    a.on_status("c", online(Report(phase="done", rounds=7, engine_round=8)))
    goodbye = {"state": "offline", "membership": Report(phase="done", rounds=7).to_message()}
    a.on_status("c", goodbye)
    will = {"state": "offline", "membership": training(0, 1).to_message()}
    a.on_status("b", online(training(6, 7)))
    a.on_status("c", will)
    a.on_status("c", {"state": "offline"})  # a will from before it had a report
    assert published == []
    # Back online (a new process): its reports count again, and its loss too.
    a.on_status("c", online(Report(phase="joining", rounds=0, engine_round=0)))
    a.on_status("c", {"state": "offline"})
    assert len(published) == 1 and "c" in published[0].reason


def online(report: Report) -> dict:
    return {"state": "online", "membership": report.to_message()}


def leader_a(sites: list[str], min_sites: int, settle_s: float) -> tuple[Membership, list[View]]:
    """Site a, the leader, and the list its published views go to."""
    published: list[View] = []
    a = Membership(sites, "a", min_sites=min_sites, stuck_settle_s=settle_s)
    a.publish_view = published.append
    return a, published


def test_a_stuck_member_that_reaches_everyone_waits_for_the_others_to_name_the_culprit():
    """The link a-c is cut; b's round fails first, and b reaches both. Deciding on
    b's report alone would run the round again with a, b and c (and fail again);
    the leader waits for a and c, still in the round, and leaves c out at once."""
    a, published = leader_a(SITES, min_sites=2, settle_s=60)
    a.report(rounds=7, engine_round=12)
    a.on_status("c", online(training(7, 12)))
    a.on_status("b", online(Report(phase="stuck", rounds=7, engine_round=12)))
    assert published == []
    a.report(phase="stuck", unreachable=("c",))
    assert [v.members for v in published] == [("a", "b")]
    assert "left out ['c']" in published[0].reason


def test_a_member_that_completed_the_round_is_not_waited_for():
    a, published = leader_a(["a", "b"], min_sites=1, settle_s=60)
    a.report(rounds=8, engine_round=13)  # a completed round 7, which b failed
    a.on_status("b", online(Report(phase="stuck", rounds=7, engine_round=12)))
    assert [(v.members, v.start_round) for v in published] == [(("a", "b"), 8)]


def test_without_the_others_reports_the_round_is_run_again_once_the_wait_is_over():
    # The wait runs on a timer thread: 1 s, not 0.2 s, so a busy machine that pauses
    # this thread between the report and the first check cannot let it end first.
    a, published = leader_a(SITES, min_sites=2, settle_s=1.0)
    a.report(rounds=7, engine_round=12)
    a.on_status("c", online(training(7, 12)))
    a.on_status("b", online(Report(phase="stuck", rounds=7, engine_round=12)))
    assert published == []
    deadline = time.monotonic() + 10
    while not published and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [v.members for v in published] == [("a", "b", "c")]
    assert published[0].reason == "stuck ['b']"


NEWCOMER_SPEC = {
    "ranks": 2,
    "parallel": {"dp_replicate": 2},
    "dial": ["10.0.0.9:7100", "10.0.0.9:7101"],
}


def test_a_site_added_to_the_job_file_is_taken_in_by_every_site_and_admitted_as_a_joiner():
    """c is in a newer job file than a's and b's: a (the leader) hears of it from its
    status, b only from the view that admits it; both get ready to exchange with it."""
    taken: dict[str, list[str]] = {"a": [], "b": []}
    published: list[View] = []
    a = Membership(["a", "b"], "a", min_sites=1)
    b = Membership(["a", "b"], "b", min_sites=1)
    for name, site in (("a", a), ("b", b)):
        site.take_in = lambda new, spec, name=name: taken[name].append(new)
    a.publish_view = published.append
    a.on_status("b", {"state": "online", "membership": training(3).to_message()})
    a.report(rounds=3, engine_round=9)
    joining = {"phase": "joining", "epoch": 0, "rounds": 0, "engine_round": 0}
    a.on_status("c", {"state": "online", "membership": joining, "spec": NEWCOMER_SPEC})
    assert taken["a"] == ["c"] and a.sites == ["a", "b", "c"]
    (view,) = published
    assert view.members == ("a", "b", "c")
    assert (view.start_round, view.catch_up, view.donor) == (4, ("c",), "a")
    assert view.newcomers == {"c": NEWCOMER_SPEC}
    assert b.on_view(view.to_message()) is None
    assert taken["b"] == ["c"] and b.sites == ["a", "b", "c"]
    assert b.latest == view


def test_a_site_added_that_does_not_fit_is_refused_once_with_the_reason():
    a = Membership(["a", "b"], "a", min_sites=1)
    published: list[View] = []
    a.publish_view = published.append
    a.take_in = lambda name, spec: "its tensor-parallel degree differs"
    joining = {"phase": "joining", "epoch": 0, "rounds": 0, "engine_round": 0}
    status = {"state": "online", "membership": joining, "spec": NEWCOMER_SPEC}
    assert "tensor-parallel" in a.on_status("c", status)
    assert a.on_status("c", status) is None  # said once; its statuses keep coming
    assert published == [] and a.sites == ["a", "b"]
    # A site that takes in no new sites says so.
    b = Membership(["a", "b"], "b", min_sites=1)
    assert "takes in no new sites" in b.on_status("c", status)


def test_a_newcomer_s_description_is_checked_and_its_lane_owners_found():
    new = newcomers.parse("c", NEWCOMER_SPEC, tp=1, pp=1)
    assert isinstance(new, newcomers.NewSite) and new.layout.dp == 2
    # Two lanes (sites of 2 and 1 data-parallel ranks): each rank of the new site owns one.
    assert new.lane_addresses(2, range(1, 2), {"tp": 0, "pp": 0, "dp": 1}) == {1: "10.0.0.9:7101"}
    assert new.lane_addresses(2, range(0, 2), {"tp": 0, "pp": 0, "dp": 0}) == {
        0: "10.0.0.9:7100",
        1: "10.0.0.9:7101",
    }
    assert "divide the job's 3 lanes" in new.lane_addresses(3, range(3), {"tp": 0, "pp": 0})
    assert "tp 1 and pp 1; every site of this job has tp 2" in newcomers.parse(
        "c", NEWCOMER_SPEC, tp=2, pp=1
    )
    assert "spec.dial" in newcomers.parse("c", {**NEWCOMER_SPEC, "dial": ["x:1"]}, tp=1, pp=1)
    assert "spec.ranks" in newcomers.parse("c", {**NEWCOMER_SPEC, "ranks": -1}, tp=1, pp=1)
    assert "spec.parallel" in newcomers.parse(
        "c", {**NEWCOMER_SPEC, "parallel": {"dp_shard": 3}}, tp=1, pp=1
    )
    assert "describes no layout" in newcomers.parse("c", None, tp=1, pp=1)
    assert newcomers.parse("c", new.to_message(), tp=1, pp=1) == new


def test_a_stuck_site_that_enters_the_next_view_no_longer_asks_for_one():
    published: list[View] = []
    a = Membership(["a", "b"], "a", min_sites=1)
    a.publish_view = published.append
    a.on_status("b", {"state": "online", "membership": training(3, 9).to_message()})
    a.report(phase="stuck", rounds=3, engine_round=9)
    assert len(published) == 1
    a.on_view(published[0].to_message())
    a.view_for(3, timeout_s=1, on_wait=print)
    a.on_status("b", {"state": "online", "membership": training(3, 9).to_message()})
    assert len(published) == 1, published


def test_below_quorum_a_site_waits_and_says_why():
    b = Membership(SITES, "b", min_sites=2)
    view = View(epoch=1, members=("b",), start_round=3, engine_round=20)
    b.on_view(view.to_message())
    said: list[str] = []
    with pytest.raises(MembershipError, match="quorum"):
        b.view_for(3, timeout_s=0.3, on_wait=said.append)
    assert "1 of the 2 sites" in said[0]


def test_a_site_left_out_by_a_view_that_starts_past_its_round_waits_to_be_let_back_in():
    # c was let in at round 12 but could not catch up in time; the others left it
    # out again from round 12 and went on. c, still at round 10 under the view
    # that let it in, must take the new one and ask to come back, not keep
    # entering the old one.
    c = Membership(SITES, "c", min_sites=2, joining=True)
    admitted = View(
        epoch=3, members=tuple(SITES), start_round=12, engine_round=40, catch_up=("c",), donor="a"
    )
    c.on_view(admitted.to_message())
    assert c.view_for(10, timeout_s=1, on_wait=lambda why: None) == admitted
    left_out = View(epoch=4, members=("a", "b"), start_round=12, engine_round=60)
    c.on_view(left_out.to_message())
    said: list[str] = []
    with pytest.raises(MembershipError, match="rejoin_timeout_s"):
        c.view_for(10, timeout_s=0.3, on_wait=said.append)
    assert c.applied == left_out
    assert "waiting for the leader to let this site in (view 4 holds)" in said[0]
    assert Report.from_status(
        {"state": "online", "membership": c.report_message()}, SITES
    ).phase == ("joining")


def test_a_joining_site_waits_to_be_let_in_and_gives_up_when_the_others_stop():
    c = Membership(SITES, "c", min_sites=2, joining=True)
    assert Report.from_status(
        {"state": "online", "membership": c.report_message()}, SITES
    ).phase == ("joining")
    admitted = View(
        epoch=2, members=tuple(SITES), start_round=9, engine_round=40, catch_up=("c",), donor="a"
    )
    threading.Timer(0.2, c.on_view, [admitted.to_message()]).start()
    assert c.view_for(0, timeout_s=5, on_wait=lambda why: None) == admitted

    late = Membership(SITES, "c", min_sites=2, joining=True)
    for site in ("a", "b"):
        done = Report(phase="done", rounds=9).to_message()
        late.on_status(site, {"state": "offline", "membership": done})
    with pytest.raises(MembershipError, match="done training"):
        late.view_for(0, timeout_s=5, on_wait=lambda why: None)


# -- state transfer over a real server ------------------------------------------------


def identity(site: str) -> Identity:
    return Identity(job="j", site=site, rank=0, layout_fingerprint="f")


def test_the_state_is_pulled_whole_in_parts_and_only_once_the_donor_is_there():
    state = {"rounds": 3, "outer": {"global": [torch.arange(50_000.0)]}}
    digest, blob = pack_state(state)
    asked: list[int] = []

    def provider(rounds: int) -> tuple[str, bytes]:
        asked.append(rounds)
        if len(asked) < 3:
            raise StateUnavailable(wire_pb2.STATE_NOT_READY, "not there yet")
        if rounds != 3:
            raise StateUnavailable(wire_pb2.STATE_GONE, "past it")
        return digest, blob

    async def scenario():
        server = PeerServer(identity("a"), ["a", "b"], lambda chunk: None)
        server.servicer.state_provider = provider
        server.servicer.part_bytes = 16 * 1024  # many parts
        port = await server.start()
        client = PeerClient(identity("b"), f"127.0.0.1:{port}", peer_site="a")
        try:
            fetched = await fetch_state(client, 3, deadline_s=20, max_bytes=1 << 20)
            with pytest.raises(StateGone):
                await fetch_state(client, 2, deadline_s=20, max_bytes=1 << 20)
            with pytest.raises(RuntimeError, match="more than"):
                await fetch_state(client, 3, deadline_s=20, max_bytes=1000)
        finally:
            await client.close()
            await server.stop()
        return fetched

    fetched = asyncio.run(scenario())
    assert fetched.bytes == len(blob)
    assert torch.equal(fetched.state["outer"]["global"][0], state["outer"]["global"][0])
    assert asked[:3] == [3, 3, 3]  # waited while the donor was not there


def test_a_stranger_gets_no_state():
    async def scenario():
        server = PeerServer(identity("a"), ["a", "b"], lambda chunk: None)
        server.servicer.state_provider = lambda rounds: pack_state({"secret": 1})
        port = await server.start()
        stranger = Identity(job="other", site="b", rank=0, layout_fingerprint="f")
        client = PeerClient(stranger, f"127.0.0.1:{port}", peer_site="a")
        try:
            with pytest.raises(RuntimeError, match="job"):
                await fetch_state(client, 0, deadline_s=5, max_bytes=1 << 20)
        finally:
            await client.close()
            await server.stop()
        return server.servicer.refusals

    assert asyncio.run(scenario())["WRONG_JOB"] == 1


def test_a_transfer_goes_on_from_the_last_good_byte_after_a_bad_part(monkeypatch):
    from isthmus.inter import state_transfer

    digest, blob = pack_state({"outer": {"global": [torch.randn(40_000)]}})
    offsets: list[int] = []
    original = state_transfer.serve_state

    async def garbling(provider, request, **kw):
        offsets.append(request.offset)
        index = 0
        async for part in original(provider, request, **kw):
            if len(offsets) == 1 and index == 3:  # the first stream's fourth part
                part.payload = bytes([part.payload[0] ^ 1]) + part.payload[1:]
            index += 1
            yield part

    monkeypatch.setattr(state_transfer, "serve_state", garbling)

    async def scenario():
        server = PeerServer(identity("a"), ["a", "b"], lambda chunk: None)
        server.servicer.state_provider = lambda rounds: (digest, blob)
        server.servicer.part_bytes = 16 * 1024
        port = await server.start()
        client = PeerClient(identity("b"), f"127.0.0.1:{port}", peer_site="a")
        try:
            return await fetch_state(client, 0, deadline_s=20, max_bytes=1 << 20)
        finally:
            await client.close()
            await server.stop()

    fetched = asyncio.run(scenario())
    assert fetched.resumed == 1
    assert offsets == [0, 3 * 16 * 1024]  # asked again from the last good byte
    assert fetched.bytes == len(blob)


def test_a_site_let_back_in_as_the_others_finish_learns_that_they_are_all_done():
    """What a site pulling the state checks: once every other site says it is done
    training, no donor will reach the round it waits for."""
    c = Membership(SITES, "c", min_sites=1)
    c.on_status("a", {"state": "online", "membership": training(40).to_message()})
    c.on_status("b", {"state": "online", "membership": Report(phase="done").to_message()})
    assert not c.others_done()
    c.on_status("a", {"state": "online", "membership": Report(phase="done").to_message()})
    assert c.others_done()


def test_a_replayed_or_conflicting_view_is_refused_counted_and_never_applied():
    a = Membership(SITES, "a", min_sites=2)
    first = View(epoch=1, members=("a", "b"), start_round=3, engine_round=20)
    second = View(epoch=2, members=("a", "b", "c"), start_round=5, engine_round=30)
    assert a.on_view(first.to_message()) is None
    assert a.on_view(second.to_message()) is None
    assert a.on_view(second.to_message()) is None  # the view in force again: retained
    replay = a.on_view(first.to_message())
    assert replay is not None and "view 1" in replay and "not applied" in replay
    forged = View(epoch=2, members=("a",), start_round=5, engine_round=30)
    assert a.on_view(forged.to_message()) is not None
    assert a.latest == second and a.stale_views == 2
