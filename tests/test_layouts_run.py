"""Sites of different layouts through ``isthmus run``: the built-in loop built on
the meta device, each rank allocating its own part, the sites agreeing on one
starting model across layouts, and ending with one model."""

from __future__ import annotations

import json

import pytest
from test_run import explain, isthmus

JOB = """\
name: layouts
sites:
  - {name: a, ranks: 1}
  - {name: b, ranks: 2, parallel: {dp_shard: 2}}
wan:
  default: {rtt_ms: 10, bandwidth_mbit: 500}
train: {strategy: diloco, steps: 6, sync_every: 3, warmup_steps: 2}
"""


@pytest.mark.slow
def test_an_fsdp_site_beside_a_one_rank_site_trains_one_model(tmp_path):
    """b's ranks hold half of each parameter (FSDP2), a holds them whole: the
    starting model is agreed shard by shard (it once sent a's whole tensors to
    b's half-sized shards and the round failed), and both end identical."""
    job = tmp_path / "job.yaml"
    job.write_text(JOB)
    out = tmp_path / "run"
    done = isthmus("run", str(job), "--out", str(out), "--no-report", cwd=tmp_path)
    assert done.returncode == 0, done.stderr + explain(out)
    sites = json.loads((out / "summary.json").read_text())["sites"]
    assert len({s["param_sha256"] for s in sites.values()}) == 1, sites
    assert all(s["inner_steps"] == 6 for s in sites.values())
