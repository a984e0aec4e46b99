"""A job started again on the same broker does not take an earlier run's retained
view, live settings or statuses for its own (deploy/launch/stale_run.py), with a
real Mosquitto."""

from __future__ import annotations

import json

import pytest
from needs import needs_mosquitto
from test_control import Mosquitto, publish
from test_site import free_port_block, write
from test_site_resume import _finish, _retained, _start

from isthmus.inter.control_topics import config_topic, encode, membership_topic, status_topic
from isthmus.job.file import load_job, parse_job

pytestmark = needs_mosquitto

JOB = """\
name: again
sites:
  - {{name: a, address: 127.0.0.1:{a}}}
  - {{name: b, address: 127.0.0.1:{b}}}
train: {{strategy: diloco, steps: 24, sync_every: 4, warmup_steps: 2, eval_every: 0}}
control: {{broker: mqtt://127.0.0.1:{broker}}}
"""

# What a run of the job that left b out at round 5 and was then stopped leaves
# retained (as measured: this view made every site of the next run fail).
STALE_VIEW = {
    "epoch": 1, "members": ["a"], "start_round": 5, "engine_round": 20, "catch_up": [],
    "donor": None, "reason": "left out ['b']", "leader": "a", "newcomers": {}, "t": 1.0,
}  # fmt: skip
STALE_CONFIG = {"settings": {"sync_every": 8}, "from_round": 3, "version": 2, "t": 1.0}


def _leave_a_stopped_run(broker: Mosquitto, job: str) -> None:
    publish(broker.address, membership_topic(job), encode(STALE_VIEW))
    publish(broker.address, config_topic(job), encode(STALE_CONFIG))
    for site, rounds in (("a", 15), ("b", 4)):
        status = {"state": "offline", "protocol": 1, "ranks": 1, "step": 4 * rounds}
        publish(broker.address, status_topic(job, site), encode({**status, "round": rounds}))


def test_an_earlier_runs_retained_state_is_cleared_unless_a_site_is_online(tmp_path):
    from isthmus.deploy.launch.stale_run import forget_stale_run

    broker = Mosquitto(tmp_path).start()
    try:
        job = load_job(write(tmp_path, JOB.format(a=7100, b=7200, broker=broker.port)))
        _leave_a_stopped_run(broker, "again")
        # A site of the job online: a live run, which a late site joins as it is.
        online = {"state": "online", "protocol": 1, "ranks": 1, "step": 0, "round": 0}
        publish(broker.address, status_topic("again", "b"), encode(online))
        assert forget_stale_run(job, "a") == []
        assert len(_retained(broker, "isthmus/again/#")) == 4
        # None online: all of it is the stopped run's.
        publish(broker.address, status_topic("again", "b"), encode({**online, "state": "offline"}))
        cleared = forget_stale_run(job, "a")
        assert sorted(cleared) == sorted(
            [membership_topic("again"), config_topic("again")]
            + [status_topic("again", s) for s in "ab"]
        )
        assert _retained(broker, "isthmus/again/#") == {}
        assert forget_stale_run(job, "b") == []  # nothing left: nothing to do
    finally:
        broker.stop()


def test_no_broker_there_is_left_to_the_control_plane_to_name():
    from isthmus.deploy.launch.stale_run import forget_stale_run

    job = parse_job(JOB.format(a=7100, b=7200, broker=free_port_block(1)))
    assert forget_stale_run(job, "a") == []


@pytest.mark.slow
def test_a_job_started_again_after_a_stopped_run_trains_as_a_new_run(tmp_path):
    """Both sites of the new run start afresh with ``isthmus site`` while the broker
    still holds the stopped run's view (b left out from round 5), settings and
    statuses; they train the whole job together, as on a new broker."""
    broker = Mosquitto(tmp_path).start()
    try:
        base = free_port_block(2)
        job = write(tmp_path, JOB.format(a=base, b=base + 1, broker=broker.port))
        _leave_a_stopped_run(broker, "again")
        said = _finish({s: _start(job, s, "--out", str(tmp_path / s)) for s in "ab"}, 120)
        results = {
            s: json.loads((tmp_path / s / "sites" / s / "result.json").read_text()) for s in "ab"
        }
        assert len({r["param_sha256"] for r in results.values()}) == 1, results
        assert all(r["inner_steps"] == 24 for r in results.values()), results
        # Neither took the stopped run's view or its sync_every 8.
        for text in said.values():
            assert "left out ['b']" not in text and "view 1" not in text, text[-3000:]
        assert all(r["outer_steps"] == 24 // 4 for r in results.values()), results
    finally:
        broker.stop()
