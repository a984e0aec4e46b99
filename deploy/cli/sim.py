"""``isthmus sim``: predict a job's step time, utilisation and WAN bytes for every strategy."""

from __future__ import annotations

import argparse
import math
from typing import Any

from isthmus.deploy.cli.sim_scenario import (
    DEFAULT_FABRIC_GBIT,
    DEFAULT_GPU,
    EMULATED_ENGINE_EFFICIENCY,
    ENGINE_EFFICIENCY,
    codec_for,
    job_scenario,
    scenario_from,
)
from isthmus.deploy.usage import UsageError, accept_command, add_command
from isthmus.job.basics import to_json
from isthmus.job.file import load_job
from isthmus.sim.cost import predict
from isthmus.sim.hardware import site_hardware
from isthmus.sim.perf_model import (
    CODEC_BYTES_PER_VALUE,
    GPU_FLOPS,
    STRATEGIES,
    Scenario,
    ScenarioError,
    predict_run,
)

__all__ = ["VALIDATED", "job_scenario", "range_note", "register", "validated_range"]


def register(commands: Any) -> None:
    sim = add_command(
        commands,
        "sim",
        _sim,
        help="predict step time, compute utilisation and WAN bytes per token for each strategy",
    )
    sim.add_argument("job", metavar="JOB.yaml", nargs="?", help="the job (or give flags only)")
    sim.add_argument("--json", action="store_true", help="print JSON")
    # isthmus sim JOB --calibrate -- python train.py: the calibration runs the script.
    accept_command(sim)
    what = sim.add_argument_group("scenario (overrides the job file)")
    what.add_argument("--params", type=float, help="model parameters, e.g. 340e9")
    what.add_argument("--sites", type=int, help="number of sites")
    what.add_argument(
        "--gpus-per-site", type=int, help="GPUs (ranks) per site, without a job file (default 1)"
    )
    what.add_argument(
        "--gpu",
        choices=sorted(GPU_FLOPS),
        help="the sites' accelerator: their host work (codec, device-host copies, outer step) "
        f"at its speeds (default {DEFAULT_GPU}; an emulated job's is this machine's cpu), and "
        "the compute per step from FLOPs at --mfu unless --step-ms or --calibrate gives it",
    )
    what.add_argument("--mfu", type=float, default=0.4, help="with --gpu (default 0.4)")
    what.add_argument(
        "--tokens-per-gpu", type=float, default=4096 * 2, help="tokens per step per GPU"
    )
    what.add_argument("--step-ms", type=float, help="compute time of one inner step")
    what.add_argument(
        "--step-jitter-ms",
        type=float,
        help="standard deviation of a site's compute per step, from step to step (default 0; "
        "--calibrate measures it)",
    )
    what.add_argument("--rtt-ms", type=float, help="every link's round trip")
    what.add_argument("--bandwidth-mbit", type=float, help="every link's bandwidth")
    what.add_argument(
        "--regions",
        type=int,
        help="with --sites: split the sites into this many regions in order (as evenly as "
        "they go); --rtt-ms and --bandwidth-mbit are then the links inside a region",
    )
    what.add_argument(
        "--between-rtt-ms", type=float, help="with --regions: every link across regions"
    )
    what.add_argument(
        "--between-mbit", type=float, help="with --regions: every link across regions"
    )
    what.add_argument(
        "--egress-mbit",
        type=float,
        help="with --regions: each region's long-haul capacity, shared by its sites' "
        "traffic to other regions (each way; default: not shared)",
    )
    what.add_argument("--strategy", choices=STRATEGIES, help="mark this strategy")
    what.add_argument("--sync-every", type=int, help="inner steps between rounds (H)")
    what.add_argument("--fragments", type=int, help="streaming: fragments of the model")
    what.add_argument("--overlap-steps", type=int, help="streaming: steps an exchange overlaps")
    what.add_argument(
        "--codec", choices=sorted(CODEC_BYTES_PER_VALUE), help="how values cross the WAN"
    )
    what.add_argument(
        "--fabric-gbit",
        type=float,
        help="in-site bandwidth per rank for the hierarchical step (default: measured Gloo "
        f"over loopback for an emulated job, else {DEFAULT_FABRIC_GBIT:g})",
    )
    what.add_argument(
        "--efficiency",
        type=float,
        help=f"the engine's fraction of the all-reduce bound (default {ENGINE_EFFICIENCY}, "
        f"measured over real TCP; {EMULATED_ENGINE_EFFICIENCY} for an emulated job)",
    )
    what.add_argument(
        "--calibrate",
        action="store_true",
        help="measure the step time on this machine at the job's concurrency (and, for an "
        "emulated job, the machine's data-plane rate with the job's sites): a short run of "
        "the built-in loop, or of your script given after -- (its step time and parameters)",
    )
    what.add_argument(
        "--machine-mbyte-s",
        type=float,
        help="an emulated job: the MB/s of data-plane bytes the machine running every site "
        "moves (--calibrate measures it); bounds every all-reduce phase",
    )


def _sim(args: argparse.Namespace) -> int:
    try:
        scenario = scenario_from(args)
    except ScenarioError as exc:
        raise UsageError(f"--{exc.field.replace('_', '-')}: {str(exc).split(': ', 1)[1]}") from None
    rows = []
    hardware = site_hardware(scenario.host_hardware)
    job = load_job(args.job) if args.job else None
    for strategy in STRATEGIES:
        # Each strategy with its own codec where the job leaves it to the defaults.
        codec = codec_for(args, strategy, job) if job is not None else scenario.codec
        row = _with(
            scenario,
            strategy=strategy,
            codec=codec,
            codec_bytes_per_s=hardware.codec_bytes_per_s(codec),
        )
        try:
            prediction = predict_run(row)
        except ScenarioError as exc:  # e.g. fragments > sync_every for sync's H = 1
            raise UsageError(str(exc)) from None
        rows.append(prediction.to_dict() | {"codec": codec})
    # Every algorithm's bound for one exchange of the whole model (what ``auto`` and
    # the exchange column choose from).
    model_bytes = scenario.params * CODEC_BYTES_PER_VALUE[scenario.codec]
    bounds = predict(
        model_bytes,
        list(scenario.sites),
        scenario.link,
        scenario.uplink_bytes_per_s,
        regions=scenario.regions,
        machine_bytes_per_s=scenario.machine_bytes_per_s,
    )
    regions = scenario.regions
    groups = regions.groups(list(scenario.sites)) if regions is not None else None
    out = {
        "scenario": {
            "model": scenario.model,
            "params": scenario.params,
            "sites": list(scenario.sites),
            "step_s": scenario.step_s,
            "slowest_step_s": scenario.pace_s,
            "runner_up_step_s": scenario.runner_up_s,
            "step_jitter_s": scenario.step_jitter_s,
            "tokens_per_step": scenario.tokens_per_step,
            "sync_every": scenario.sync_every,
            "fragments": scenario.fragments,
            "overlap_steps": scenario.overlap_steps,
            "codec": scenario.codec,
            "efficiency": scenario.efficiency,
            "machine_bytes_per_s": (
                machine if math.isfinite(machine := scenario.machine_bytes_per_s) else None
            ),
            "chosen": scenario.strategy,
            "host_work": site_hardware(scenario.host_hardware).describe(),
            "regions": (
                None
                if regions is None
                else {
                    "sites": groups,
                    "egress_mbit": {
                        name: rate * 8 / 1e6 for name, rate in regions.egress_bytes_per_s.items()
                    },
                }
            ),
        },
        "all_reduce_bounds_s": bounds,
        "predictions": rows,
        "validated_range": range_note(scenario),
        "validation": validated_range(scenario),
    }
    if args.json:
        print(to_json(out, indent=2))
        return 0
    sc = out["scenario"]
    print(
        f"{sc['model']}: {sc['params']:.3g} parameters, {len(sc['sites'])} sites, compute "
        f"{sc['step_s'] * 1e3:.1f} ms per inner step"
        + (
            f" (the slowest site {sc['slowest_step_s'] * 1e3:.1f} ms, the next"
            f" {sc['runner_up_step_s'] * 1e3:.1f} ms)"
            if sc["slowest_step_s"] > sc["step_s"]
            else ""
        )
        + (
            f", varying by {sc['step_jitter_s'] * 1e3:.1f} ms from step to step"
            if sc["step_jitter_s"]
            else ""
        )
        + f", {sc['tokens_per_step']:,.0f} tokens per "
        f"step (all sites), H={sc['sync_every']}, codec {sc['codec']}"
    )
    print(f"{'strategy':10s} {'step':>10s} {'round':>10s} {'exchange':>10s} {'all-reduce':>11s} "
          f"{'utilisation':>12s} {'WAN B/token':>12s} {'codec':>6s}")  # fmt: skip
    for row in rows:
        mark = " <" if row["strategy"] == sc["chosen"] else ""
        print(
            f"{row['strategy']:10s} {row['step_s'] * 1e3:8.1f}ms {row['round_s']:9.2f}s "
            f"{row['exchange_s']:9.2f}s {row['algorithm']:>11s} {row['utilization']:11.1%} "
            f"{row['wan_bytes_per_token']:12.1f} {row['codec']:>6s}{mark}"
        )
    print(
        f"all-reduce of the model ({model_bytes / 1e9:.3g} GB, codec {sc['codec']}), bounds: "
        + ", ".join(f"{name} {seconds:.3g} s" for name, seconds in bounds.items())
    )
    if sc["machine_bytes_per_s"]:
        print(
            f"one machine runs every site: {sc['machine_bytes_per_s'] / 1e6:.0f} MB/s of "
            "data-plane bytes bound each all-reduce phase"
        )
    if regions is not None and groups is not None:
        sizes = sorted({len(m) for m in groups.values()})
        print(
            f"regions: {len(groups)} of {' or '.join(map(str, sizes))} sites"
            + (
                f", long-haul {min(regions.egress_bytes_per_s.values()) * 8 / 1e6:g} "
                "Mbit/s each way"
                if regions.egress_bytes_per_s
                else ""
            )
        )
    host = sc["host_work"]
    print(
        f"host work on {host['hardware']}: outer step {scenario.outer_step_s * 1e3:.1f} ms per "
        f"exchange of the whole model, codec {sc['codec']} "
        f"{host['codec_ns_per_value'][sc['codec']]:.3g} ns per value; measured: "
        f"{'; '.join(host['measured'])}"
        + (f"; assumed: {'; '.join(host['assumed'])}" if host["assumed"] else "")
    )
    if out["validated_range"]:
        print(f"note: {out['validated_range']}")
    else:
        print(f"within the validated range: {out['validation']['validated_for']}")
    return 0


def _with(scenario: Scenario, **changes: Any) -> Scenario:
    import dataclasses

    return dataclasses.replace(scenario, **changes)


VALIDATED = {
    "sites": (2, 4),
    "ranks_per_site": (1, 2),
    "bandwidth_mbit": (10.0, 300.0),
    "rtt_ms": (30.0, 300.0),
    "params": (0.0, 1e6),
}
"""What the model's predictions were checked against (benchmarks/perf_model_validation.py,
its fit and held-out runs: docs/performance-model.md): emulated runs of the built-in
tiny model on this project's 2-core CPU machine, every strategy, 20-300 steps. A test
keeps this in step with the benchmark's cases."""


def validated_range(scenario: Scenario) -> dict[str, Any]:
    """The range the prediction is validated for, and where ``scenario`` lies outside it."""
    v = VALIDATED
    rates = [c.bandwidth_bytes_per_s * 8 / 1e6 for c in scenario.links.values()]
    rtts = [c.one_way_s * 2e3 for c in scenario.links.values()]
    outside = []
    if not v["sites"][0] <= len(scenario.sites) <= v["sites"][1]:
        outside.append(f"{len(scenario.sites)} sites")
    if not v["ranks_per_site"][0] <= scenario.site_ranks <= v["ranks_per_site"][1]:
        outside.append(f"{scenario.site_ranks} data-parallel ranks per site")
    for name, values, unit in (("bandwidth_mbit", rates, "Mbit/s"), ("rtt_ms", rtts, "ms")):
        low, high = v[name]
        off = sorted({round(x, 3) for x in values if not low - 1e-9 <= x <= high + 1e-9})
        if off:
            outside.append(f"links of {', '.join(f'{x:g}' for x in off)} {unit}")
    if scenario.params > v["params"][1]:
        outside.append(f"{scenario.params:.3g} parameters")
    if scenario.host_hardware != "cpu":
        outside.append(f"host work on {scenario.host_hardware} (modelled, not validated)")
    statement = (
        f"validated for {v['sites'][0]}-{v['sites'][1]} sites of "
        f"{v['ranks_per_site'][0]}-{v['ranks_per_site'][1]} ranks, links of "
        f"{v['bandwidth_mbit'][0]:g}-{v['bandwidth_mbit'][1]:g} Mbit/s and "
        f"{v['rtt_ms'][0]:g}-{v['rtt_ms'][1]:g} ms RTT, the tiny model emulated on a CPU "
        "(docs/performance-model.md)"
    )
    return {"validated_for": statement, "outside": outside}


def range_note(scenario: Scenario) -> str:
    """Empty inside the validated range; else a sentence naming what lies outside."""
    checked = validated_range(scenario)
    if not checked["outside"]:
        return ""
    return (
        f"outside the validated range in: {'; '.join(checked['outside'])} "
        f"({checked['validated_for']}): an extrapolation of the same formulas"
    )
