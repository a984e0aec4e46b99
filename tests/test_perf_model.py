"""The performance model's formulas against hand-computed cases, and ``isthmus sim``."""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from test_cli import in_process

from isthmus.sim.cost import LinkCost
from isthmus.sim.perf_model import (
    Scenario,
    ScenarioError,
    all_reduce_seconds,
    exchange_cost,
    exchange_seconds,
    expected_largest_normal,
    predict_run,
    step_seconds_from_flops,
    uniform_links,
)

SITES = ["a", "b"]
# 80 Mbit/s = 10 MB/s, 100 ms RTT = 50 ms one way.
LINKS = uniform_links(SITES, bandwidth_mbit=80, rtt_ms=100)


def scenario(**changes) -> Scenario:
    base = {
        "params": 1e6,  # 4 MB of float32
        "step_s": 0.1,
        "tokens_per_step": 1000.0,
        "sites": SITES,
        "links": LINKS,
        "sync_every": 10,
        "fragments": 2,
        "overlap_steps": 1,
    }
    return Scenario(**{**base, **changes})


def test_an_exchange_costs_wire_plus_latencies_plus_overhead():
    # Direct, 2 sites: each phase puts N/2 = 2 MB on the link (0.2 s) plus 50 ms;
    # two phases: 0.4 + 0.1 = 0.5 s (the acknowledgements come back after the round).
    assert all_reduce_seconds(scenario(), 4e6, "direct") == pytest.approx(0.5)
    # Gather, the pick: the same 4 MB in one trip, 0.4 + 0.05 s.
    seconds, algorithm = exchange_seconds(scenario(), 4e6)
    assert algorithm == "gather" and seconds == pytest.approx(0.45)
    # Efficiency divides the bandwidth part only; overhead adds once.
    slower, _ = exchange_seconds(scenario(efficiency=0.5, exchange_overhead_s=0.02), 4e6)
    assert slower == pytest.approx(0.8 + 0.05 + 0.02)
    # A codec shrinks the bytes and adds its own time: 4 MB of float32 at 4 MB/s for
    # direct's three encodes and decodes of the vector; gather, the pick, does four
    # (its contribution and the result encoded, the other's and the result decoded).
    int8, algorithm = exchange_seconds(
        scenario(codec="int8", codec_bytes_per_s=4e6), 1e6 * (1 + 4 / 256)
    )
    assert algorithm == "gather"
    assert int8 == pytest.approx(1.015625e6 / 1e7 + 0.05 + 1.0 * 4 / 3)


def test_gather_decodes_every_other_sites_contribution():
    """Codec work relative to direct's three encodes and decodes: gather's S + 2."""
    sites = ["a", "b", "c"]
    links = uniform_links(sites, bandwidth_mbit=80, rtt_ms=100)
    s = scenario(sites=sites, links=links, codec="int8", codec_bytes_per_s=4e6)
    values = {"gather": 25_000, "direct": 2_500_000}  # 0.1 MB: one trip; 10 MB: two
    for algorithm, work in (("gather", 5 / 3), ("direct", 1.0)):
        n = values[algorithm]
        cost = exchange_cost(s, n * (1 + 4 / 256))
        assert cost.algorithm == algorithm
        assert cost.host_s == pytest.approx(4 * n / 4e6 * work)


def test_the_ring_is_chosen_when_it_avoids_a_slow_link():
    sites = ["a", "b", "c"]
    fast, slow = LinkCost.of(bandwidth_mbit=800, rtt_ms=2), LinkCost.of(bandwidth_mbit=8, rtt_ms=2)
    links = {
        frozenset("ab"): fast,
        frozenset("bc"): fast,
        frozenset("ac"): slow,  # the ring a->b->c->a still uses it; direct does too
    }
    _, algorithm = exchange_seconds(scenario(sites=sites, links=links), 30e6)
    assert algorithm == "direct"  # both touch a-c; direct moves less over it


def test_strategies_by_hand():
    x = 0.45  # the exchange of the whole model, as above (gather)
    sync = predict_run(scenario(strategy="sync"))
    # One 25 MiB bucket holds the whole 4 MB model: nothing overlaps.
    assert sync.step_s == pytest.approx(0.1 + x)
    assert sync.utilization == pytest.approx(0.1 / (0.1 + x))
    bucketed = predict_run(scenario(strategy="sync", bucket_bytes=1e6))
    hidden = 2 / 3 * 0.1 * (1 - 1e6 / 4e6)
    assert bucketed.step_s == pytest.approx(0.1 + x - hidden)
    diloco = predict_run(scenario(strategy="diloco"))
    vote, _ = exchange_seconds(scenario(), 64.0)
    # The vote and the data cross together: one exchange's time, not two.
    assert diloco.round_s == pytest.approx(10 * 0.1 + max(vote, x))
    assert diloco.utilization == pytest.approx(1.0 / diloco.round_s)
    # Async hides the exchange behind the next round's 1 s of compute.
    assert predict_run(scenario(strategy="async")).utilization == pytest.approx(1.0)
    # Streaming: 2 fragments of 2 MB, each exposed beyond one step of overlap.
    part, _ = exchange_seconds(scenario(), 2e6)
    streaming = predict_run(scenario(strategy="streaming"))
    assert streaming.round_s == pytest.approx(1.0 + 2 * (part - 0.1))
    # Bytes: every site sends the model once per exchange (2 sites: gather's S - 1
    # and direct's 2 (S-1)/S are the same).
    assert diloco.wan_bytes_per_token == pytest.approx(2 * 4e6 / (10 * 1000))
    assert sync.wan_bytes_per_token == pytest.approx(2 * 4e6 / 1000)


def test_a_run_of_given_length_pays_its_final_synchronisation_by_hand():
    """isthmus run measures the whole run: the rounds that fit in it and the final
    synchronisation every run ends with; a short run pays it over fewer steps."""
    x = 0.45  # the exchange of the whole model, as above (gather)
    vote, _ = exchange_seconds(scenario(), 64.0)
    # DiLoCo, 25 steps at H=10: 2 rounds, then a last round for the 5 steps left,
    # each with its vote beside its data; the first round's vote went first.
    diloco = predict_run(scenario(strategy="diloco", steps=25))
    wall = 25 * 0.1 + 2 * max(vote, x) + max(vote, x) + vote
    assert diloco.step_s == pytest.approx(wall / 25)
    assert diloco.utilization == pytest.approx(25 * 0.1 / wall)
    # A multiple of H ends on a round: the steady state and the first vote.
    steady = predict_run(scenario(strategy="diloco"))
    thirty = predict_run(scenario(strategy="diloco", steps=30))
    assert thirty.step_s == pytest.approx(steady.step_s + vote / 30)
    # Sync: one more exchange of the model after the last step.
    sync = predict_run(scenario(strategy="sync", steps=20))
    assert sync.step_s == pytest.approx((20 * (0.1 + x) + x) / 20)
    # Async, 20 steps at H=10: its last send has no round after it to hide behind.
    run = predict_run(scenario(strategy="async", steps=20))
    assert run.step_s == pytest.approx((20 * 0.1 + x) / 20)
    # Streaming: a fragment every 5 steps, then every fragment once more, blocking.
    part, _ = exchange_seconds(scenario(), 2e6)
    streaming = predict_run(scenario(strategy="streaming", steps=20))
    assert streaming.step_s == pytest.approx((20 * 0.1 + 4 * (part - 0.1) + x) / 20)
    # Long runs tend to the steady state.
    long = predict_run(scenario(strategy="streaming", steps=100_000))
    assert long.step_s == pytest.approx(
        predict_run(scenario(strategy="streaming")).step_s, rel=1e-4
    )
    with pytest.raises(ScenarioError, match="steps"):
        scenario(steps=0)


def test_the_slowest_site_sets_the_pace_of_every_round():
    """Rounds need every site: a site computing at 0.12 s per step holds the others,
    whose compute (0.1 s) is then a smaller share of the round. By gather (the pick
    here, 0.45 s) the other's contribution reaches the slow site while it computes:
    rounds repeat every max(its compute, half the cycle through both sites), so
    half the other's lead, 10 x 0.02 / 2 s, hides wire."""
    x = 0.45
    vote, _ = exchange_seconds(scenario(), 64.0)
    diloco = predict_run(scenario(strategy="diloco", slowest_step_s=0.12))
    assert diloco.algorithm == "gather"
    assert diloco.round_s == pytest.approx(10 * 0.12 + max(vote, x) - 0.1)
    assert diloco.utilization == pytest.approx(10 * 0.1 / diloco.round_s)
    sync = predict_run(scenario(strategy="sync", slowest_step_s=0.12))
    assert sync.step_s == pytest.approx(0.12 + x - 0.01)
    assert sync.utilization == pytest.approx(0.1 / (0.12 + x - 0.01))
    # Where the runner-up is as slow, nothing hides.
    both = predict_run(scenario(strategy="diloco", slowest_step_s=0.12, runner_up_step_s=0.12))
    assert both.round_s == pytest.approx(10 * 0.12 + max(vote, x))
    # A lead longer than the wire leaves the slow site only its host work.
    far = predict_run(scenario(strategy="diloco", slowest_step_s=0.2, exchange_overhead_s=0.01))
    assert far.round_s == pytest.approx(10 * 0.2 + 0.01)
    # Direct sends each slice back through its owner after the last contribution:
    # 80 MB among three sites goes by direct (two trips, 2/3 of it each way).
    three = ["a", "b", "c"]
    big = scenario(
        strategy="diloco",
        params=20e6,
        slowest_step_s=0.12,
        sites=three,
        links=uniform_links(three, bandwidth_mbit=80, rtt_ms=100),
    )
    direct = predict_run(big)
    assert direct.algorithm == "direct"
    assert direct.round_s == pytest.approx(
        10 * 0.12 + all_reduce_seconds(big, big.wan_bytes, "direct")
    )
    same = predict_run(scenario(strategy="diloco", slowest_step_s=0.1))
    assert same == predict_run(scenario(strategy="diloco"))
    with pytest.raises(ScenarioError) as caught:
        scenario(slowest_step_s=0.05)
    assert caught.value.field == "slowest_step_s"
    with pytest.raises(ScenarioError) as caught:
        scenario(slowest_step_s=0.12, runner_up_step_s=0.13)
    assert caught.value.field == "runner_up_step_s"


def test_the_expected_largest_of_normal_values():
    # Closed forms: 1/sqrt(pi) for two values, 3/(2 sqrt(pi)) for three.
    assert expected_largest_normal(1) == 0.0
    assert expected_largest_normal(2) == pytest.approx(1 / math.sqrt(math.pi), rel=1e-6)
    assert expected_largest_normal(3) == pytest.approx(3 / (2 * math.sqrt(math.pi)), rel=1e-6)
    assert expected_largest_normal(4) == pytest.approx(1.0294, abs=1e-4)  # tables


def test_every_synchronisation_waits_for_the_last_site():
    """A site's step varying by sigma = 20 ms: H = 16 steps after the sites last met,
    the last of two arrives 20 ms x 4 / sqrt(pi) after the average one."""
    sigma, late16 = 0.02, 0.02 * 4 / math.sqrt(math.pi)
    steady = predict_run(scenario(strategy="diloco", sync_every=16))
    jittery = predict_run(scenario(strategy="diloco", sync_every=16, step_jitter_s=sigma))
    assert jittery.round_s == pytest.approx(steady.round_s + late16)
    assert jittery.utilization == pytest.approx(16 * 0.1 / jittery.round_s)
    # Sync meets every step: late(1) = sigma / sqrt(pi), in every step.
    sync = predict_run(scenario(strategy="sync", step_jitter_s=sigma))
    no_jitter = predict_run(scenario(strategy="sync"))
    assert sync.step_s == pytest.approx(no_jitter.step_s + sigma / math.sqrt(math.pi))
    # Streaming meets at every fragment, H / P = 8 steps apart; its overlap hides the
    # lateness with the wire: exposed = max(0, late(8) + W - tau t) + C per fragment.
    part = exchange_cost(scenario(), 2e6, outer=0.5)
    for tau in (1, 4):
        streaming = predict_run(
            scenario(strategy="streaming", sync_every=16, overlap_steps=tau, step_jitter_s=sigma)
        )
        late8 = sigma * math.sqrt(8) / math.sqrt(math.pi)
        exposed = max(0.0, late8 + part.wire_s - tau * 0.1) + part.host_s
        assert streaming.round_s == pytest.approx(16 * 0.1 + 2 * exposed)
    # One site waits for no one.
    alone = scenario(sites=["a"], links={}, step_jitter_s=sigma)
    assert alone.late_s(100) == 0.0


def test_flops_and_bad_scenarios_are_named():
    assert step_seconds_from_flops(1e9, 1000, "h100", 0.5) == pytest.approx(6e12 / (989e12 * 0.5))
    for changes, name in [
        ({"sync_every": 0}, "sync_every"),
        ({"strategy": "fast"}, "strategy"),
        ({"params": 0}, "params"),
        ({"fragments": 20}, "fragments"),
        ({"codec": "int3"}, "codec"),
        ({"step_jitter_s": -0.01}, "step_jitter_ms"),
    ]:
        with pytest.raises(ScenarioError) as caught:
            scenario(**changes)
        assert caught.value.field == name
    with pytest.raises(ScenarioError, match="bandwidth_mbit"):
        uniform_links(SITES, bandwidth_mbit=0, rtt_ms=10)
    with pytest.raises(ScenarioError, match="gpu"):
        step_seconds_from_flops(1e9, 1, "tpu", 0.5)


def isthmus(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "isthmus", *args], capture_output=True, text=True, timeout=120
    )


def test_sim_command_for_a_job_and_for_flags(capsys):
    code, stdout, stderr = in_process(
        capsys, "sim", "deploy/examples/three-continents.yaml", "--step-ms", "100", "--json"
    )
    assert code == 0, stderr
    out = json.loads(stdout)
    assert [p["strategy"] for p in out["predictions"]] == ["sync", "diloco", "streaming", "async"]
    assert out["scenario"]["sites"] == ["us-east", "eu-west", "asia-east"]
    assert out["scenario"]["sync_every"] == 10 and out["validated_range"] == ""
    assert out["scenario"]["step_jitter_s"] == 0.0
    code, stdout, stderr = in_process(
        capsys, "sim", "deploy/examples/three-continents.yaml", "--step-ms", "100",
        "--step-jitter-ms", "10", "--json",
    )  # fmt: skip
    assert code == 0, stderr
    slower = json.loads(stdout)
    assert slower["scenario"]["step_jitter_s"] == pytest.approx(0.01)
    for steady, late in zip(out["predictions"], slower["predictions"], strict=True):
        # Async's rounds hide the lateness with their wire behind the whole next round;
        # only the run's last send, with no round after it, waits for the last site.
        assert late["step_s"] > steady["step_s"]
        if late["strategy"] == "async":
            assert late["step_s"] - steady["step_s"] < 1e-3
    code, stdout, stderr = in_process(
        capsys, "sim", "--params", "340e9", "--sites", "2", "--gpus-per-site", "1024",
        "--gpu", "h100", "--rtt-ms", "10", "--bandwidth-mbit", "100000", "--strategy", "sync",
    )  # fmt: skip
    assert code == 0, stderr
    assert "outside the validated range" in stdout and "sync" in stdout


REGIONS = ["--rtt-ms", "8", "--bandwidth-mbit", "1000", "--between-rtt-ms", "140",
           "--between-mbit", "300"]  # fmt: skip
"""The issue's regions: 1 Gbit/s and 8 ms inside a region, 300 Mbit/s and 140 ms across."""


@pytest.mark.parametrize(("sites", "regions"), [(64, 4), (256, 16)])
def test_sim_predicts_many_sites_in_regions_and_names_the_algorithm(capsys, sites, regions):
    """64 and 256 sites, each region's long-haul 300 Mbit/s shared by its sites: the
    flat mesh pushes m (S - m) / S of the model through a region of m sites, two
    levels (K - 1) / K, so every strategy's exchange takes two levels; without
    regions the same links give the flat direct algorithm."""
    scale = ["--params", "1e9", "--sites", str(sites), "--gpu", "h100", "--json"]
    code, stdout, stderr = in_process(
        capsys, "sim", *scale, *REGIONS, "--regions", str(regions), "--egress-mbit", "300"
    )
    assert code == 0, stderr
    out = json.loads(stdout)
    assert {p["algorithm"] for p in out["predictions"]} == {"two_level"}
    bounds = out["all_reduce_bounds_s"]
    assert set(bounds) == {"direct", "gather", "ring", "two_level"}
    assert bounds["two_level"] < min(bounds["direct"], bounds["gather"], bounds["ring"])
    groups = out["scenario"]["regions"]["sites"]
    assert len(groups) == regions and {len(m) for m in groups.values()} == {sites // regions}
    assert set(out["scenario"]["regions"]["egress_mbit"].values()) == {300.0}
    code, stdout, stderr = in_process(
        capsys, "sim", *scale, "--rtt-ms", "8", "--bandwidth-mbit", "1000"
    )
    assert code == 0, stderr
    flat = json.loads(stdout)
    assert {p["algorithm"] for p in flat["predictions"]} == {"direct"}
    assert set(flat["all_reduce_bounds_s"]) == {"direct", "gather", "ring"}
    assert flat["scenario"]["regions"] is None


def test_sim_prints_the_all_reduce_and_the_regions(capsys):
    code, stdout, stderr = in_process(
        capsys, "sim", "--params", "1e9", "--sites", "64", "--gpu", "h100", *REGIONS,
        "--regions", "4", "--egress-mbit", "300",
    )  # fmt: skip
    assert code == 0, stderr
    table = [line.split() for line in stdout.splitlines()]
    assert "all-reduce" in table[1]
    assert [row[4] for row in table[2:6]] == ["two_level"] * 4  # each strategy's exchange
    assert "bounds: direct" in stdout and "two_level" in stdout.split("bounds:")[1]
    assert "regions: 4 of 16 sites, long-haul 300 Mbit/s each way" in stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--params", "1e9", "--sites", "2", "--step-ms", "10"], "--bandwidth-mbit: give --rtt-ms"),
        (
            ["--params", "1e9", "--sites", "8", "--step-ms", "10", *REGIONS, "--regions", "9"],
            "--regions: must be in 1..8 (the sites), got 9",
        ),
        (
            ["deploy/examples/two-sites.yaml", "--step-ms", "10", "--regions", "2"],
            "--regions: give --sites too",
        ),
        (
            ["--params", "1e9", "--sites", "8", "--step-ms", "10", *REGIONS, "--egress-mbit", "5"],
            "--regions: --between-rtt-ms, --between-mbit and --egress-mbit describe regions",
        ),
        (
            [
                "--params",
                "1e9",
                "--sites",
                "8",
                "--step-ms",
                "10",
                *REGIONS,
                "--regions",
                "2",
                "--egress-mbit",
                "0",
            ],
            "--egress-mbit: must be > 0",
        ),
        (
            [
                "--params",
                "1e9",
                "--sites",
                "2",
                "--step-ms",
                "10",
                "--rtt-ms",
                "10",
                "--bandwidth-mbit",
                "0",
            ],
            "--bandwidth-mbit: must be > 0",
        ),
        (["--params", "1e9", "--sites", "0", "--step-ms", "10"], "--sites: must be >= 1"),
        (
            ["deploy/examples/two-sites.yaml", "--step-ms", "10", "--step-jitter-ms", "-1"],
            "--step-jitter-ms: must be >= 0",
        ),
        (["deploy/examples/two-sites.yaml"], "--step-ms: give --step-ms"),
        (
            ["deploy/examples/two-sites.yaml", "--step-ms", "10", "--sync-every", "0"],
            "--sync-every: must be >= 1",
        ),
        (
            ["deploy/examples/two-sites.yaml", "--step-ms", "10", "--gpus-per-site", "8"],
            "--gpus-per-site: 8 GPUs per site, but the job's sites have 1 and 2 ranks",
        ),
    ],
)
def test_sim_refuses_impossible_scenarios_naming_the_flag(capsys, args, message):
    code, _, stderr = in_process(capsys, "sim", *args)
    assert code == 2
    assert message in stderr, stderr


@pytest.mark.slow
def test_sim_calibrates_the_step_with_a_short_run_of_the_job(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(
        "name: cal\nsites: [{name: a}, {name: b}]\n"
        "wan: {default: {rtt_ms: 20, bandwidth_mbit: 100}}\ntrain: {sync_every: 10}\n"
    )
    done = isthmus("sim", str(job), "--calibrate", "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert "calibrating" in done.stderr
    assert 0.001 < out["scenario"]["step_s"] < 5
    # Two processes share the cores: the steps vary, and the calibration says by how
    # much (on a loaded machine by as much as a step or more).
    assert 0 < out["scenario"]["step_jitter_s"] < 10 * out["scenario"]["step_s"]
    diloco = next(p for p in out["predictions"] if p["strategy"] == "diloco")
    assert 0 < diloco["utilization"] <= 1


RECORDED = Path(__file__).parent / "data" / "recorded-diloco-run"


def test_the_model_against_a_recorded_emulated_run():
    """A real emulated run, recorded (2 sites, 20 Mbit/s, 80 ms, DiLoCo H=20, 300 steps,
    benchmarks/tuner_grid.py): the model, given the run's own compute time per step
    and its job file, predicts its wall time per step and utilisation within 10%."""
    from isthmus.deploy.cli.sim_scenario import job_scenario
    from isthmus.deploy.launch.summary import training_figures

    summary = json.loads((RECORDED / "summary.json").read_text())
    sites = summary["sites"].values()
    step_s = statistics.median(s["compute_seconds"] / s["inner_steps"] for s in sites)
    prediction = predict_run(job_scenario(RECORDED / "job.yaml", step_s))
    figures = training_figures(RECORDED, summary).values()
    measured_step = statistics.fmean(f["step_s"] for f in figures)
    measured_utilization = statistics.fmean(f["utilization"] for f in figures)
    assert prediction.step_s == pytest.approx(measured_step, rel=0.10)
    assert prediction.utilization == pytest.approx(measured_utilization, rel=0.10)
