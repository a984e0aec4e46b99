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

from isthmus.deploy.run.records import read_records

PARTITIONED_JOB = """\
name: partitioned
sites:
  - {name: a, ranks: 1}
  - {name: b, ranks: 1}
wan:
  default: {rtt_ms: 20, bandwidth_mbit: 200}
  faults:
    - {at_round: 3, link: [a, b], action: partition, for_s: 8, mode: MODE}
train: {strategy: diloco, steps: STEPS, sync_every: 5, warmup_steps: 2}
"""


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["blackhole", "reset"])
def test_a_cut_link_holds_the_run_up_and_it_goes_on_when_it_heals(tmp_path, mode):
    job = write_job(tmp_path, steps=200, text=PARTITIONED_JOB.replace("MODE", mode))
    out = tmp_path / "run"
    done = isthmus("run", str(job), "--out", str(out), cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr + explain(out)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "finished"
    sites = summary["sites"].values()
    assert len({s["param_sha256"] for s in sites}) == 1
    assert all(s["inner_steps"] == 200 for s in sites)
    # The round in flight when the link went down waited for it to come back.
    times = [
        r["t"]
        for r in read_records(out / "metrics.jsonl")
        if r.get("site") == "a" and r["kind"] == "step"
    ]
    assert max(b - a for a, b in itertools.pairwise(times)) >= 6
    assert f"cut ({mode})" in (out / "logs" / "wan.log").read_text()
