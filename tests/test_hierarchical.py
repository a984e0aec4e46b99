"""The hierarchical step across real sites: processes, Gloo groups, gRPC lanes.

A 1-rank site and a 2-rank site average gradients every step; the result must
match one process training on the union of their batches, and the 2-rank site's
ranks must carry equal WAN shares.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from site_worker import Recipe, load_site_parameters, reference_training
from warm_popen import popen

from isthmus.inter.lanes import MAX_LANES, lane_count, lane_owner, owned_lanes
from isthmus.intra.launch import launch_ranks
from isthmus.job.file import free_port_blocks, load_job

SITE_WORKER = Path(__file__).resolve().parents[1] / "benchmarks" / "site_worker.py"

STEPS, BATCH, LR, SEED, CORPUS = 4, 4, 0.05, 3, 300_000
RECIPE = Recipe(seed=SEED, size="tiny", corpus_bytes=CORPUS, batch=BATCH)
CLIP = 0.5


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


def _run_sites(
    tmp_path,
    sites: dict[str, int],
    parallel: dict[str, str] | None = None,
    *,
    steps: int = STEPS,
    extra: tuple[str, ...] = (),
) -> dict:
    lines = ["name: hier", "sites:"]
    bases = free_port_blocks("127.0.0.1", list(sites.values()))
    for (name, ranks), base in zip(sites.items(), bases, strict=True):
        layout = f", parallel: {parallel[name]}" if parallel and name in parallel else ""
        lines.append(f"  - {{name: {name}, ranks: {ranks}, address: 127.0.0.1:{base}{layout}}}")
    job = tmp_path / "job.yaml"
    job.write_text("\n".join(lines) + "\n")
    args = ["--job", str(job), "--out", str(tmp_path), "--steps", str(steps), *extra]
    args += ["--batch", str(BATCH), "--lr", str(LR), "--seed", str(SEED)]
    args += ["--corpus-bytes", str(CORPUS)]
    procs = []
    for name, ranks in sites.items():
        command = [sys.executable, str(SITE_WORKER), "--site", name, *args]
        if ranks == 1:
            procs.append(popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
        else:
            procs += launch_ranks(
                command, ranks, spawn=popen, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
            )
    failures = []
    for p in procs:
        _, err = p.communicate(timeout=240)
        if p.returncode != 0:
            failures.append(
                f"{' '.join(p.args[3:6])} exited {p.returncode}:\n{err.decode()[-1500:]}"
            )
    # Every failing rank, not just the first: a site that crashes makes its
    # peers fail later with a mere "connection closed".
    assert not failures, "\n\n".join(failures)
    reports = {}
    for path in tmp_path.glob("*-*.json"):
        report = json.loads(path.read_text())
        reports[f"{report['site']}-{report['rank']}"] = report
    return {"job": load_job(job), "reports": reports, "dir": tmp_path}


CASES = {
    # The 2-rank site as two replicas: the in-site reduce-scatter averages
    # their own gradients.
    "replicas": ({"a": 1, "b": 2}, {}),
    # One FSDP2-sharded model: sharded DTensor gradients, averaged by FSDP.
    "fsdp2": ({"a": 1, "b": 2}, {"b": "{dp_shard: 2}"}),
    # Tensor parallel in both sites: each tensor rank pairs with its counterpart.
    "tp": ({"a": 2, "b": 2}, {"a": "{tp: 2}", "b": "{tp: 2}"}),
    # Two pipeline stages in both sites, two microbatches per step.
    "pp": ({"a": 2, "b": 2}, {"a": "{pp: 2}", "b": "{pp: 2}"}),
}


# Tensor parallel composed with FSDP2 in a 4-rank site, next to a 2-rank
# tensor-parallel site: 6 processes, so with the slow tests.
CASES["tp+fsdp2"] = ({"a": 2, "b": 4}, {"a": "{tp: 2}", "b": "{dp_shard: 2, tp: 2}"})


@pytest.mark.parametrize(
    "case",
    # Replicas stay in the fast set; the other layouts are slow (15-20 s each).
    [c if c == "replicas" else pytest.param(c, marks=pytest.mark.slow) for c in CASES],
)
def test_sites_of_any_shape_match_a_single_process(tmp_path, case):
    """With the averaged gradient clipped to a norm it exceeds: the norm must be the
    whole model's, summed over pipeline stages and DTensor shards."""
    sites, parallel = CASES[case]
    run = _run_sites(tmp_path, sites, parallel, extra=("--grad-clip", str(CLIP)))
    reference = reference_training(
        run["job"], RECIPE, steps=STEPS, lr=LR, grad_clip=CLIP
    ).state_dict()
    trained = {site: load_site_parameters(tmp_path, site) for site in sites}
    for site, got in trained.items():
        assert set(got) == set(reference), site
        for name, value in reference.items():
            torch.testing.assert_close(got[name], value, rtol=1e-5, atol=2e-6, msg=name)
    # Identical on both sites, bit for bit.
    assert all(torch.equal(trained["a"][k], trained["b"][k]) for k in reference)
    reports = run["reports"]
    # Every rank of every site saw the whole model's norm (FSDP shards sum its
    # squares in another order: equal to ~1e-16), above the limit: it clipped.
    norms = [r["grad_norms"] for r in reports.values()]
    assert all(n == pytest.approx(norms[0], rel=1e-12) for n in norms), norms
    assert min(norms[0]) > CLIP
    # Within each site, every rank carries the same share of the WAN traffic.
    for site in sites:
        shares = [r["wan_values"] for key, r in reports.items() if key.startswith(f"{site}-")]
        assert min(shares) > 0 and max(shares) <= 1.25 * min(shares), (site, shares)


def test_a_one_rank_site_owns_every_lane_of_a_two_rank_site(tmp_path):
    run = _run_sites(tmp_path, {"a": 1, "b": 2}, {})
    reports = run["reports"]
    assert reports["a-0"]["lanes"] == [0, 1]
    assert reports["b-0"]["lanes"] == [0] and reports["b-1"]["lanes"] == [1]
    assert reports["a-0"]["wan_values"] == reports["b-0"]["wan_values"] * 2


@pytest.mark.slow
def test_checkpoint_and_resume_continue_bit_for_bit(tmp_path):
    """An FSDP2 site and a one-rank site stop after 2 steps and resume to 4:
    the same parameters, bit for bit, as 4 steps without a stop."""
    sites, parallel = {"a": 1, "b": 2}, {"b": "{dp_shard: 2}"}
    straight = tmp_path / "straight"
    straight.mkdir()
    _run_sites(straight, sites, parallel, steps=4)
    stopped = tmp_path / "stopped"
    stopped.mkdir()
    checkpoints = ("--checkpoint-dir", str(tmp_path / "checkpoints"))
    _run_sites(stopped, sites, parallel, steps=2, extra=checkpoints)
    assert sorted(p.name for p in (tmp_path / "checkpoints" / "b").iterdir()) == [
        "step-000001",
        "step-000002",
    ]
    _run_sites(stopped, sites, parallel, steps=4, extra=checkpoints)
    for site in sites:
        a, b = load_site_parameters(straight, site), load_site_parameters(stopped, site)
        assert all(torch.equal(a[k], b[k]) for k in a), site


@pytest.mark.parametrize(
    ("case", "parallel"),
    [
        ("fsdp2", {"b": "{dp_shard: 2}"}),
        pytest.param("tp", {"a": "{tp: 2}", "b": "{tp: 2}"}, marks=pytest.mark.slow),
    ],
)
def test_a_users_own_model_and_data_by_import_path(tmp_path, case, parallel):
    module = "isthmus.deploy.examples.custom_model"
    sites = {"a": 1, "b": 2} if case == "fsdp2" else {"a": 2, "b": 2}
    extra = ("--model", f"{module}:model", "--data", f"{module}:data")
    run = _run_sites(tmp_path, sites, parallel, extra=extra)
    recipe = Recipe(
        seed=SEED, batch=BATCH, model_import=f"{module}:model", data_import=f"{module}:data"
    )
    reference = reference_training(run["job"], recipe, steps=STEPS, lr=LR).state_dict()
    for site in sites:
        got = load_site_parameters(tmp_path, site)
        for name, value in reference.items():
            torch.testing.assert_close(got[name], value, rtol=1e-5, atol=2e-6, msg=name)
