"""The launcher's restart policy for lost sites (``isthmus run --restart-lost``):
a site that trains between its losses is restarted every time (churn), one that
dies again before it completes a round is given up after MAX_RESTARTS."""

from __future__ import annotations

from pathlib import Path

from isthmus.deploy.launch.launcher import MAX_RESTARTS
from isthmus.deploy.launch.run_state import RunState, SiteState, apply_record


def round_record(outer_steps: int) -> dict:
    return {
        "kind": "round",
        "t": 0.0,
        "outer_steps": outer_steps,
        "wan_bytes_sent": 0,
        "wan_bytes_sent_to": {},
    }


def test_a_completed_round_resets_the_crash_loop_count_but_not_the_total():
    site = SiteState(name="a", ranks=1)
    for lost in range(1, 3 * MAX_RESTARTS + 1):
        site.restarts += 1
        site.restarts_in_a_row += 1
        assert site.restarts_in_a_row == 1  # the round before reset it
        apply_record(site, round_record(lost))  # back in training: it was churn
        assert site.restarts_in_a_row == 0
    assert site.restarts == 3 * MAX_RESTARTS
    assert site.restarts_in_a_row == 0


def test_other_records_do_not_reset_it():
    site = SiteState(name="a", ranks=1, restarts_in_a_row=2)
    apply_record(site, {"kind": "state", "t": 0.0, "state": "rejoining"})
    apply_record(
        site, {"kind": "step", "t": 1.0, "step": 1, "loss": 1.0, "tokens": 8, "compute_s": 0.1}
    )
    assert site.restarts_in_a_row == 2


def _state(steps: int = 20) -> RunState:
    from isthmus.job.file import parse_job

    job = parse_job(
        f"name: end\nsites: [{{name: a}}, {{name: b}}, {{name: c}}]\ntrain: {{steps: {steps}}}\n"
    )
    return RunState(
        job=job,
        run_dir=Path("/nowhere"),
        started=0.0,
        sites={n: SiteState(name=n, ranks=1, status="computing") for n in "abc"},
    )


def test_a_site_lost_after_its_last_round_is_not_started_again():
    state = _state(steps=20)
    c = state.sites["c"]
    apply_record(c, {**round_record(3), "step": 15})
    assert state.run_over_for(c) == ""  # mid-run: churn, started again
    apply_record(c, {**round_record(4), "step": 20})  # its last round: trained every step
    assert "it had trained all 20 steps" in state.run_over_for(c)


def test_a_site_is_not_started_again_when_the_others_have_ended_or_it_came_back_too_late():
    state = _state()
    c = state.sites["c"]
    state.sites["a"].status = "finished"
    state.sites["b"].status = "lost"
    state.sites["b"].restart_at = 5.0  # b comes back: the run goes on, so may c
    assert state.run_over_for(c) == ""
    state.sites["b"].restart_at = None
    assert state.run_over_for(c) == "every other site had ended"
    assert "came back after every other site had finished" in state.run_over_for(
        c, run_over=True
    )
