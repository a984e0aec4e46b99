"""The hierarchical step across real sites: processes, Gloo groups, gRPC lanes.

A 1-rank site and a 2-rank site average gradients every step; the result must
match one process training on the union of their batches, and the 2-rank site's
ranks must carry equal WAN shares.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from isthmus.deploy.jobfile import load_job
from isthmus.deploy.site_worker import reference_training
from isthmus.inter.lanes import MAX_LANES, lane_count, lane_owner, owned_lanes
from isthmus.intra.launch import free_port, launch_ranks

STEPS, BATCH, LR, SEED, CORPUS = 4, 4, 0.05, 3, 300_000


def test_lanes_deal_every_rank_an_equal_share():
    assert lane_count([1, 2]) == 2
    assert lane_count([2, 3]) == 6
    lanes = lane_count([2, 3, 4])
    for dp in (2, 3, 4):
        owned = [owned_lanes(r, dp, lanes) for r in range(dp)]
        assert sorted(lane for o in owned for lane in o) == list(range(lanes))
        assert len({len(o) for o in owned}) == 1
        for r, o in enumerate(owned):
            assert all(lane_owner(lane, dp, lanes) == r for lane in o)
    with pytest.raises(ValueError, match="divide each other"):
        lane_count([61, 67, 71])
    assert MAX_LANES >= 64


def _run_sites(tmp_path, sites: dict[str, int], parallel: dict[str, str] | None = None) -> dict:
    lines = ["name: hier", "sites:"]
    for name, ranks in sites.items():
        extra = f", parallel: {parallel[name]}" if parallel and name in parallel else ""
        lines.append(
            f"  - {{name: {name}, ranks: {ranks}, address: 127.0.0.1:{free_port()}{extra}}}"
        )
    job = tmp_path / "job.yaml"
    job.write_text("\n".join(lines) + "\n")
    args = ["--job", str(job), "--out", str(tmp_path), "--steps", str(STEPS)]
    args += ["--batch", str(BATCH), "--lr", str(LR), "--seed", str(SEED)]
    args += ["--corpus-bytes", str(CORPUS)]
    procs = []
    for name, ranks in sites.items():
        command = [sys.executable, "-m", "isthmus.deploy.site_worker", "--site", name, *args]
        if ranks == 1:
            procs.append(subprocess.Popen(command, stderr=subprocess.PIPE))
        else:
            procs += launch_ranks(command, ranks, stderr=subprocess.PIPE)
    for p in procs:
        _, err = p.communicate(timeout=240)
        assert p.returncode == 0, err.decode()[-2000:]
    reports = {}
    for path in tmp_path.glob("*-*.json"):
        report = json.loads(path.read_text())
        reports[f"{report['site']}-{report['rank']}"] = report
    return {"job": load_job(job), "reports": reports, "dir": tmp_path}


@pytest.mark.parametrize(
    "parallel",
    [None, {"b": "{dp_shard: 2}"}],
    ids=["replicas", "fsdp2"],
)
def test_one_and_two_rank_sites_match_a_single_process(tmp_path, parallel):
    """The 2-rank site as two replicas (in-site reduce-scatter of their own
    gradients), or as one FSDP2-sharded model (sharded DTensor gradients)."""
    run = _run_sites(tmp_path, {"a": 1, "b": 2}, parallel)
    reference = reference_training(
        run["job"], steps=STEPS, batch=BATCH, lr=LR, seed=SEED, size="tiny", corpus_bytes=CORPUS
    ).state_dict()
    for site in ("a", "b"):
        got = torch.load(tmp_path / f"{site}.pt", weights_only=True)
        for name, value in reference.items():
            torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)
    # Identical on both sites, bit for bit.
    a, b = (torch.load(tmp_path / f"{s}.pt", weights_only=True) for s in ("a", "b"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    reports = run["reports"]
    assert reports["a-0"]["lanes"] == [0, 1]
    assert reports["b-0"]["lanes"] == [0] and reports["b-1"]["lanes"] == [1]
    shares = [reports["b-0"]["wan_values"], reports["b-1"]["wan_values"]]
    assert max(shares) <= 1.25 * min(shares)
    assert reports["a-0"]["wan_values"] == sum(shares)
