"""The launcher's restart policy for lost sites (``isthmus run --restart-lost``):
a site that trains between its losses is restarted every time (churn), one that
dies again before it completes a round is given up after MAX_RESTARTS."""

from __future__ import annotations

from isthmus.deploy.launch.launcher import MAX_RESTARTS
from isthmus.deploy.launch.run_state import SiteState, apply_record


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
