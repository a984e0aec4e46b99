"""How ``isthmus sim`` describes a job or its flags as a performance-model scenario.

A job file gives the sites, links, regions, ranks and strategy; flags override
them or describe a scenario without a job. The compute per step comes from
``--step-ms``, from FLOPs (``--gpu``, ``--mfu``) or from a calibration here
(``--calibrate``), and for an emulated job the machine that runs every site
bounds the all-reduce phases (``--machine-mbyte-s``, or measured).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from pathlib import Path
from typing import Any

from isthmus.job.compressor import is_sparse
from isthmus.job.file import Job, load_job
from isthmus.job.settings import TrainSettings
from isthmus.sim.cost import LinkCost, Regions, job_costs
from isthmus.sim.hardware import SiteHardware, site_hardware
from isthmus.sim.perf_model import (
    CODEC_BYTES_PER_VALUE,
    Scenario,
    ScenarioError,
    step_seconds_from_flops,
    uniform_links,
)
from isthmus.sim.topology import Topology

ENGINE_EFFICIENCY = 0.92
"""The direct all-reduce's measured fraction of its bound over real TCP (``isthmus bench
allreduce --hosts``: 3 sites at 200 Mbit/s, 64 MiB: 0.913-0.921; 2 sites at 1 Gbit/s:
0.911; docs/benchmarks.md), for sites on a real WAN."""
EMULATED_ENGINE_EFFICIENCY = 0.975
"""The same on the emulator's proxy backend, which an emulated job runs on (3 sites at
200 Mbit/s, 64 MiB: 0.971-0.979). An earlier measurement's 0.88 stood here until the
held-out validation showed exchanges at 20 Mbit/s reaching their bound
(docs/performance-model.md, "Validation")."""
DEFAULT_GPU = "h100"
"""The sites' accelerator when neither --gpu nor the job says: host work at its speeds."""
PEER_OVERHEAD_S = 0.0
"""Host work of one exchange per peer site here, beyond the wire and the wait for
the last site: none measurable. Fitted to DiLoCo runs of 2 and 4 sites on a fast
link (benchmarks/perf_model_validation.py, twice on 2026-11-24: 0 ms). Before the
model had the wait for the last site, the same fit put 6-19 ms here: that wait."""
GLOO_LOOPBACK_BYTES_PER_S = 900e6
GLOO_LOOPBACK_LATENCY_S = 0.25e-3
"""The in-site step here (Gloo over loopback, a 2-rank site beside two busy processes):
2-3 ms for the tiny model's 1.9 MB, medians of four runs of ``python
benchmarks/in_site_fabric.py`` (838-1,126 MB/s, 0.10-0.27 ms; 2026-12-02). These were
60 MB/s and 1 ms, read from the 18-42 ms median over ranks of
``benchmarks/hierarchical_step.py``, which includes a rank's wait for the other to
finish its backward pass; with them the model put 33 ms of every 2-rank exchange
in the fabric, and predicted a 2+2-rank sync run's step 19% long."""
DEFAULT_FABRIC_GBIT = 400.0
"""In-site bandwidth per rank for real sites when not given: one 400G NIC per GPU."""


def scenario_from(args: argparse.Namespace) -> Scenario:
    job = load_job(args.job) if args.job else None
    train = job.train if job else None
    sites = _sites(job, args)
    if args.rtt_ms is not None or args.bandwidth_mbit is not None or job is None or job.wan is None:
        if args.rtt_ms is None or args.bandwidth_mbit is None:
            raise ScenarioError(
                "bandwidth_mbit", "give --rtt-ms and --bandwidth-mbit (the job has no wan:)"
            )
        links = uniform_links(sites, bandwidth_mbit=args.bandwidth_mbit, rtt_ms=args.rtt_ms)
    else:
        links = _job_links(job, sites)
    regions = job_costs(job)[1] if job is not None and args.sites is None else None
    if getattr(args, "regions", None) is not None:
        regions = _flag_regions(args, sites, links)
    elif any(
        getattr(args, flag, None) is not None
        for flag in ("between_rtt_ms", "between_mbit", "egress_mbit")
    ):
        raise ScenarioError("regions", "--between-rtt-ms, --between-mbit and --egress-mbit "
                            "describe regions: give --regions K too")  # fmt: skip
    measured = _calibration(args, job)
    params = args.params or (measured.parameters if measured else None)
    if params is None and job is not None and getattr(args, "command", None) is None:
        params = _job_params(job)
    if params is None:
        raise ScenarioError(
            "params",
            "give --params (no job file)" if job is None else "give --params: the script's "
            "calibration run reported no parameter count",
        )
    gpus = args.gpus_per_site if args.gpus_per_site is not None else 1
    if gpus < 1:
        raise ScenarioError("gpus_per_site", f"must be >= 1, got {gpus}")
    if job is not None and args.gpus_per_site is not None and args.sites is None:
        ranks = sorted({s.ranks for s in job.sites})
        if ranks != [gpus]:
            raise ScenarioError(
                "gpus_per_site",
                f"{gpus} GPUs per site, but the job's sites have "
                f"{' and '.join(map(str, ranks))} ranks (one GPU each); change the sites' "
                "ranks in the job file, or describe the scenario with --sites",
            )
    given_tokens = getattr(args, "tokens_per_step", None)
    if given_tokens is not None:
        tokens = given_tokens  # what a script's calibration run counted
    elif measured is not None and measured.tokens_per_step:
        tokens = measured.tokens_per_step
    elif args.job and job is not None and args.gpu is None and args.params is None:
        seq_len, batch = _job_tokens(job)
        tokens = sum(s.layout.dp for s in job.sites) * batch * seq_len
    else:
        tokens = len(sites) * gpus * args.tokens_per_gpu
    step_s, slowest_s, runner_up_s, jitter_s = _step_seconds(
        args, params, tokens / len(sites) / gpus, measured
    )
    given_jitter = getattr(args, "step_jitter_ms", None)
    if given_jitter is not None:
        if not (0 <= given_jitter < math.inf):
            raise ScenarioError("step_jitter_ms", f"must be >= 0, got {given_jitter}")
        jitter_s = given_jitter / 1e3
    strategy = args.strategy or (train.strategy if train else "diloco")
    hardware = _hardware(job, args)
    codec = codec_for(args, strategy, job)
    if is_sparse(codec):
        # Its result carries the union of the sites' positions: more bytes down than
        # up, which the model's symmetric exchange does not describe.
        raise ScenarioError(
            "codec",
            "the performance model does not cost the topk codec; pass --codec with a dense "
            f"one ({', '.join(CODEC_BYTES_PER_VALUE)}) to predict the job as if it used it",
        )
    return Scenario(
        model=_model_named(args, job, measured),
        params=params,
        step_s=step_s,
        slowest_step_s=slowest_s,
        runner_up_step_s=runner_up_s,
        step_jitter_s=jitter_s,
        tokens_per_step=tokens,
        sites=sites,
        links=links,
        regions=regions,
        strategy=strategy,
        sync_every=_given(args.sync_every, train.sync_every if train else 50),
        # The whole run, its final synchronisation included, as isthmus run measures it.
        steps=train.steps if train else None,
        fragments=_given(args.fragments, train.fragments if train else 2),
        overlap_steps=_given(args.overlap_steps, train.overlap_steps if train else 1),
        # The model counts a codec's fixed size; zstd's gain depends on the data.
        codec=codec,
        codec_bytes_per_s=hardware.codec_bytes_per_s(codec),
        host_link_bytes_per_s=hardware.host_link_bytes_per_s,
        efficiency=_efficiency(job, args),
        host_hardware=hardware.name,
        **_host_work(job, params, hardware),
        **_fabric(job, args),
        machine_bytes_per_s=_machine(job, args),
    )


def codec_for(args: argparse.Namespace, strategy: str, job: Job | None = None) -> str:
    """The codec a prediction for ``strategy`` costs: ``--codec``; else the job file's
    own; else, where the job file leaves it unset, that strategy's default (sync's
    gradients cross as float32, the DiLoCo family's pseudo-gradients as int2), as
    ``isthmus run --strategy`` would run it; ``none`` without a job file. The
    model counts a codec's fixed size: ``+zstd``'s gain depends on the data."""
    if args.codec:
        return args.codec
    if job is None and args.job:
        job = load_job(args.job)
    if job is None:
        return "none"
    given = (job.raw.get("train") or {}).get("codec")
    settings = job.train if given is not None else TrainSettings(strategy=strategy)
    return settings.codec.partition("+")[0]


def _machine(job: Job | None, args: argparse.Namespace) -> float:
    """The data-plane rate of the one machine that runs an emulated job's sites:
    given, measured (``--calibrate``), or unbounded (real sites, or not asked)."""
    given = getattr(args, "machine_mbyte_s", None)
    if given is not None:
        if not (0 < given < math.inf):
            raise ScenarioError("machine_mbyte_s", f"must be > 0 MB/s, got {given}")
        return given * 1e6
    if job is None or job.wan is None or not getattr(args, "calibrate", False):
        return math.inf
    from isthmus.deploy.bench.calibrate import machine_rate

    print("calibrating: this machine's data-plane rate with the job's sites ...", file=sys.stderr)
    rate, _ = machine_rate(Path(args.job))
    return rate


def _flag_regions(
    args: argparse.Namespace, sites: list[str], links: dict[frozenset[str], LinkCost]
) -> Regions:
    """``--regions K``: the sites in K regions of consecutive sites (sizes differing by
    at most one), the links across them set to ``--between-*`` in place (``links``),
    and each region's shared long-haul capacity ``--egress-mbit``."""
    count = args.regions
    if args.sites is None:
        raise ScenarioError("regions", "give --sites too (a job file states its own regions)")
    if not 1 <= count <= len(sites):
        raise ScenarioError("regions", f"must be in 1..{len(sites)} (the sites), got {count}")
    of = {site: f"region{i * count // len(sites)}" for i, site in enumerate(sites)}
    rtt = _given(args.between_rtt_ms, args.rtt_ms)
    rate = _given(args.between_mbit, args.bandwidth_mbit)
    if rtt < 0:
        raise ScenarioError("between_rtt_ms", f"must be >= 0, got {rtt}")
    if not rate > 0:
        raise ScenarioError("between_mbit", f"must be > 0, got {rate}")
    across = LinkCost.of(bandwidth_mbit=rate, rtt_ms=rtt)
    for pair in links:
        a, b = sorted(pair)
        if of[a] != of[b]:
            links[pair] = across
    egress = {}
    if args.egress_mbit is not None:
        if not args.egress_mbit > 0:
            raise ScenarioError("egress_mbit", f"must be > 0, got {args.egress_mbit}")
        egress = {region: args.egress_mbit * 1e6 / 8 for region in set(of.values())}
    return Regions(of, egress)


def _fabric(job: Job | None, args: argparse.Namespace) -> dict[str, Any]:
    """The hierarchical step's in-site part: the job's data-parallel ranks per site,
    each moving its tensor- and pipeline-parallel shard of the values."""
    given = getattr(args, "fabric_gbit", None)
    if given is not None and not (given > 0):
        raise ScenarioError("fabric_gbit", f"must be > 0, got {given}")
    if job is None:
        return {}
    dp = max(s.layout.dp for s in job.sites)
    shards = min(s.layout.tp * s.layout.pp for s in job.sites)
    if given is not None:
        rate, latency = given * 1e9 / 8, 10e-6
    elif job.wan is not None:
        rate, latency = GLOO_LOOPBACK_BYTES_PER_S, GLOO_LOOPBACK_LATENCY_S
    else:
        rate, latency = DEFAULT_FABRIC_GBIT * 1e9 / 8, 10e-6
    return {"site_ranks": dp, "fabric_bytes_per_s": rate * shards, "fabric_latency_s": latency}


def _efficiency(job: Job | None, args: argparse.Namespace) -> float:
    given = getattr(args, "efficiency", None)
    if given is not None:
        return given
    return (
        EMULATED_ENGINE_EFFICIENCY if job is not None and job.wan is not None else ENGINE_EFFICIENCY
    )


def _hardware(job: Job | None, args: argparse.Namespace) -> SiteHardware:
    """Where the sites' host work runs: this machine's CPU for a job emulated here (or
    one that trains on the CPU), else the --gpu named, else :data:`DEFAULT_GPU`."""
    if job is not None and (job.wan is not None or job.train.device == "cpu"):
        return site_hardware("cpu")
    return site_hardware(getattr(args, "gpu", None) or DEFAULT_GPU)


def _host_work(job: Job | None, params: float, hardware: SiteHardware) -> dict[str, float]:
    """The outer step over the whole model at the hardware's speed. For a job emulated
    on this machine, every rank shares its cores (host work overlapping the others'
    compute shares them): host work runs processes-per-core times slower."""
    work = {"outer_step_s": hardware.outer_step_s_per_value * params}
    if job is None or job.wan is None:
        return work
    ranks = sum(s.ranks for s in job.sites)
    return work | {
        "peer_overhead_s": PEER_OVERHEAD_S,
        "host_contention": max(1.0, ranks / (os.cpu_count() or 1)),
    }


def _given(flag: Any, default: Any) -> Any:
    return default if flag is None else flag


def _sites(job: Job | None, args: argparse.Namespace) -> list[str]:
    if args.sites is not None:
        if args.sites < 1:
            raise ScenarioError("sites", f"must be >= 1, got {args.sites}")
        return [f"site{i}" for i in range(args.sites)]
    if job is None:
        raise ScenarioError("sites", "give --sites (no job file)")
    return [s.name for s in job.sites]


def _job_links(job: Job, sites: list[str]) -> dict[frozenset[str], LinkCost]:
    topology = Topology.for_job(job, {s.name: [("127.0.0.1", 1)] * s.ranks for s in job.sites})
    links = {}
    for a, b in topology.pairs():
        params = topology.link_params(a, b)
        rate = min(
            d.bandwidth_mbit if d.bandwidth_mbit is not None else 1e6
            for d in (params.a_to_b, params.b_to_a)
        )
        links[frozenset((a, b))] = LinkCost.of(bandwidth_mbit=rate, rtt_ms=params.rtt_ms)
    return links


def _job_params(job: Job) -> float:
    if ":" in job.model:
        from isthmus.intra.plugins import load_model

        return float(sum(p.numel() for p in load_model(job.model).parameters()))
    from isthmus.job.sizes import config_for

    return float(config_for(job.model).parameter_count())


def _job_tokens(job: Job) -> tuple[int, int]:
    from isthmus.job.sizes import config_for

    seq_len = config_for(job.model).seq_len if ":" not in job.model else 64
    return seq_len, job.train.batch_size


def _model_named(args: argparse.Namespace, job: Job | None, measured: Any) -> str:
    """What the prediction is of: the calibration's model (the built-in loop's or the
    script's), the job's built-in model, or the flags."""
    if measured is not None:
        return f"calibrated on {measured.described()}"
    if getattr(args, "params", None) or job is None:
        return "the parameters given (--params)"
    return f"the built-in model {job.model}"


def _calibration(args: argparse.Namespace, job: Job | None) -> Any:
    """``--calibrate`` (with a job file, no ``--step-ms``): a short run of the job, of
    the built-in loop or of the script after ``--``; None when not asked."""
    command = getattr(args, "command", None)
    if command and not (job is not None and getattr(args, "calibrate", False)):
        raise ScenarioError(
            "calibrate", "a command after -- is what --calibrate measures: add --calibrate "
            "and a job file",
        )  # fmt: skip
    if job is None or not getattr(args, "calibrate", False) or args.step_ms is not None:
        return None
    from isthmus.deploy.bench.calibrate import calibrate

    # On stderr: stdout is the prediction (JSON with --json).
    what = f"the script {' '.join(command)}" if command else "the job"
    print(f"calibrating: a short run of {what}, synchronising as it does ...", file=sys.stderr)
    try:
        return calibrate(Path(args.job), command=command)
    except RuntimeError as exc:
        raise ScenarioError("calibrate", f"{exc}; or give --step-ms") from None


def _step_seconds(
    args: argparse.Namespace, params: float, tokens: float, measured: Any
) -> tuple[float, float | None, float | None, float]:
    """Compute seconds per inner step of a typical site, of the slowest one and the
    second slowest where a calibration measured the sites apart (None: all alike),
    and how much a site's varies from step to step (0 unless measured)."""
    if args.step_ms is not None:
        if args.step_ms <= 0:
            raise ScenarioError("step_ms", f"must be > 0, got {args.step_ms}")
        return args.step_ms / 1e3, None, None, 0.0
    if measured is not None:
        return (
            measured.step_s,
            measured.slowest_step_s,
            measured.runner_up_step_s,
            measured.jitter_s,
        )
    if args.gpu is not None:
        return step_seconds_from_flops(params, tokens, args.gpu, args.mfu), None, None, 0.0
    raise ScenarioError(
        "step_ms", "give --step-ms, --gpu (FLOPs at --mfu), or --calibrate (measure here)"
    )


def job_scenario(
    job_path: Path,
    step_s: float,
    jitter_s: float = 0.0,
    *,
    params: float | None = None,
    tokens_per_step: float | None = None,
    calibration: Any = None,
) -> Scenario:
    """The job file's scenario with a known compute time per inner step and its
    variation (what ``isthmus sim JOB --step-ms --step-jitter-ms`` predicts from);
    ``params`` and ``tokens_per_step``: a script's, as its calibration run counted
    them (else the built-in model's); ``calibration``: the run that measured the
    step time, which the scenario names."""
    args = argparse.Namespace(
        job=str(job_path),
        params=params,
        tokens_per_step=tokens_per_step,
        sites=None,
        gpus_per_site=None,
        gpu=None,
        mfu=0.4,
        tokens_per_gpu=4096 * 2,
        step_ms=step_s * 1e3,
        step_jitter_ms=jitter_s * 1e3,
        rtt_ms=None,
        bandwidth_mbit=None,
        strategy=None,
        sync_every=None,
        fragments=None,
        overlap_steps=None,
        codec=None,
        fabric_gbit=None,
        efficiency=None,
        calibrate=False,
    )
    scenario = scenario_from(args)
    if calibration is not None:
        scenario = dataclasses.replace(scenario, model=f"calibrated on {calibration.described()}")
    return scenario
