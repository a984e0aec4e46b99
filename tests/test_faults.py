"""Faults on real processes over the emulator: a link cut for a while holds the
run up, and the run goes on when it heals, with the same model on every site.

The cut falls at a point of training (``at_round``), not at a time: a cut on a
clock (it was ``at_s: 20``) fell before training started when the machine was
loaded and the sites started late, and nothing was held up."""

from __future__ import annotations

import itertools
import json

import pytest
from test_run import explain, isthmus, write_job

from isthmus.training.records import read_records

PARTITIONED_JOB = """\
name: partitioned
sites:
  - {name: a, ranks: 1}
  - {name: b, ranks: 1}
wan:
  default: {rtt_ms: 20, bandwidth_mbit: 200}
  faults:
    - {at_round: 3, link: [a, b], action: partition, for_s: 8, mode: MODE}
train: {strategy: diloco, steps: STEPS, sync_every: 5, warmup_steps: 2, eval_every: 0}
"""


STEPS = 40
"""8 rounds: the cut falls once a site has completed round 3, 5 rounds before the end.

What holds the run during the cut is the round in flight: its exchange waits for the
link to come back, so no site can take a step past that round's end until the cut
heals, 8 s later, however fast or slow the machine. The run cannot end before the
heal if the cut falls before the last round's exchange is done: the launcher reports
round 3 within its 0.25 s poll, while 5 rounds of 5 steps and an exchange each (2.5 s
here, on a loaded 2-core machine; over 1 s on one twice as fast) remain, so the
round in flight is round 4, or 5 at worst, and 15 steps or more train after the heal.
(200 steps, as it was, trained for 20 s after the heal.)"""


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["blackhole", "reset"])
def test_a_cut_link_holds_the_run_up_and_it_goes_on_when_it_heals(tmp_path, mode):
    job = write_job(tmp_path, steps=STEPS, text=PARTITIONED_JOB.replace("MODE", mode))
    out = tmp_path / "run"
    done = isthmus("run", str(job), "--out", str(out), "--no-report", cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr + explain(out)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "finished"
    sites = summary["sites"].values()
    assert len({s["param_sha256"] for s in sites}) == 1
    assert all(s["inner_steps"] == STEPS for s in sites)
    # The round in flight when the link went down waited for it to come back.
    times = [
        r["t"]
        for r in read_records(out / "metrics.jsonl")
        if r.get("site") == "a" and r["kind"] == "step"
    ]
    assert max(b - a for a, b in itertools.pairwise(times)) >= 6
    assert f"cut ({mode})" in (out / "logs" / "wan.log").read_text()
