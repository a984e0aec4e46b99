"""One machine running every site of an emulated job: its data-plane rate bounds each
all-reduce phase (``machine_bytes_per_s``), in the cost model and in ``isthmus sim``."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
from test_cli import in_process

from isthmus.deploy.cli.sim_scenario import job_scenario
from isthmus.sim.cost import LinkCost, Regions, direct_seconds, predict, ring_seconds
from isthmus.sim.perf_model import all_reduce_seconds

ROOT = Path(__file__).resolve().parents[1]
FAST = LinkCost(1e12, 0.0)  # a link that never binds
MB = 1e6


def fast(a: str, b: str) -> LinkCost:
    return FAST


def test_each_phase_lasts_what_all_sites_send_in_it_over_the_machine():
    sites = [f"s{i}" for i in range(4)]
    n = 100 * MB
    # Direct: every site sends (S - 1) N / S in each of two phases: (S - 1) N in all.
    assert direct_seconds(n, sites, fast, machine_bytes_per_s=300 * MB) == pytest.approx(2.0)
    # The ring: every site N / S a step, 2 (S - 1) steps.
    assert ring_seconds(n, sites, fast, machine_bytes_per_s=100 * MB) == pytest.approx(6.0)
    # Unbounded (real sites): only the links.
    assert direct_seconds(n, sites, fast) == pytest.approx(2 * (n / 4) / 1e12)


def test_two_levels_inside_on_the_machine_and_across_on_the_long_links():
    sites = [f"s{i}" for i in range(6)]
    regions = Regions({s: ("a" if i < 3 else "b") for i, s in enumerate(sites)}, {})
    slow = LinkCost(10 * MB, 0.0)

    def link(x: str, y: str) -> LinkCost:
        return FAST if regions.of[x] == regions.of[y] else slow

    n = 30 * MB
    links_only = predict(n, sites, link, regions=regions)["two_level"]
    on_machine = predict(n, sites, link, regions=regions, machine_bytes_per_s=100 * MB)
    # Inside, at each end: (3 - 1) N per region, both regions at once: 120 MB at
    # 100 MB/s = 1.2 s. Across: each piece (N / 3) between two holders, N / 6 each
    # way at 10 MB/s, twice: 1 s, above the machine's 2 (K - 1) N = 60 MB: 0.6 s.
    # The reduce-scatter and the exchange across are a pipeline of 4 parts (10 MB
    # slices): the slower stage's 4 quarters and one of the other's; the gather at
    # the end is not pipelined.
    inside, across, gather = 1.2, 1.0, 1.2
    pipeline = inside / 4 + across / 4 + 3 * max(inside, across) / 4
    assert on_machine["two_level"] == pytest.approx(pipeline + gather)
    assert links_only == pytest.approx(1.0, rel=1e-3)


def test_the_sim_takes_the_machines_rate_and_refuses_a_bad_one(capsys):
    job = "deploy/examples/three-regions.yaml"
    code, stdout, stderr = in_process(
        capsys, "sim", job, "--step-ms", "100", "--machine-mbyte-s", "900", "--json"
    )
    assert code == 0, stderr
    assert json.loads(stdout)["scenario"]["machine_bytes_per_s"] == 900e6
    code, stdout, _ = in_process(capsys, "sim", job, "--step-ms", "100", "--json")
    assert json.loads(stdout)["scenario"]["machine_bytes_per_s"] is None
    code, _, stderr = in_process(capsys, "sim", job, "--step-ms", "100", "--machine-mbyte-s", "0")
    assert code == 2 and "--machine-mbyte-s: must be > 0 MB/s" in stderr


def test_a_slow_machine_slows_the_phases_inside_the_regions():
    scenario = job_scenario(ROOT / "deploy/examples/three-regions.yaml", 0.1)
    n = 32 * 2**20
    alone = all_reduce_seconds(scenario, n, "two_level")
    assert math.isinf(scenario.machine_bytes_per_s)
    slow = all_reduce_seconds(
        dataclasses.replace(scenario, machine_bytes_per_s=500e6), n, "two_level"
    )
    # Nine sites send 6 x 32 MiB inside at each end: 0.4 s each at 500 MB/s, where
    # the 1 Gbit/s links inside take under 0.1 s. The reduce-scatter hides behind
    # the exchange across (but its first part), the gather at the end does not.
    assert alone + 0.3 < slow < alone + 0.8


@pytest.mark.slow
def test_the_machines_rate_is_measured_with_the_jobs_sites_over_unbounded_links(tmp_path):
    from isthmus.deploy.bench.calibrate import machine_rate

    job = tmp_path / "job.yaml"
    job.write_text(
        "name: rate\nsites: [{name: a}, {name: b}, {name: c}]\n"
        # Slow links: the measurement must not run on them.
        "wan: {default: {rtt_ms: 200, bandwidth_mbit: 1}}\n"
    )
    rate, sites = machine_rate(job, repeats=1)
    assert sites == 3
    # 32 MiB among 3 sites: at 1 Mbit/s on the job's links a round would take minutes,
    # and the rate would read 0.1 MB/s.
    assert rate > 20e6


def test_a_machine_too_fast_to_bind_predicts_what_the_links_alone_do():
    """One formula for the engine's efficiency with and without a machine's rate: a
    rate no phase reaches changes nothing."""
    scenario = job_scenario(ROOT / "deploy/examples/three-continents.yaml", 0.1)
    for algorithm in ("direct", "ring"):
        alone = all_reduce_seconds(scenario, 8e6, algorithm)
        fast = dataclasses.replace(scenario, machine_bytes_per_s=1e30)
        assert all_reduce_seconds(fast, 8e6, algorithm) == pytest.approx(alone, rel=1e-12)
