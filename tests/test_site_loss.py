"""Site loss and rejoin on real processes over the emulator: a SIGKILLed site is
left out, the others train on, the restarted site pulls the global state from
a live peer and trains on, and every site ends with the same model."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys

import pytest
from site_kill import kill_after_rounds, loss_figures
from test_run import explain, isthmus

from isthmus.training.records import read_records

JOB = """\
name: site-loss
sites:
  - {name: a, ranks: 1}
  - {name: b, ranks: 1}
SITE_C
wan:
  default: {rtt_ms: 20, bandwidth_mbit: 200}
FAULTS
train: {strategy: STRATEGY, steps: STEPS, sync_every: 5, warmup_steps: 2, min_sites: QUORUM,
        eval_every: 0}
"""

HOLD_UNTIL_C_IS_BACK = """\
  faults:
    - {at_round: 4, rounds_of: c, link: [a, b], action: brownout, changes: {rtt_ms: 2000},
       for_rounds: 2}
"""
"""From c's round 4 (when the test kills it) until c has completed two more rounds
(at most one of them before it died: it is killed as it records its fourth; the
restarted c reports the run's round count, so its first round back ends it), the
survivors' link takes 2 s a round trip: their rounds have a floor of network time,
so they cannot finish before c is back, however fast the machine. Without it, a and
b on a fast machine took their last 130 steps in about as long as c's restart took
(2 s, then a new process), and c found everyone done.

How many rounds that takes (each strategy's steps): the survivors are at most at
round 5 when c dies, and every round they run without c after that costs at least
the floor, so the hold lasts at least (rounds - 5) x the round under the brownout.
From the kill to c's rejoin took 9.5 to 12.5 s on a loaded 2-core machine (load
average 4: the launcher sees the loss, starts a new process, it imports torch,
joins, pulls the state); on a machine twice as slow, 25 s. Each strategy gets
enough rounds to hold at least 30 s:

=========  ==========================================  ======  =====  ====
strategy   its round under the brownout (measured)     rounds  steps  hold
=========  ==========================================  ======  =====  ====
diloco     4.5 s (its exchange: about 2 round trips)   12      60     31 s
sync       2.2 s (every step is a round)               20      20     33 s
async      2.0-2.9 s (exchange overlaps the compute)   20      100    30 s
streaming  2.1 s (one fragment's exchange)             20      50     31 s
=========  ==========================================  ======  =====  ====

A faster machine restarts c sooner and cannot shorten the floor; a slower one makes
the rounds longer too. Once c is back the hold costs at most two slow rounds: c
joins at the survivors' next round, and its first round ends the brownout; the rest
runs at full speed. (With 150 steps for every strategy and a 500 ms brownout, most
of each run was plain training after the rejoin: sync trained 140 steps more.)"""

SHORT_STEPS = 40
"""Steps of the tests where nothing races a restart: below the quorum the others wait
for the lost site, and a site that leaves is just let go. The fault falls at round 4
(step 20) with 4 rounds to go: far more than the 0.1 s the test takes to see the
round and send the signal, on a machine of any speed."""


def job_text(
    *,
    sites: int,
    quorum: int,
    steps: int,
    strategy: str = "diloco",
    hold_until_c_is_back: bool = False,
) -> str:
    return (
        JOB.replace("SITE_C", "  - {name: c, ranks: 1}" if sites == 3 else "")
        .replace("STEPS", str(steps))
        .replace("QUORUM", str(quorum))
        .replace("STRATEGY", strategy)
        .replace("FAULTS\n", HOLD_UNTIL_C_IS_BACK if hold_until_c_is_back else "")
    )


def run_with_fault(tmp_path, text: str, victim: str, *flags: str, **fault):
    """``isthmus run`` of the job ``text``; once ``victim`` has done 4 rounds, SIGKILL it
    (``fault``: see :func:`kill_after_rounds`). Returns the run directory, its
    summary, and what followed the fault."""
    job = tmp_path / "job.yaml"
    job.write_text(text)
    out = tmp_path / "run"
    run = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "isthmus",
            "run",
            str(job),
            "--out",
            str(out),
            "--no-report",
            *flags,
        ],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        hit = kill_after_rounds(out, victim, 4, timeout_s=300, **fault)
        _, err = run.communicate(timeout=600)
    finally:
        run.kill()
    assert run.returncode == 0, err + explain(out)
    summary = json.loads((out / "summary.json").read_text())
    return out, summary, loss_figures(out, victim, hit)


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy, steps",
    # Streaming with each fragment's exchange in flight for a step: a lost site
    # makes the others give up the exchange under way and run it again. The steps:
    # see HOLD_UNTIL_C_IS_BACK.
    [
        ("diloco", 60),
        ("sync", 20),
        ("async", 100),
        ("streaming, fragments: 2, overlap_steps: 1", 50),
    ],
    ids=["diloco", "sync", "async", "streaming"],
)
def test_a_killed_site_is_left_out_then_rejoins_and_every_site_ends_with_the_same_model(
    tmp_path, strategy, steps
):
    text = job_text(sites=3, quorum=2, steps=steps, strategy=strategy, hold_until_c_is_back=True)
    out, summary, figures = run_with_fault(tmp_path, text, "c", "--restart-lost")
    assert summary["status"] == "finished"
    sites = summary["sites"]
    assert len({s["param_sha256"] for s in sites.values()}) == 1, sites
    assert all(s["inner_steps"] == steps for s in sites.values())
    # The survivors went on without c, then took it back.
    members = [v["members"] for v in figures["views"]]
    assert ["a", "b"] in members
    assert ["a", "b", "c"] in members
    assert all(t is not None for t in figures["survivors_next_round_after_kill_s"].values())
    assert figures["state_transfer_bytes"] > 0
    rejoin = [r for r in read_records(out / "metrics.jsonl") if r["kind"] == "rejoin"]
    assert len(rejoin) == 1 and rejoin[0]["site"] == "c"


@pytest.mark.slow
def test_below_the_quorum_training_pauses_until_the_lost_site_is_back(tmp_path):
    text = job_text(sites=2, quorum=2, steps=SHORT_STEPS)
    out, summary, figures = run_with_fault(tmp_path, text, "b", "--restart-lost")
    assert summary["status"] == "finished"
    sites = summary["sites"]
    assert len({s["param_sha256"] for s in sites.values()}) == 1, sites
    log = (out / "logs" / "a-r0.log").read_text()
    assert "quorum" in log  # a said why it waited
    assert figures["rejoined_at_round"] is not None


@pytest.mark.slow
def test_a_site_that_leaves_on_purpose_is_let_go_and_the_others_go_on(tmp_path):
    text = job_text(sites=3, quorum=2, steps=SHORT_STEPS)
    out, summary, _ = run_with_fault(tmp_path, text, "c", sig=signal.SIGUSR1)
    sites = summary["sites"]
    assert sites["c"]["status"] == "left"
    assert sites["c"]["inner_steps"] < SHORT_STEPS
    assert sites["a"]["param_sha256"] == sites["b"]["param_sha256"]
    assert all(sites[s]["inner_steps"] == SHORT_STEPS for s in "ab")
    views = [r for r in read_records(out / "metrics.jsonl") if r["kind"] == "view"]
    assert any("leaving ['c']" in v["reason"] for v in views if v["site"] == "a")


TWO_RANK_SITES = """\
name: site-loss-ranks
sites:
  - {name: a, ranks: 1}
  - {name: b, ranks: 2}
wan:
  default: {rtt_ms: 20, bandwidth_mbit: 200}
train: {strategy: diloco, steps: STEPS, sync_every: 5, warmup_steps: 2, min_sites: 2,
        eval_every: 0}
"""


@pytest.mark.slow
def test_a_site_of_several_ranks_that_loses_one_is_restarted_whole_and_rejoins(tmp_path):
    """One rank of b dies (a lost GPU): the launcher stops b's other rank, a waits
    below the quorum of 2, b comes back whole, and both sites end with the same
    model. a has one rank, b two (replicas): each rank of b pulls the state from
    the rank of a it shares its first lane with, here a's only one.

    The quorum keeps the test about the restart, not a race: with quorum 1, a
    trained on alone and, on a fast machine, finished its steps (100 then, 5 s) before
    b's two ranks were back (13 s), so b found everyone done."""
    text = TWO_RANK_SITES.replace("STEPS", str(SHORT_STEPS))
    out, summary, _ = run_with_fault(tmp_path, text, "b", "--restart-lost", ranks=[1])
    sites = summary["sites"]
    assert sites["a"]["param_sha256"] == sites["b"]["param_sha256"], sites
    assert all(s["inner_steps"] == SHORT_STEPS for s in sites.values())
    rejoin = [r for r in read_records(out / "metrics.jsonl") if r["kind"] == "rejoin"]
    assert [r["site"] for r in rejoin] == ["b"]


CUT_OFF = """\
name: cut-off
sites:
  - {name: a, ranks: 1}
  - {name: b, ranks: 1}
  - {name: c, ranks: 1}
wan:
  default: {rtt_ms: 20, bandwidth_mbit: 200}
  faults:
    - {at_round: 4, link: [a, c], action: partition, for_rounds: 4, rounds_of: b, mode: blackhole}
train:
  strategy: async
  # Direct: no site completes a round across the cut. By gather b would, since a
  # and c each reach it, and a and c would catch up from b each round instead
  # of leaving c out: the cut would heal before any deadline.
  algorithm: direct
  steps: 240
  sync_every: 5
  warmup_steps: 2
  round_deadline_s: 8
  collective_timeout_s: 5
  late_contributions: stale
  staleness_weight: 0.5
  eval_every: 0
"""


@pytest.mark.slow
def test_an_async_site_that_misses_its_round_has_its_pseudo_gradient_applied_late(tmp_path):
    """Staleness handling with a slowed site: the link a-c is cut for longer than
    the round's deadline while c's async exchange is in flight. c (the later of
    the pair in the job's order) is left out by everyone, a and b train on, and
    once the link heals c reaches them again, is let in and catches up; with
    late_contributions: stale its missed round's pseudo-gradient goes into its
    next contribution, at half weight. Every site ends with the same model.

    The timing comes from training, not the clock, so it holds on a fast machine
    or a slow one: the link is cut once a site has completed round 4 (of 48), and
    heals once b has completed 4 more. By direct (the job says so) b cannot
    complete those without c's share until c is left out (the round's deadline),
    so the cut outlasts the deadline,
    and it heals with about 40 of a and b's rounds to go. (It was cut at 20 s and
    healed at 38 s: on a loaded machine the cut could fall before training, and
    on a fast one a and b could finish before the heal.)

    Where in its round the cut falls decides whether a, the cut's other end, misses
    that round too: cut while contributions travel, nobody completes it and the
    view without c runs it again; cut while results travel, b completes it, a and
    c do not, and a pulls b's state. So each site's late contributions are checked
    against the rounds its catch-up records say it missed."""
    job = tmp_path / "job.yaml"
    job.write_text(CUT_OFF)
    out = tmp_path / "run"
    done = isthmus("run", str(job), "--out", str(out), "--no-report", cwd=tmp_path, timeout=900)
    assert done.returncode == 0, done.stderr + explain(out)
    sites = json.loads((out / "summary.json").read_text())["sites"]
    assert len({s["param_sha256"] for s in sites.values()}) == 1, sites
    records = read_records(out / "metrics.jsonl")
    views = [r for r in records if r["kind"] == "view" and r["site"] == "b"]
    assert any(v["members"] == ["a", "b"] for v in views), views
    assert views[-1]["members"] == ["a", "b", "c"] or any(
        "joining ['c']" in v["reason"] for v in views
    )
    # A catch-up carries a pseudo-gradient only if the site trained since its last
    # one: a site left out, then waiting to be let in, catches up again when it is
    # let in, with nothing to carry. (c can be left out and catch up, then be let in
    # a few rounds later: two catch-ups, one pseudo-gradient; or see the view that
    # leaves it out only with the one that lets it in: one catch-up, under that
    # view, carrying the pseudo-gradient of the round it trained through.)
    missed = {site: _rounds_missed_after_training(records, site) for site in sites}
    assert missed["c"] and not missed["b"], missed
    assert sites["c"]["late_contributions_applied"] == 1, sites
    # Each site carries one pseudo-gradient per round it missed, no more, no fewer.
    for site, result in sites.items():
        assert result["late_contributions_applied"] == len(missed[site]), (site, missed, sites)
    log = (out / "logs" / "c-r0.log").read_text()
    carried = re.findall(r"missed round \d+; its pseudo-gradient \(norm ([0-9.e+-]+)\)", log)
    assert len(carried) == 1 and float(carried[0]) > 0, log[-3000:]


@pytest.mark.slow
def test_a_cut_inside_a_gather_round_leaves_every_site_with_the_same_model(tmp_path):
    """The same cut by gather. a and c each still reach b, so b completes the rounds
    a and c cannot. Depending on how the round's deadline and the cut's healing
    fall, a and c catch up from b round by round, or c is left out and let in
    again. Either way every site trains every step and ends with the same model,
    and each site's missed rounds go into its next contribution."""
    job = tmp_path / "job.yaml"
    job.write_text(CUT_OFF.replace("algorithm: direct", "algorithm: gather"))
    out = tmp_path / "run"
    done = isthmus("run", str(job), "--out", str(out), "--no-report", cwd=tmp_path, timeout=900)
    assert done.returncode == 0, done.stderr + explain(out)
    summary = json.loads((out / "summary.json").read_text())
    sites = summary["sites"]
    assert len({s["param_sha256"] for s in sites.values()}) == 1, sites
    assert all(s["inner_steps"] == 240 for s in sites.values()), sites
    assert all(s["all_reduce_rounds"].get("gather") for s in sites.values()), sites
    records = read_records(out / "metrics.jsonl")
    caught_up = {r["site"] for r in records if r["kind"] == "catch_up"}
    assert caught_up & {"a", "c"}, caught_up  # the cut's ends missed a round
    for site, result in sites.items():
        missed = _rounds_missed_after_training(records, site)
        assert result["late_contributions_applied"] == len(missed), (site, missed, sites)


def _rounds_missed_after_training(records: list[dict], site: str) -> set[int]:
    """The rounds of ``site``'s catch-ups that followed some training of its own
    (a step since its previous catch-up, or since it started)."""
    missed, trained = set(), False
    for r in records:
        if r.get("site") != site:
            continue
        if r["kind"] == "step":
            trained = True
        elif r["kind"] == "catch_up":
            if trained:
                missed.add(r["round"])
            trained = False
    return missed


def _kill_at_the_end(tmp_path, steps: int):
    """``isthmus run --restart-lost`` of 3 sites, H=5; c SIGKILLed as it records its
    fourth round (step 20). Returns the run's summary and directory."""
    job = tmp_path / "job.yaml"
    job.write_text(job_text(sites=3, quorum=1, steps=steps))
    out = tmp_path / "run"
    run = subprocess.Popen(
        [sys.executable, "-m", "isthmus", "run", str(job), "--out", str(out), "--no-report",
         "--restart-lost"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        kill_after_rounds(out, "c", 4, timeout_s=300)
        _, err = run.communicate(timeout=600)
    finally:
        run.kill()
    assert run.returncode == 0, err + explain(out)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "finished", summary
    finished = [s for s in summary["sites"].values() if s["status"] == "finished"]
    assert len(finished) >= 2 and len({s["param_sha256"] for s in finished}) == 1
    assert all(s["ended_s"] is not None for s in summary["sites"].values())
    return summary, out


@pytest.mark.slow
def test_a_site_killed_after_its_last_round_is_not_restarted_and_the_run_finishes(tmp_path):
    """Issue 60's end of a run: c is SIGKILLed as it records its last round (step 20
    of 20), before or after it writes its result. --restart-lost must not start it
    again into a run that has ended (a restarted c could only find the others done),
    and the run is ``finished``: every surviving site holds the final model."""
    summary, out = _kill_at_the_end(tmp_path, steps=20)  # rounds at 5, 10, 15, 20
    c = summary["sites"]["c"]
    assert c["restarts"] == 0, c
    if c["status"] == "lost":
        assert "not restarted: it had trained all 20 steps" in c["reason"]
    else:  # killed after its result: it holds the final model too
        assert c["status"] == "finished" and "after it had written its result" in c["reason"]
    assert "rejoining" not in (out / "metrics.jsonl").read_text()


@pytest.mark.slow
def test_a_site_restarted_after_the_others_finished_ends_the_run_as_lost_not_failed(tmp_path):
    """c dies at step 20 of 22: the others finish their two steps and the final
    synchronisation without it. Started again, it finds them done and ends once, as
    lost (before, it was restarted three times, each failing, and the run
    ``failed``); where the others had ended before the launcher saw the loss, it is
    not started at all; on a machine slow enough to let it back in, it finishes."""
    summary, _ = _kill_at_the_end(tmp_path, steps=22)
    c = summary["sites"]["c"]
    if c["restarts"] == 0:  # the others had ended before the launcher saw c's loss
        assert c["status"] == "lost" and "not restarted: every other site had ended" in (
            c["reason"]
        ), c
    elif c["status"] == "lost":
        assert c["restarts"] == 1, c
        # It saw the others done and ended, or the launcher stopped it as they ended.
        assert (
            "not restarted: it came back after every other site had finished" in c["reason"]
            or "still coming back when every other site had ended" in c["reason"]
        ), c
    else:
        assert c["restarts"] == 1 and c["status"] == "finished", c
