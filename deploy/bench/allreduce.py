"""``isthmus bench allreduce``: the cross-site all-reduce between site processes, emulated WAN.

Every site is its own process (``isthmus.deploy.bench.allreduce_worker``); the links
are ``isthmus wan up`` (the proxy backend) in a process of their own. Reported,
as the collective engine issue asks: the median seconds of a round, the best
alpha-beta bound of any algorithm on the topology, efficiency = bound /
measured, the data-plane bytes against the algorithm's theoretical volume,
the emulator's wire bytes, and the largest error against a float64 reference.
A round's time is the slowest site's, each site timing from the end of a
barrier before the round (the bound assumes the sites start together; Gloo's
baseline is timed the same way).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from isthmus.deploy.bench.emulator_bench import wan_up
from isthmus.deploy.bench.gloo_baseline import round_seconds, time_on_hosts
from isthmus.inter.transport import connections_for, connections_of
from isthmus.job.link import DirectionParams
from isthmus.job.model import Job
from isthmus.job.ports import free_ports
from isthmus.sim.cost import LinkCost, job_costs, predict, sent_share
from isthmus.sim.emulator_control import ControlClient
from isthmus.sim.hosts import TCP_BUFFER_MAX

ISTHMUS = [sys.executable, "-m", "isthmus"]


def job_bounds(job: Job, nbytes: float) -> dict[str, float]:
    """The alpha-beta time of each algorithm on a job's links and regions."""
    links, regions = job_costs(job)
    assert links is not None, "a bench job is emulated: it has links"
    uplinks = {s.name: s.uplink_mbit * 1e6 / 8 for s in job.sites if s.uplink_mbit is not None}
    return predict(nbytes, [s.name for s in job.sites], links, uplinks, regions=regions)


def two_level_volume(job: Job, nbytes: float) -> float:
    """Bytes all sites send in a two-level round, codec none: (m - 1) N inside each
    region of m to reduce-scatter and as much to gather, 2 (K - 1) N across the K
    regions."""
    sizes = [len(r.sites) for r in job.regions]
    inside = sum(2 * (m - 1) for m in sizes) * nbytes
    return inside + 2 * (len(sizes) - 1) * nbytes


def bounds(*, sites: int, nbytes: float, rtt_ms: float, bandwidth_mbit: float) -> dict[str, float]:
    """The alpha-beta time of each algorithm with one such link per pair of sites."""
    names = [f"site{i}" for i in range(sites)]
    cost = LinkCost.of(bandwidth_mbit=bandwidth_mbit, rtt_ms=rtt_ms)
    return predict(nbytes, names, lambda a, b: cost)


class SitesFailed(RuntimeError):
    """Site processes of a run exited with an error; ``errors``: each one's, by site."""

    def __init__(self, errors: dict[str, str]) -> None:
        self.errors = errors
        super().__init__("; ".join(f"{site}: {error}" for site, error in errors.items()))


@dataclass
class SiteRun:
    """What the site processes of one emulated all-reduce run reported."""

    results: list[dict[str, Any]]
    """Each site's JSON (see :mod:`isthmus.deploy.bench.allreduce_worker`), in site order."""
    wire: dict[str, Any]
    """The emulator's counters at the end."""
    seconds: float
    gloo: dict[str, Any] | None = None


def run_sites(
    sites: int,
    worker_flags: list[str],
    *,
    link: str = "{}",
    job: Job | None = None,
    hosts: bool = False,
    vs_gloo: bool = False,
    size_mib: float = 0.0,
    repeats: int = 0,
    announce: str | None = None,
    tcp_rmem_max: int | None = None,
) -> SiteRun:
    """Start ``isthmus wan up`` for ``sites`` sites joined by ``link`` (the job file's
    link mapping, e.g. ``{rtt_ms: 50, corrupt: 1e-6}``), one all-reduce worker per
    site with ``worker_flags``, and wait for them. ``job``: its sites (one process
    each), regions and links instead (``sites`` and ``link`` unused). With ``hosts``
    every site runs in its own emulated host (packet backend, real TCP);
    ``vs_gloo`` then also times Gloo's all-reduce of ``size_mib`` across the same
    hosts."""
    gloo: dict[str, Any] | None = None
    with tempfile.TemporaryDirectory(prefix="isthmus-allreduce-") as tmp:
        tmpdir = Path(tmp)
        names = [s.name for s in job.sites] if job else [f"site{i}" for i in range(sites)]
        job_file = tmpdir / "job.yaml"
        if hosts:  # each host has its own address; every site listens on port 7100
            entries: list[dict[str, Any]] = [{"name": n} for n in names]
        else:
            ports = free_ports("127.0.0.1", len(names))
            entries = [
                {"name": n, "address": f"127.0.0.1:{p}"} for n, p in zip(names, ports, strict=True)
            ]
        # A name of its own: two benches at once (of one job or two) must not claim
        # the same network namespaces or state files.
        name = f"{job.name if job else 'bench'}-{os.getpid()}"
        data: dict[str, Any] = {"name": name, "sites": entries}
        if job is not None:
            data |= {k: job.raw[k] for k in ("regions", "wan") if k in job.raw}
        else:
            data["wan"] = {"default": yaml.safe_load(link)}
        job_file.write_text(yaml.safe_dump(data, sort_keys=False))
        state = tmpdir / "state.json"
        backend = ["--hosts"] if hosts else ["--stats-every", "0"]
        if tcp_rmem_max is not None:
            backend += ["--tcp-rmem-max", str(tcp_rmem_max)]
        with wan_up(job_file, state, *backend):
            control = json.loads(state.read_text())["control"]
            host, port = control.rsplit(":", 1)
            if announce:
                print(announce, file=sys.stderr, flush=True)
            started = time.monotonic()

            def inside(site: str) -> list[str]:
                return [*ISTHMUS, "wan", "exec", str(job_file), site, "--"] if hosts else []

            # Each site gets its share of the cores, as `isthmus run` gives its ranks:
            # more torch threads than that only spin against each other.
            threads = max(1, (os.cpu_count() or 1) // len(names))
            env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
            workers = [
                subprocess.Popen(
                    [
                        *inside(name),
                        sys.executable,
                        "-m",
                        "isthmus.deploy.bench.allreduce_worker",
                        "--state",
                        str(state),
                        "--site",
                        name,
                        *worker_flags,
                        *(["--job", str(job_file)] if job is not None else []),
                        "--out",
                        str(tmpdir / f"{name}.json"),
                    ],
                    env=env,
                )
                for name in names
            ]
            codes = [w.wait(timeout=1800) for w in workers]
            errors = {
                name: _site_error(tmpdir / f"{name}.json", code)
                for name, code in zip(names, codes, strict=True)
                if code != 0
            }
            if errors:
                raise SitesFailed(errors)
            seconds = time.monotonic() - started
            wire = ControlClient((host, int(port))).stats()
            if vs_gloo:
                print("bench allreduce: Gloo on the same hosts", file=sys.stderr, flush=True)
                data = time_on_hosts(
                    job_file,
                    json.loads(state.read_text()),
                    names,
                    size_mib=size_mib,
                    repeats=repeats,
                )
                gloo = {"median_s": statistics.median(data["seconds"]), "correct": data["ok"]}
        results = [json.loads((tmpdir / f"{n}.json").read_text()) for n in names]
    return SiteRun(results, wire, seconds, gloo)


def _site_error(report: Path, code: int) -> str:
    """What a failed site process said of its failure (its report), or its exit code."""
    try:
        return str(json.loads(report.read_text())["error"])
    except (OSError, ValueError, KeyError):
        return f"exited with code {code} (its log is above)"


def run_allreduce_bench(
    *,
    sites: int,
    size_mib: float,
    rtt_ms: float | None,
    bandwidth_mbit: float | None,
    codec: str,
    repeats: int,
    algorithm: str = "direct",
    hosts: bool = False,
    vs_gloo: bool = False,
    idle_s: float = 0.0,
    queue_ms: float | None = None,
    tcp_rmem_max: int | None = None,
    verbose: bool = True,
    job: Job | None = None,
    connections: int | None = None,
) -> dict[str, Any]:
    """With ``hosts`` every site runs in its own emulated host (packet backend, real
    TCP); ``vs_gloo`` then also times Gloo's all-reduce across the same hosts.
    ``idle_s``: every site pauses this long between rounds (as compute would), so
    the rounds meet links that went quiet. ``queue_ms``: each link's bottleneck
    queue (``None``: the link model's default). ``tcp_rmem_max``: the hosts' largest
    TCP receive buffer (``None``: the hosts' default, 32 MiB). ``job``: its sites,
    regions and links instead of ``sites``, ``rtt_ms`` and ``bandwidth_mbit``.
    ``connections``: TCP connections from each site to each other (``None``: as many
    as the longest-fat link needs with the TCP window of the backend, see
    :func:`isthmus.inter.transport.connections_for`)."""
    queue = "" if queue_ms is None else f", queue_ms: {queue_ms}"
    if job is not None:
        sites = len(job.sites)
    window = (tcp_rmem_max or TCP_BUFFER_MAX) if hosts else DirectionParams().window_bytes
    if connections is None:  # auto: as many as the longest-fat link needs
        if job is None:
            assert rtt_ms is not None and bandwidth_mbit is not None
            connections = connections_for(bandwidth_mbit * 1e6 / 8, rtt_ms / 1e3, window)
        else:
            connections = max(
                connections_of(job, s.name, window_bytes=window if hosts else None)
                for s in job.sites
            )
    links = (
        f"the links of {job.source}"
        if job is not None
        else f"{rtt_ms:g} ms, {bandwidth_mbit:g} Mbit/s"
    )
    run = run_sites(
        sites,
        [
            "--size-mib",
            str(size_mib),
            "--codec",
            codec,
            "--algorithm",
            algorithm,
            *(
                ["--rtt-ms", str(rtt_ms), "--bandwidth-mbit", str(bandwidth_mbit)]
                if job is None
                else []
            ),
            "--repeats",
            str(repeats),
            "--idle-s",
            str(idle_s),
            "--connections",
            str(connections),
        ],
        link=f"{{rtt_ms: {rtt_ms}, bandwidth_mbit: {bandwidth_mbit}{queue}}}",
        job=job,
        hosts=hosts,
        vs_gloo=vs_gloo,
        size_mib=size_mib,
        repeats=repeats,
        tcp_rmem_max=tcp_rmem_max,
        announce=(
            f"bench allreduce: {sites} sites, {size_mib:g} MiB, codec {codec}, "
            f"{links}; {repeats} rounds after a warm-up"
            + (f", {idle_s:g} s apart" if idle_s else "")
        )
        if verbose
        else None,
    )
    results, wire, gloo = run.results, run.wire, run.gloo
    nbytes = size_mib * 2**20
    per_round = round_seconds([r["spans"] for r in results])
    median = statistics.median(per_round)
    if job is not None:
        b = job_bounds(job, nbytes)
    else:
        assert rtt_ms is not None and bandwidth_mbit is not None
        b = bounds(sites=sites, nbytes=nbytes, rtt_ms=rtt_ms, bandwidth_mbit=bandwidth_mbit)
    best = min(b.values())
    sent_per_round = sum(statistics.median(r["bytes_sent"]) for r in results)
    ran = results[0]["algorithm"]
    theoretical = (
        two_level_volume(job, nbytes)
        if ran == "two_level" and job is not None
        else sites * sent_share(ran, sites) * nbytes  # codec none
    )
    directions = [d for link in wire["links"] for k, d in link.items() if "->" in k]
    wire_bytes = sum(d["bytes"] for d in directions)
    extra: dict[str, Any] = {"backend": "hosts" if hosts else "proxy"}
    if hosts:  # real TCP: what the bottleneck queues dropped, and TCP sent again
        extra["tcp_rmem_max"] = tcp_rmem_max if tcp_rmem_max is not None else TCP_BUFFER_MAX
        extra["queue_drop_segments"] = sum(d.get("queue_drops", 0) for d in directions)
        extra["wire_segments"] = sum(d.get("segments", 0) for d in directions)
    # Where a round's time goes: the slowest site's milestone, median over rounds.
    names = list(results[0]["phases"][0]) if results[0].get("phases") else []
    if names and all(len(r["phases"]) == repeats for r in results):
        # Each milestone as the round is timed: from the last site's start to the
        # last site's passing it (each site's phases count from its own start).
        extra["phases_median_seconds"] = {
            name: round(
                statistics.median(
                    round_seconds(
                        [
                            [(start, start + phases.get(name, 0.0))
                             for (start, _), phases in zip(r["spans"], r["phases"], strict=True)]
                            for r in results
                        ]
                    )
                ),
                4,
            )
            for name in names
        }  # fmt: skip
    if gloo is not None:
        extra["gloo_median_seconds"] = gloo["median_s"]
        extra["gloo_efficiency"] = round(best / gloo["median_s"], 3)
        extra["speedup_over_gloo"] = round(gloo["median_s"] / median, 3)
        extra["gloo_correct"] = gloo["correct"]
    if job is not None:
        extra["job"] = job.source
    return {
        "sites": sites,
        "size_mib": size_mib,
        "rtt_ms": rtt_ms,
        "bandwidth_mbit": bandwidth_mbit,
        "codec": codec,
        "algorithm": algorithm if algorithm != "auto" else f"auto: {results[0]['algorithm']}",
        "rounds": repeats,
        "idle_s": idle_s,
        "queue_ms": queue_ms if queue_ms is not None else DirectionParams().queue_ms,
        "connections_per_peer": connections,
        "tcp_window_bytes": window,
        "seconds": [round(s, 3) for s in per_round],
        "median_seconds": round(median, 3),
        "bound_seconds": round(best, 3),
        "bounds": {k: round(v, 3) for k, v in b.items()},
        "efficiency": round(best / median, 3),
        "algorithm_efficiency": round(b[results[0]["algorithm"]] / median, 3),
        "data_plane_bytes_per_round": int(sent_per_round),
        "theoretical_bytes_per_round": int(theoretical),
        "data_plane_over_theoretical": round(sent_per_round / theoretical, 4),
        "emulator_wire_bytes": int(wire_bytes),
        "max_abs_error": max(r["max_abs_error"] for r in results),
        "identical_on_all_sites": len({r["digest"] for r in results}) == 1,
        "wall_seconds": round(run.seconds, 1),
        **extra,
    }


def format_allreduce_report(r: dict[str, Any]) -> str:
    return "\n".join(
        [
            f"all-reduce of {r['size_mib']:g} MiB across {r['sites']} sites ({r['algorithm']}, "
            f"codec {r['codec']}), "
            + (
                f"the links of {r['job']}"
                if "job" in r
                else f"links {r['bandwidth_mbit']:g} Mbit/s and {r['rtt_ms']:g} ms RTT"
            )
            + (f", {r['queue_ms']:g} ms queues" if "queue_ms" in r else ""),
            f"  median {r['median_seconds']:.3f} s over {r['rounds']} rounds {r['seconds']}"
            + (f", {r['idle_s']:g} s idle between rounds" if r.get("idle_s") else ""),
            f"  bound {r['bound_seconds']:.3f} s ("
            + ", ".join(f"{name} {s:.3f}" for name, s in r["bounds"].items())
            + f"); efficiency {r['efficiency']:.2f} "
            f"({r['algorithm_efficiency']:.2f} of the bound of the algorithm it ran)",
            f"  data-plane bytes per round {r['data_plane_bytes_per_round']:,} "
            f"({r['data_plane_over_theoretical']:.4f} of the algorithm's volume); "
            f"emulator wire bytes in all {r['emulator_wire_bytes']:,}",
            *(
                [
                    "  round milestones (slowest site, median): "
                    + ", ".join(f"{k} {v:.3f} s" for k, v in r["phases_median_seconds"].items())
                ]
                if "phases_median_seconds" in r
                else []
            ),
            f"  max |error| vs float64 {r['max_abs_error']:.3g}; identical on all sites: "
            f"{r['identical_on_all_sites']}; backend {r['backend']}"
            + (
                f", {r['connections_per_peer']} connections per peer "
                f"(TCP window {r['tcp_window_bytes'] / 2**20:g} MiB)"
                if "connections_per_peer" in r
                else ""
            ),
            *(
                [
                    f"  Gloo on the same links: median {r['gloo_median_seconds']:.3f} s "
                    f"(efficiency {r['gloo_efficiency']:.2f}); Isthmus is "
                    f"{r['speedup_over_gloo']:.2f}x faster"
                ]
                if "gloo_median_seconds" in r
                else []
            ),
        ]
    )
