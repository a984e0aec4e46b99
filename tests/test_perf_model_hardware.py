"""The performance model's host work from a site's hardware, its stated validated range,
and the Streaming DiLoCo paper's simulation table from the paper's own inputs."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
from pathlib import Path

import pytest
from test_cli import in_process

from isthmus.deploy.cli.sim import VALIDATED, job_scenario, validated_range
from isthmus.sim import hardware
from isthmus.sim.perf_model import Scenario, exchange_cost, predict_run, uniform_links

ROOT = Path(__file__).resolve().parent.parent
ISSUE_EXAMPLE = [
    "sim", "--params", "1e9", "--sites", "2", "--step-ms", "100", "--rtt-ms", "10",
    "--strategy", "streaming", "--sync-every", "100", "--fragments", "8",
    "--overlap-steps", "1", "--codec", "int4", "--efficiency", "1", "--json",
]  # fmt: skip


def benchmark(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def test_a_gpu_sites_host_work_comes_from_its_hardware_and_says_what_was_measured():
    h200, h100, cpu = (hardware.site_hardware(n) for n in ("h200", "h100", "cpu"))
    # Measured on the H200 (docs/benchmarks.md, GPU sites): outer step and PCIe copies.
    assert h200.outer_step_s_per_value == pytest.approx(16.5e-12)
    assert h200.host_link_bytes_per_s == pytest.approx(54.7e9)
    assert any("outer step" in m for m in h200.measured)
    # The blockwise codecs as the H200 ran them (2^28 values, less the pinned
    # copies); other GPUs take those times unscaled (mostly host work); the float
    # codecs still come from their kernels' bytes at the memory bandwidth.
    assert h200.codec_bytes_per_s("int8") == pytest.approx(4 / ((47.19e-3 - 10.2e-3) / 2**28))
    assert h100.codec_s_per_value["int4"] == h200.codec_s_per_value["int4"]
    assert h200.codec_bytes_per_s("bf16") == pytest.approx(4 / (12 / 4.033e12))
    assert any("codecs int8, int4, int2" in m for m in h200.measured)
    assert any("codecs fp16 and bf16" in a for a in h200.assumed)
    # An H100 is scaled from it by memory bandwidth, and says so.
    assert h100.outer_step_s_per_value == pytest.approx(16.5e-12 * 4.8 / 3.35)
    assert any("scaled by memory bandwidth" in a for a in h100.assumed)
    # The CPU sites of an emulated run keep the rates measured on this machine.
    assert cpu.codec_bytes_per_s("int8") == hardware.CPU_CODEC_BYTES_PER_S
    assert cpu.host_link_bytes_per_s == float("inf")
    with pytest.raises(KeyError):
        hardware.site_hardware("tpu")


def test_a_billion_parameters_on_gpus_is_bound_by_the_wire_not_by_cpu_host_work(capsys):
    """The issue's example: with a CPU's codec and outer step scaled to 1e9 values the
    model put about 28 ms of every 100 ms step in exposed host work, at any bandwidth."""
    utilisation = {}
    for gbit in (1, 10, 100):
        code, stdout, stderr = in_process(
            capsys, *ISSUE_EXAMPLE, "--bandwidth-mbit", str(gbit * 1000)
        )
        assert code == 0, stderr
        out = json.loads(stdout)
        utilisation[gbit] = next(
            p["utilization"] for p in out["predictions"] if p["strategy"] == "streaming"
        )
        assert out["scenario"]["host_work"]["hardware"] == "h100"
    assert utilisation[10] >= 0.95 and utilisation[100] >= 0.95
    assert utilisation[100] - utilisation[10] < 0.01  # nothing left for bandwidth to remove
    assert utilisation[1] < 0.9  # at 1 Gbit/s a fragment's 65 MB outlasts a step
    code, stdout, _ = in_process(
        capsys, *ISSUE_EXAMPLE, "--bandwidth-mbit", "10000", "--gpu", "h200"
    )
    host = json.loads(stdout)["scenario"]["host_work"]
    assert host["hardware"] == "h200" and any("outer step" in m for m in host["measured"])


def two_sites(bandwidth_mbit: float, **changes) -> Scenario:
    """Two sites of a 1e6-parameter model (4 MB) on one link without latency."""
    sites = ["a", "b"]
    links = uniform_links(sites, bandwidth_mbit=bandwidth_mbit, rtt_ms=0)
    return Scenario(params=1e6, tokens_per_step=1.0, sites=sites, links=links, **changes)


def test_device_host_copies_overlap_the_wire():
    base = two_sites(80, step_s=0.1)
    wire = exchange_cost(base, 4e6).wire_s  # 4 MB at 10 MB/s: 0.4 s
    assert wire == pytest.approx(0.4)
    slow_copies = dataclasses.replace(base, host_link_bytes_per_s=4e6)  # 1 s of copies
    assert exchange_cost(slow_copies, 4e6).wire_s == pytest.approx(1.0)
    fast_copies = dataclasses.replace(base, host_link_bytes_per_s=4e9)
    assert exchange_cost(fast_copies, 4e6).wire_s == pytest.approx(wire)


def test_an_outer_exchange_may_overlap_the_backward_pass_as_published_simulators_assume():
    base = two_sites(8, step_s=0.3, strategy="diloco", sync_every=10)  # 4 s per exchange
    after_the_step = predict_run(base)
    during_backward = predict_run(dataclasses.replace(base, outer_overlaps_backward=True))
    assert after_the_step.round_s - during_backward.round_s == pytest.approx(2 / 3 * 0.3)


def test_an_emulated_job_keeps_this_machines_cpu_host_work():
    scenario = job_scenario(ROOT / "deploy/examples/three-continents.yaml", 0.1)
    assert scenario.host_hardware == "cpu"
    assert scenario.codec_bytes_per_s == hardware.cpu_site().codec_bytes_per_s(scenario.codec)
    assert scenario.outer_step_s == pytest.approx(0.003 * scenario.params / 471_000)
    assert scenario.host_link_bytes_per_s == float("inf")


def test_the_validated_range_is_stated_and_what_lies_outside_is_named(capsys):
    inside = job_scenario(ROOT / "deploy/examples/three-continents.yaml", 0.1)
    assert validated_range(inside)["outside"] == []
    code, stdout, _ = in_process(
        capsys, "sim", "deploy/examples/three-continents.yaml", "--step-ms", "100"
    )
    assert code == 0 and "within the validated range: validated for 2-4 sites" in stdout
    code, stdout, _ = in_process(capsys, *ISSUE_EXAMPLE, "--bandwidth-mbit", "1000")
    outside = json.loads(stdout)["validation"]["outside"]
    assert outside == [
        "links of 1000 Mbit/s",
        "links of 10 ms",
        "1e+09 parameters",
        "host work on h100 (modelled, not validated)",
    ]
    many = dataclasses.replace(inside, sites=[f"s{i}" for i in range(6)], site_ranks=4)
    named = validated_range(many)["outside"]
    assert "6 sites" in named and "4 data-parallel ranks per site" in named


def test_the_validated_range_is_what_the_validation_benchmark_runs():
    validation = benchmark("perf_model_cases")  # the runs perf_model_validation.py makes
    cases = [c for cases in validation.SETS.values() for c in cases]
    rates = [c.bandwidth_mbit for c in cases] + [link[2] for c in cases for link in c.links]
    rtts = [c.rtt_ms for c in cases] + [link[3] for c in cases for link in c.links]
    assert VALIDATED["sites"] == (min(c.sites for c in cases), max(c.sites for c in cases))
    ranks = [r for c in cases for r in c.site_ranks]
    assert VALIDATED["ranks_per_site"] == (min(ranks), max(ranks))
    assert VALIDATED["bandwidth_mbit"] == (min(rates), max(rates))
    assert VALIDATED["rtt_ms"] == (min(rtts), max(rtts))
    held_out = validation.HELD_OUT
    assert len(held_out) >= 12 and sum(any(r > 1 for r in c.site_ranks) for c in held_out) >= 6
    assert {c.strategy for c in held_out} == {"sync", "diloco", "streaming", "async"}
    used = (
        validation.FIT
        + validation.DIAGNOSED
        + validation.SECOND_DIAGNOSIS
        + validation.THIRD_DIAGNOSIS
    )
    assert not set(held_out) & set(used)


def test_the_streaming_diloco_papers_table_from_the_papers_inputs_within_25_percent():
    rows = benchmark("published_comparison").streaming_diloco_table()
    assert len(rows) == 15  # 1B, 10B, 100B x five methods, the 95% column
    for row in rows:
        assert row["within"], row
